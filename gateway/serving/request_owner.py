"""One generation request's whole life in the gateway, owned by one object.

Runs in the gateway process, on its asyncio loop. `RequestOwner` holds everything a request has:
its choices (one engine job each, with the replica slot it takes), its single output queue, its
deadline timer and its metrics recorder. It is created at admission and ends with `close()`.
Every early end goes through `abort(error)`, the only code that cancels engine jobs and ends a
stream early (vLLM's AsyncLLM keeps one per-request queue and one abort path the same way):

| case                        | who calls abort                | error                         |
|-----------------------------|--------------------------------|-------------------------------|
| client disconnects          | close() (consumer gone)        | ClientClosed (499)            |
| deadline passes             | the owner's timer              | RequestTimeout (408)          |
| worker dies or is lost      | the link, via the choice       | WorkerFailed (503)            |
| worker aborts its jobs      | the link, via the choice       | ServiceUnavailable (503)      |
| client stops reading        | the service's ticker           | ServiceUnavailable slow_reader|
| gateway shutdown            | the service (abort_all)        | ServiceUnavailable (503)      |
| reload or unload of a model | the service (queued, or after  | ServiceUnavailable (503)      |
|                             | the drain grace)               |                               |

An abort also ends an admission still waiting (for a slot, or for the worker's answer).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from gateway.errors import (
    APIError,
    ClientClosed,
    InvalidRequest,
    RequestTimeout,
    ServiceUnavailable,
    WorkerFailed,
    as_api_error,
)
from gateway.observability.logging_setup import set_log_context
from gateway.serving.outputs import ChoiceInput, ChoiceOutput, usage_totals
from gateway.serving.router import AdmissionStopped
from wire import messages as wire
from wire.params import SamplingParams
from wire.results import AbortReason, JobOutput, RejectCode

if TYPE_CHECKING:
    from gateway.observability.metrics import RequestRecorder
    from gateway.serving.router import ModelRoute
    from gateway.serving.service import GenerationService
    from gateway.workers.handle import WorkerHandle

logger = logging.getLogger(__name__)

# A client that stops reading must not grow our memory without bound: past this many undelivered
# outputs the request is aborted.
MAX_PENDING_OUTPUTS = 8192
T = TypeVar("T")
KEEPALIVE = object()  # queue item: nothing new, the stream should send an SSE comment
_ENDED = object()  # what _consume returns for the end of a request that finished normally


@dataclass(frozen=True, slots=True)
class _End:
    error: APIError | None = None


@dataclass(frozen=True, slots=True)
class _NotStarted:
    """The replica failed before it accepted the job: nothing ran, so another replica may take it."""

    error: APIError


@dataclass(eq=False)
class Choice:
    """One choice of a request: one engine job on one replica. The link delivers its frames here."""

    owner: RequestOwner
    index: int
    input: ChoiceInput
    params: SamplingParams
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    worker_id: str | None = None
    replica: WorkerHandle | None = None
    work: int = 0  # prompt + completion budget: the replica's routing load while this job runs
    accepted: asyncio.Future[Any] | None = None
    sent: bool = False  # a Generate went out: a Cancel must follow unless the job finishes
    finished: bool = False  # the engine job is over (finished, refused, cancelled or gone)
    output: ChoiceOutput = field(init=False)

    def __post_init__(self) -> None:
        self.output = ChoiceOutput(self.index)

    # ---- the link's calls ------------------------------------------------------------------

    def on_reply(self, reply: wire.Accepted | wire.Rejected) -> None:
        if self.accepted is not None and not self.accepted.done():
            self.accepted.set_result(reply)

    def on_output(self, output: JobOutput) -> None:
        self.owner.on_output(self, output)

    def on_aborted(self, message: wire.JobsAborted) -> None:
        code = "shutting_down" if message.reason is AbortReason.SHUTDOWN else "aborted"
        self.owner.abort(ServiceUnavailable(message.message, code=code))

    def on_worker_failed(self, error: APIError) -> None:
        if self.accepted is not None and not self.accepted.done():
            self.accepted.set_result(_NotStarted(error))
        else:
            self.owner.abort(error)

    # ---- slot --------------------------------------------------------------------------------

    def end_job(self, cancel: bool) -> None:
        """The engine job is over for us: cancel it if asked and still running, free its slot."""
        if self.finished:
            return
        self.finished = True
        owner = self.owner
        if cancel and self.sent and self.worker_id is not None:
            owner.service.link.send(self.worker_id, wire.Cancel(self.rid))
        owner.service.link.remove_job(self.rid)
        if self.replica is not None:
            owner.route.release(self.replica, self.work)


class RequestOwner:
    def __init__(
        self,
        service: GenerationService,
        route: ModelRoute,
        inputs: list[ChoiceInput],
        params: SamplingParams,
        deadline: float,
        recorder: RequestRecorder,
        streaming: bool,
    ) -> None:
        self.service = service
        self.route = route
        self.deadline = deadline
        self.recorder = recorder
        self.streaming = streaming
        seed = params.seed
        # Distinct choices of one request must not be identical copies: choice i uses seed + i.
        self.choices = [
            Choice(self, i, choice_input, params if seed is None or i == 0 else params.with_seed(seed + i))
            for i, choice_input in enumerate(inputs)
        ]
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.outcome: int | None = None  # the request's final status, for metrics and logs
        self.error: APIError | None = None  # what it was aborted with
        self.admitted = False  # every choice was accepted by a worker
        self.ended = False  # the end (or an error) is on the queue
        self.closed = False
        self._aborted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.last_activity = self.last_consumed = time.monotonic()
        self._unfinished = len(self.choices)
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._task = asyncio.current_task()
        service.requests.add(self)
        if self._task is not None:
            # A streamed response's body may never start (the client left between the handler's
            # return and the first chunk), so its own cleanup never runs; the task always ends.
            self._task.add_done_callback(lambda _: self.close())

    @property
    def outputs(self) -> list[ChoiceOutput]:
        return [choice.output for choice in self.choices]

    # ---- admission ---------------------------------------------------------------------------

    async def admit(self) -> None:
        """Place every choice on a replica and wait until its worker accepted it; on any failure
        (refusal, deadline, no replica, client gone) the request is closed and the error raised."""
        try:
            for choice in self.choices:
                await self._place(choice)
        except BaseException as exc:
            self.abort(as_api_error(exc))
            self.close()
            raise
        self.admitted = True
        self.recorder.admitted()
        delay = max(self.deadline - time.monotonic(), 0.0)
        self._deadline_timer = asyncio.get_running_loop().call_later(delay, self._on_deadline)

    async def _place(self, choice: Choice) -> None:
        route, link = self.route, self.service.link
        size = choice.input.size_estimate()
        choice.work = size + choice.params.max_tokens
        avoid: frozenset[str] = frozenset()
        while True:
            try:
                replica = await route.acquire(self.deadline, size, choice.work, avoid, stop=self._aborted)
            except AdmissionStopped:
                assert self.error is not None
                raise self.error from None
            choice.replica, choice.worker_id, choice.finished = replica, replica.id, False
            choice.accepted = asyncio.get_running_loop().create_future()
            link.add_job(choice)
            generate = wire.Generate(choice.rid, choice.input.prompt, choice.input.prompt_token_ids,
                                     choice.input.messages, choice.params, choice.input.chat)  # fmt: skip
            choice.sent = link.send(replica.id, generate)
            if choice.sent:
                reply = await self._wait_accepted(choice)
            else:
                reply = _NotStarted(
                    WorkerFailed(f"the worker for model '{route.config.name}' is unreachable")
                )
            if isinstance(reply, wire.Accepted):
                choice.output.prompt_tokens = reply.prompt_tokens
                set_log_context(worker=replica.id)  # this request's later lines and its access line
                return
            choice.end_job(cancel=False)
            if isinstance(reply, wire.Rejected):
                error_class = ServiceUnavailable if reply.code is RejectCode.SHUTTING_DOWN else InvalidRequest
                raise error_class(reply.message, code=reply.code.value, param=reply.param)
            # The replica failed before it took the job: another one may, if there is one.
            avoid |= {replica.id}
            if not route.has_other_replica(avoid):
                raise reply.error
            logger.info("replica %s failed before starting a job; trying another", replica.id)

    async def _wait_accepted(self, choice: Choice) -> Any:
        assert choice.accepted is not None
        timeout = max(self.deadline - time.monotonic(), 0.001)
        waiting: set[asyncio.Future[Any]] = {choice.accepted, self._aborted}
        await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if self.error is not None:
            raise self.error
        if not choice.accepted.done():
            raise RequestTimeout("the request timed out before the model accepted it")
        return choice.accepted.result()

    # ---- outputs -------------------------------------------------------------------------------

    def on_output(self, choice: Choice, output: JobOutput) -> None:
        if self.ended or choice.finished:
            return  # the request already ended; its jobs were cancelled
        if output.finish_reason is not None:
            choice.end_job(cancel=False)
            self._unfinished -= 1
        if self.queue.qsize() >= MAX_PENDING_OUTPUTS:
            logger.warning("client is not reading; dropping its stream")
            self.abort(ServiceUnavailable("the client did not read the stream in time", code="slow_reader"))
            return
        self.queue.put_nowait((choice.index, output))
        self.last_activity = time.monotonic()
        if self._unfinished == 0:
            self.ended = True
            self.queue.put_nowait(_End())

    async def events(self) -> AsyncIterator[tuple[int, JobOutput] | object]:
        """(choice index, output) in arrival order, and KEEPALIVE on a quiet stream; ends when every
        choice finished, or raises the APIError the request was aborted with."""
        while True:
            event = self._consume(await self.queue.get())
            if event is _ENDED:
                return
            yield event

    async def event_batches(self) -> AsyncIterator[list[tuple[int, JobOutput] | object]]:
        """The same events, each batch being everything already queued when the consumer got to it
        (at least one event): a streaming response writes a batch as one chunk, so a stream that
        fell behind catches up in one socket write instead of one per token. Never waits for more."""
        while True:
            batch: list[tuple[int, JobOutput] | object] = []
            item = await self.queue.get()
            try:
                while True:
                    event = self._consume(item)
                    if event is _ENDED:
                        if batch:
                            yield batch
                        return
                    batch.append(event)
                    if self.queue.empty():
                        break
                    item = self.queue.get_nowait()
            except APIError:
                if batch:  # what arrived before the abort still goes out, then the error
                    yield batch
                raise
            yield batch

    def _consume(self, item: Any) -> tuple[int, JobOutput] | object:
        """One queue item taken by the consumer: the event to hand out, or _ENDED; raises the abort."""
        self.last_consumed = time.monotonic()
        if item is KEEPALIVE:
            return item
        if isinstance(item, _End):
            if item.error is not None:
                raise item.error
            if self.outcome is None:
                self.outcome = 200
            return _ENDED
        index, output = item
        self.choices[index].output.add(output)
        self.recorder.output(output)
        return index, output

    def keep_alive(self) -> None:
        if self.streaming and not self.ended:
            self.queue.put_nowait(KEEPALIVE)
            self.last_activity = time.monotonic()

    # ---- ending --------------------------------------------------------------------------------

    def abort(self, error: APIError) -> None:
        """The one way a request ends early: cancel every unfinished engine job, free its slots, and
        end the stream with `error` (an SSE error event, or the HTTP error if no stream started)."""
        if self.closed:
            return
        for choice in self.choices:
            choice.end_job(cancel=True)
        self._unfinished = 0
        if self.ended:
            return  # every job had finished; only the client's reading was left
        self.ended = True
        self.error = error
        if not self._aborted.done():
            self._aborted.set_result(None)
        if self.outcome is None:
            self.outcome = error.status
        self.queue.put_nowait(_End(error))
        if not isinstance(error, ClientClosed):
            logger.info("request ended early: %s (%s)", error.code, error.message)

    def drop_connection(self) -> None:
        """Cancel the HTTP task (a client that stopped reading): the server closes its connection."""
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def _on_deadline(self) -> None:
        if not self.ended:
            logger.info("deadline passed; cancelling the request's jobs")
            self.abort(RequestTimeout("the request timed out"))

    def close(self) -> None:
        """Final bookkeeping, exactly once. A request closed before it ended was abandoned by its
        client: its jobs are cancelled (abort) and it counts as 499."""
        if self.closed:
            return
        if not self.ended or self.outcome is None:
            self.abort(ClientClosed())
            self.outcome = self.outcome or ClientClosed.status
        self.closed = True
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        self.service.requests.discard(self)
        totals = usage_totals(self.outputs)
        self.recorder.finish(self.outcome, totals.prompt_tokens, totals.completion_tokens)
