"""A one-shot worker request (tokenize, detokenize, embed), owned like a generation.

Runs in the gateway process, on its asyncio loop. `ExchangeOwner` is to a one-shot exchange what
`RequestOwner` is to a generation: it is in the service's set of live requests from the start to
its answer, so a shutdown drain waits for it, and a shutdown, a reload or an unload ends it
through `abort` with the same errors a generation gets. An embedding takes one of the replica's
slots (so the model's queue bounds and 429 apply); tokenize and detokenize take none and go to
any ready replica. The worker's answer, a refusal, its death, the deadline and an abort all end
the one `run` call. An embedding that ends unanswered (its deadline, its client gone, an abort) is
cancelled on its worker, which would otherwise run all its inputs for nobody, holding up the
requests behind it; tokenize and detokenize are answered too soon for a Cancel to matter.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gateway.errors import (
    APIError,
    ClientClosed,
    InvalidRequest,
    RequestTimeout,
    ServiceUnavailable,
    WorkerFailed,
    as_api_error,
)
from gateway.observability.logging_setup import log_context
from gateway.serving.router import AdmissionStopped
from wire import messages as wire
from wire.results import RejectCode

if TYPE_CHECKING:
    from gateway.link.handle import WorkerHandle
    from gateway.serving.router import ModelRoute
    from gateway.serving.service import GenerationService

logger = logging.getLogger(__name__)

OneShot = wire.Tokenize | wire.Detokenize | wire.Embed


class ExchangeOwner:
    def __init__(self, service: GenerationService, route: ModelRoute, deadline: float) -> None:
        self.service = service
        self.route = route
        self.deadline = deadline
        self._log_fields = log_context()  # the HTTP request's (request id, model) for lines logged elsewhere
        self.admitted = False  # sent to a worker
        self.ended = False
        self.closed = False
        self.error: APIError | None = None
        self.outcome: int | None = None
        self.worker_id: str | None = None
        self._replica: WorkerHandle | None = None  # set while a slot is held
        self._work = 0
        self._aborted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        service.requests.add(self)

    async def run(self, build: Callable[[str], OneShot], slot_work: int | None = None) -> Any:
        """Send the message `build(rid)` makes and return the worker's answer (Tokens or
        Embeddings); `slot_work` takes a slot of that size first. Raises the APIError it ended with."""
        try:
            return await self._run(build, slot_work)
        except BaseException as exc:
            self.abort(as_api_error(exc))
            raise
        finally:
            self.close()

    async def _run(self, build: Callable[[str], OneShot], slot_work: int | None) -> Any:
        route = self.route
        if slot_work is not None:
            try:
                replica = await route.acquire(self.deadline, slot_work, slot_work, stop=self._aborted)
            except AdmissionStopped:
                assert self.error is not None
                raise self.error from None
            self._replica, self._work = replica, slot_work
        else:
            replica = route.any_ready()
        self.worker_id = replica.id
        self.admitted = True
        timeout = max(self.deadline - time.monotonic(), 0.001)
        message = build(uuid.uuid4().hex)
        exchange = asyncio.ensure_future(self.service.link.exchange(replica.id, message, timeout))
        try:
            await asyncio.wait({exchange, self._aborted}, return_when=asyncio.FIRST_COMPLETED)
            if self.error is not None:
                raise self.error
            try:
                reply = exchange.result()
            except asyncio.TimeoutError:
                self._cancel_on_worker(replica.id, message)
                raise RequestTimeout("the request timed out") from None
        finally:
            if not exchange.done():
                exchange.cancel()
                self._cancel_on_worker(replica.id, message)  # before the await: a second cancel may end it
                await asyncio.gather(exchange, return_exceptions=True)
        if reply is False:
            raise WorkerFailed(f"the worker for model '{route.config.name}' is unreachable")
        if isinstance(reply, wire.Rejected):
            error_class = ServiceUnavailable if reply.code is RejectCode.SHUTTING_DOWN else InvalidRequest
            raise error_class(reply.message, code=reply.code.value, param=reply.param)
        self.ended = True
        self.outcome = 200
        return reply

    def _cancel_on_worker(self, worker_id: str, message: OneShot) -> None:
        # Sent after the Embed, if that went out at all: an unknown request id is nothing to a worker.
        if isinstance(message, wire.Embed):
            self.service.link.send(worker_id, wire.Cancel(message.rid))

    # ---- the service's view ----------------------------------------------------------------------

    def holds_job_on(self, worker_id: str) -> bool:
        return self.admitted and not self.ended and self.worker_id == worker_id

    def tick(self, now: float, keepalive_s: float, stall_s: float) -> None:
        """Nothing streams: the deadline bounds the wait, the answer is one frame."""

    def abort(self, error: APIError) -> None:
        if self.ended or self.closed:
            return
        self.ended = True
        self.error = error
        self.outcome = error.status
        self._release()
        if not self._aborted.done():
            self._aborted.set_result(None)
        if not isinstance(error, ClientClosed):
            # The request's own fields: an end decided elsewhere (a worker's crash, in the supervisor's
            # task) would otherwise be logged without the request id that the access line has.
            logger.info("request ended early: %s (%s)", error.code, error.message, extra=self._log_fields)

    def close(self) -> None:
        if self.closed:
            return
        if not self.ended:
            self.abort(ClientClosed())
        self.closed = True
        self._release()
        self.service.requests.discard(self)

    def _release(self) -> None:
        if self._replica is not None:
            self.route.release(self._replica, self._work)
            self._replica = None
