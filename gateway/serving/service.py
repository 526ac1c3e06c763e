"""The set of live requests, and the one ticker that watches them.

Runs in the gateway process, on its asyncio loop. Owns the registry of live requests, generations
(`RequestOwner`) and one-shot exchanges (`ExchangeOwner`: tokenize, detokenize, embeddings) alike:
the gateway's in-flight count is its size, never a counter kept by hand, and a drain, a shutdown or
a reload sees every request. Also the draining flag, and one ticker task for every stream: SSE
keep-alives on quiet streams, and dropping clients that stopped reading. Requests are ended only
through their owner's `abort`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from gateway.errors import APIError, ServiceUnavailable
from gateway.link.worker_link import WorkerLink
from gateway.observability.metrics import RequestRecorder
from gateway.observability.tracing import RequestSpan
from gateway.serving.admissions import CURRENT, Admissions
from gateway.serving.choice_text import TextPlan
from gateway.serving.exchange_owner import ExchangeOwner
from gateway.serving.outputs import ChoiceInput
from gateway.serving.request_owner import RequestOwner
from gateway.serving.router import ModelRoute
from wire import messages as wire

logger = logging.getLogger(__name__)


class LiveRequest(Protocol):
    """What the service needs of a live request, generation or exchange."""

    route: ModelRoute
    admitted: bool  # sent to a worker (else still waiting in the gateway)

    def holds_job_on(self, worker_id: str) -> bool: ...

    def abort(self, error: APIError) -> None: ...

    def tick(self, now: float, keepalive_s: float, stall_s: float) -> None: ...


class GenerationService:
    def __init__(self, link: WorkerLink, keepalive_s: float, write_stall_timeout_s: float) -> None:
        self.link = link
        self.keepalive_s = keepalive_s
        self.write_stall_timeout_s = write_stall_timeout_s
        self.draining = False
        self.admissions = Admissions()  # requests begun and not yet sent: what each Generate says
        self.requests: set[LiveRequest] = set()
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
        text_plan: TextPlan | None = None,
        span: RequestSpan | None = None,
    ) -> RequestOwner:
        """A new request's owner; call `admit()` on it next."""
        self._refuse_if_draining()
        admission = CURRENT.get()
        if admission is not None:
            admission.route(route.config.name)
        return RequestOwner(self, route, inputs, params, deadline, recorder, streaming, text_plan, span)

    def open_exchange(self, route: ModelRoute, deadline: float) -> ExchangeOwner:
        """A new one-shot exchange's owner (tokenize, detokenize, embed); call `run()` on it next."""
        self._refuse_if_draining()
        admission = CURRENT.get()
        if admission is not None:
            admission.end()  # no Generate follows: workers need not wait for it
        return ExchangeOwner(self, route, deadline)

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise ServiceUnavailable("the server is shutting down", code="shutting_down")

    def abort_all(self, error: APIError) -> None:
        for owner in list(self.requests):
            owner.abort(error)

    def abort_queued(self, model: str, error: APIError) -> int:
        """Abort the requests for `model` that no worker has accepted yet; returns how many."""
        owners = [o for o in self.requests if o.route.config.name == model and not o.admitted]
        for owner in owners:
            owner.abort(error)
        return len(owners)

    def abort_waiting(self, error: APIError) -> int:
        """Abort every request that no worker has accepted yet, whatever its model; returns how many."""
        owners = [o for o in self.requests if not o.admitted]
        for owner in owners:
            owner.abort(error)
        return len(owners)

    def abort_on_worker(self, worker_id: str, error: APIError) -> int:
        """Abort the requests with an unfinished job on this worker; returns how many."""
        owners = [o for o in self.requests if o.holds_job_on(worker_id)]
        for owner in owners:
            owner.abort(error)
        return len(owners)

    async def _tick_forever(self) -> None:
        """Keep-alive pings, and dropping clients that stopped reading; one task for all requests."""
        while True:
            await asyncio.sleep(min(self.keepalive_s / 2, self.write_stall_timeout_s / 4, 1.0))
            now = time.monotonic()
            for owner in list(self.requests):
                owner.tick(now, self.keepalive_s, self.write_stall_timeout_s)
