"""The set of live requests, the one ticker that watches them, and one-shot worker exchanges
(tokenize, detokenize, and embeddings, which take a slot).

Runs in the gateway process, on its asyncio loop. Owns the registry of live `RequestOwner`s (the
gateway's in-flight count is its size, never a counter kept by hand), the draining flag, and one
ticker task for every stream: SSE keep-alives on quiet streams, and dropping clients that stopped
reading. Requests are ended only through their owner's `abort`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

from gateway.errors import APIError, InvalidRequest, RequestTimeout, ServiceUnavailable, WorkerFailed
from gateway.observability.metrics import RequestRecorder
from gateway.serving.outputs import ChoiceInput
from gateway.serving.request_owner import RequestOwner
from gateway.serving.router import ModelRoute
from gateway.serving.worker_link import WorkerLink
from wire import messages as wire

logger = logging.getLogger(__name__)


class GenerationService:
    def __init__(self, link: WorkerLink, keepalive_s: float, write_stall_timeout_s: float) -> None:
        self.link = link
        self.keepalive_s = keepalive_s
        self.write_stall_timeout_s = write_stall_timeout_s
        self.draining = False
        self.requests: set[RequestOwner] = set()
        self._ticker: asyncio.Task[None] | None = None

    @property
    def in_flight(self) -> int:
        return len(self.requests)

    def start(self) -> None:
        self._ticker = asyncio.create_task(self._tick_forever(), name="request-ticker")

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)

    def open(
        self,
        route: ModelRoute,
        inputs: list[ChoiceInput],
        params: wire.SamplingParams,
        deadline: float,
        recorder: RequestRecorder,
        streaming: bool,
    ) -> RequestOwner:
        """A new request's owner; call `admit()` on it next."""
        if self.draining:
            raise ServiceUnavailable("the server is shutting down", code="shutting_down")
        return RequestOwner(self, route, inputs, params, deadline, recorder, streaming)

    def abort_all(self, error: APIError) -> None:
        for owner in list(self.requests):
            owner.abort(error)

    def abort_queued(self, model: str, error: APIError) -> int:
        """Abort the requests for `model` that no worker has accepted yet; returns how many."""
        owners = [o for o in self.requests if o.route.config.name == model and not o.admitted]
        for owner in owners:
            owner.abort(error)
        return len(owners)

    def abort_on_worker(self, worker_id: str, error: APIError) -> int:
        """Abort the requests with an unfinished job on this worker; returns how many."""
        owners = [
            o for o in self.requests if any(c.worker_id == worker_id and not c.finished for c in o.choices)
        ]
        for owner in owners:
            owner.abort(error)
        return len(owners)

    async def exchange(
        self, route: ModelRoute, build: Callable[[str], wire.Tokenize | wire.Detokenize], timeout_s: float
    ) -> wire.Tokens:
        """One request/reply with a ready worker (tokenize, detokenize); takes no generation slot."""
        if self.draining:
            raise ServiceUnavailable("the server is shutting down", code="shutting_down")
        replica = route.any_ready()
        try:
            reply = await self.link.exchange(replica.id, build(uuid.uuid4().hex), timeout_s)
        except asyncio.TimeoutError:
            raise RequestTimeout("the worker did not answer in time") from None
        if reply is False:
            raise WorkerFailed(f"the worker for model '{route.config.name}' is unreachable")
        if isinstance(reply, wire.Rejected):
            raise InvalidRequest(reply.message, code=reply.code.value, param=reply.param)
        return reply  # type: ignore[no-any-return]

    async def embed(
        self, route: ModelRoute, message: wire.Embed, size: int, deadline: float
    ) -> wire.Embeddings:
        """Embeddings from a replica, taking one of its slots (so the model's queue bounds and 429
        apply as for generation); the worker batches what it holds at once."""
        if self.draining:
            raise ServiceUnavailable("the server is shutting down", code="shutting_down")
        replica = await route.acquire(deadline, size, size)
        try:
            timeout = max(deadline - time.monotonic(), 0.001)
            reply = await self.link.exchange(replica.id, message, timeout)
        except asyncio.TimeoutError:
            raise RequestTimeout("the request timed out") from None
        finally:
            route.release(replica, size)
        if reply is False:
            raise WorkerFailed(f"the worker for model '{route.config.name}' is unreachable")
        if isinstance(reply, wire.Rejected):
            raise InvalidRequest(reply.message, code=reply.code.value, param=reply.param)
        return reply  # type: ignore[no-any-return]

    async def _tick_forever(self) -> None:
        """Keep-alive pings, and dropping clients that stopped reading; one task for all requests."""
        while True:
            await asyncio.sleep(min(self.keepalive_s / 2, self.write_stall_timeout_s / 4, 1.0))
            now = time.monotonic()
            for owner in list(self.requests):
                # Finished requests count too: their last outputs may be stuck behind a client that
                # stopped reading, holding a connection.
                if owner.queue.qsize() and now - owner.last_consumed >= self.write_stall_timeout_s:
                    logger.warning("client stopped reading; dropping it")
                    owner.abort(ServiceUnavailable("the client stopped reading", code="slow_reader"))
                    owner.drop_connection()
                elif not owner.ended and now - owner.last_activity >= self.keepalive_s:
                    owner.keep_alive()
