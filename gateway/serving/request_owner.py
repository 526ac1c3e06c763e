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
| a continuation fails        | its task (gateway.serving.     | the failure's error           |
|                             | continuation)                  |                               |

An abort also ends an admission still waiting (for a slot, or for the worker's answer), and every
continuation task the request has.

A choice's job can also give way to a continuation job mid-request (a thinking budget spent, or an
output constraint that waits for the end of the thinking): `suspend` cancels the job but keeps the
slot, and `restart_job` starts the next one on the same worker (gateway.serving.continuation).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypeVar

from gateway.errors import (
    APIError,
    ClientClosed,
    InvalidRequest,
    QueueFull,
    RequestTimeout,
    ServiceUnavailable,
    WorkerFailed,
    as_api_error,
)
from gateway.observability.logging_setup import log_context, set_log_context
from gateway.serving.admissions import CURRENT
from gateway.serving.choice import Choice, NotStarted
from gateway.serving.choice_text import Cut, TextPlan
from gateway.serving.continuation import continue_choice
from gateway.serving.output_queue import KEEPALIVE, EndOfOutputs, OutputQueue
from gateway.serving.outputs import ChoiceInput, ChoiceOutput, Delta, usage_totals
from gateway.serving.router import AdmissionStopped, ReplicasExhausted
from wire import messages as wire
from wire.codec import ENCODE_ERRORS
from wire.params import SamplingParams
from wire.results import FinishReason, JobOutput, RejectCode

if TYPE_CHECKING:
    from gateway.link.handle import WorkerHandle
    from gateway.observability.metrics import RequestRecorder
    from gateway.observability.tracing import RequestSpan
    from gateway.serving.router import ModelRoute
    from gateway.serving.service import GenerationService

logger = logging.getLogger(__name__)

# A client that stops reading must not grow our memory without bound: past this many undelivered
# outputs the request is aborted.
MAX_PENDING_OUTPUTS = 8192
T = TypeVar("T")
_ENDED = object()  # what _consume returns for the end of a request that finished normally


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
        text_plan: TextPlan | None = None,
        span: RequestSpan | None = None,
    ) -> None:
        self.service = service
        self.route = route
        self.deadline = deadline
        self.recorder = recorder
        self.streaming = streaming
        self._log_fields = log_context()  # the HTTP request's (request id, model) for lines logged elsewhere
        # The request's trace span (None while tracing is off); each Generate carries its context.
        self.span = span
        self.traceparent = span.traceparent if span is not None else None
        seed = params.seed
        # Distinct choices of one request must not be identical copies: choice i uses seed + i.
        self.choices = [
            Choice(self, i, choice_input, params if seed is None or i == 0 else params.with_seed(seed + i),
                   text_plan=text_plan)
            for i, choice_input in enumerate(inputs)
        ]  # fmt: skip
        self.queue = OutputQueue()
        self.outcome: int | None = None  # the request's final status, for metrics and logs
        self.error: APIError | None = None  # what it was aborted with
        self.admitted = False  # every choice was accepted by a worker
        self.ended = False  # the end (or an error) is on the queue
        self.closed = False
        self._aborted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.last_activity = self.last_consumed = time.monotonic()
        self._unfinished = len(self.choices)
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._continuations: set[asyncio.Task[None]] = set()
        self.token_cache: dict[tuple[str, Any], asyncio.Future[list[int]]] = {}  # continuations' prompts
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
            await self._place_all()
        except BaseException as exc:
            self.abort(as_api_error(exc))
            self.close()
            raise
        self.admitted = True
        # The stream opens now: its reader is judged from here, not from the wait in the queue.
        self.last_activity = self.last_consumed = time.monotonic()
        self.recorder.admitted()
        delay = max(self.deadline - time.monotonic(), 0.0)
        self._deadline_timer = asyncio.get_running_loop().call_later(delay, self._on_deadline)

    async def _place_all(self) -> None:
        """Take a slot for every choice at once (never some of them: see ModelRoute.acquire_slots),
        send each its Generate and wait for every answer. A replica that fails before it accepted
        its job ends the attempt; the whole request then tries again on the other replicas."""
        route = self.route
        sizes = [choice.input.size_estimate(choice.params.truncate_prompt_tokens) for choice in self.choices]
        for choice, size in zip(self.choices, sizes, strict=True):
            choice.work = size + choice.params.max_tokens
        avoid: frozenset[str] = frozenset()
        error: APIError | None = None  # the last attempt's failure, once one failed
        while True:
            try:
                replicas = await route.acquire_slots(
                    self.deadline, [c.work for c in self.choices], sum(sizes), avoid, stop=self._aborted
                )
            except AdmissionStopped:
                assert self.error is not None
                raise self.error from None
            except ReplicasExhausted:
                assert error is not None  # avoid is empty until an attempt failed
                raise error from None
            admission = CURRENT.get()
            if admission is not None:
                admission.end()  # its Generates go out now; a retry is not part of a burst
            behind = self.service.admissions.behind(route.config.name) + len(self.choices)
            replies = [
                self._start(choice, replica, following=behind - 1 - index)
                for index, (choice, replica) in enumerate(zip(self.choices, replicas, strict=True))
            ]
            failed: set[str] = set()
            for choice, reply in zip(self.choices, replies, strict=True):
                answer = await self._wait_accepted(choice) if reply is None else reply
                if isinstance(answer, wire.Accepted):
                    choice.output.prompt_tokens = choice.text.prompt_tokens = answer.prompt_tokens
                elif isinstance(answer, wire.Rejected) and answer.code is RejectCode.WORKER_FULL:
                    # Another gateway filled the worker since its last heartbeat: like a failed
                    # start, the request tries the other replicas, else it is told to come back.
                    choice.end_job(cancel=False)
                    failed.add(choice.worker_id or "")
                    error = self._worker_full(answer.message)
                elif isinstance(answer, wire.Rejected) and answer.code is RejectCode.SHUTTING_DOWN:
                    # It began draining or unloading (a reload, an idle unload) before this gateway
                    # heard: it started nothing, so the other replicas are tried.
                    choice.end_job(cancel=False)
                    failed.add(choice.worker_id or "")
                    error = ServiceUnavailable(answer.message, code=answer.code.value)
                elif isinstance(answer, wire.Rejected):
                    choice.end_job(cancel=False)  # the worker holds nothing for it; the others are cancelled
                    raise InvalidRequest(answer.message, code=answer.code.value, param=answer.param)
                else:
                    choice.end_job(cancel=False)
                    failed.add(choice.worker_id or "")
                    error = answer.error
            if not failed:
                set_log_context(worker=self.choices[0].worker_id)  # this request's later lines
                return
            # Nothing streams yet: end every job of this attempt and place them all again.
            for choice in self.choices:
                choice.end_job(cancel=True)
            avoid |= failed
            assert error is not None  # set with every failed replica
            if not route.has_other_replica(avoid):
                raise error
            logger.info("replica %s failed before starting a job; trying another", ", ".join(sorted(failed)))

    def _worker_full(self, message: str) -> APIError:
        """A worker's own cap refused the job: the model's full-queue status, with Retry-After."""
        limits = self.route.config.limits
        error_class = QueueFull if limits.full_queue_status == 429 else ServiceUnavailable
        return error_class(message, code=RejectCode.WORKER_FULL.value, headers={"Retry-After": "1"})

    def _start(self, choice: Choice, replica: WorkerHandle, following: int) -> NotStarted | None:
        """Send the choice's Generate to its replica, saying how many more jobs this gateway is about
        to send (gateway.serving.admissions); a NotStarted at once if it cannot go out."""
        link = self.service.link
        if choice.sent:  # a second attempt: a new job id, never confused with the cancelled one
            choice.rid = uuid.uuid4().hex
        choice.replica, choice.worker_id, choice.finished = replica, replica.id, False
        choice.accepted = asyncio.get_running_loop().create_future()
        link.add_job(choice)
        generate = wire.Generate(choice.rid, choice.input.prompt, choice.input.prompt_token_ids,
                                 choice.input.messages, choice.params, choice.input.chat,
                                 self.traceparent, following)  # fmt: skip
        try:
            frame = wire.encode(generate)
        except ENCODE_ERRORS as exc:
            # Schemas bound what they can name; this catches what slipped through, as a 400.
            logger.warning("a request could not be encoded for its worker: %s", type(exc).__name__)
            raise InvalidRequest("a value in the request is out of range or is not text") from None
        choice.sent = link.send_frame(replica.id, frame, is_generate=True)
        if choice.sent:
            return None
        return NotStarted(WorkerFailed(f"the worker for model '{self.route.config.name}' is unreachable"))

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
        delta, cut = choice.text.take(output)
        # A finish the gateway decided (a stop sequence it matched) leaves a job to cancel.
        self._deliver(choice, delta, cancel=output.finish_reason is None)
        if cut is not None and not self.ended:
            self.suspend(choice, cut)

    def _deliver(self, choice: Choice, delta: Delta, cancel: bool) -> None:
        if delta.finish_reason is not None:
            choice.end_job(cancel=cancel)
            self._unfinished -= 1
        if self.queue.qsize() >= MAX_PENDING_OUTPUTS:
            logger.warning("client is not reading; dropping its stream")
            self.abort(ServiceUnavailable("the client did not read the stream in time", code="slow_reader"))
            return
        self.queue.put_nowait((choice.index, delta))
        self.last_activity = time.monotonic()
        if self._unfinished == 0:
            self.ended = True
            self.queue.put_nowait(EndOfOutputs())

    # ---- continuations -----------------------------------------------------------------------

    def suspend(self, choice: Choice, cut: Cut) -> None:
        """Cancel the choice's job (its slot stays taken) and start the continuation that follows."""
        link = self.service.link
        if choice.sent and choice.worker_id is not None:
            link.send(choice.worker_id, wire.Cancel(choice.rid))
        link.remove_job(choice.rid)
        choice.sent = False  # the link no longer knows the job: nothing more of it arrives
        task = asyncio.get_running_loop().create_task(continue_choice(self, choice, cut), name="continuation")
        self._continuations.add(task)
        task.add_done_callback(self._continuations.discard)

    async def restart_job(
        self, choice: Choice, prompt_token_ids: list[int], params: SamplingParams
    ) -> wire.Accepted | wire.Rejected:
        """A suspended choice's next job, on the same worker and slot; the worker's answer to it."""
        link = self.service.link
        assert choice.worker_id is not None
        # Its outputs may arrive right behind its Accepted, before this task runs again.
        choice.text.continued_job()
        choice.rid = uuid.uuid4().hex
        choice.accepted = asyncio.get_running_loop().create_future()
        link.add_job(choice)
        frame = wire.encode(
            wire.Generate(choice.rid, None, prompt_token_ids, None, params, None, self.traceparent)
        )
        choice.sent = link.send_frame(choice.worker_id, frame, is_generate=True)
        if not choice.sent:
            raise WorkerFailed(f"the worker for model '{self.route.config.name}' is unreachable")
        answer = await self._wait_accepted(choice)
        if isinstance(answer, NotStarted):
            raise answer.error
        if isinstance(answer, wire.Rejected):
            link.remove_job(choice.rid)
            choice.sent = False  # the worker holds nothing for it
        return answer  # type: ignore[no-any-return]

    def finish_suspended(self, choice: Choice, reason: FinishReason) -> None:
        """End a choice for which no job runs (its continuation had no room left)."""
        self._deliver(choice, Delta(finish_reason=reason, usage=choice.text.usage_now()), cancel=False)

    async def events(self) -> AsyncIterator[tuple[int, Delta] | object]:
        """(choice index, output) in arrival order, and KEEPALIVE on a quiet stream; ends when every
        choice finished, or raises the APIError the request was aborted with."""
        while True:
            event = self._consume(await self.queue.get())
            if event is _ENDED:
                return
            yield event

    async def event_batches(self) -> AsyncIterator[list[tuple[int, Delta] | object]]:
        """The same events, each batch being everything already queued when the consumer got to it
        (at least one event): a streaming response writes a batch as one chunk, so a stream that
        fell behind catches up in one socket write instead of one per token. Never waits for more."""
        while True:
            if self.queue.empty():
                await self.queue.arrival()
            batch, end = self.take_queued()
            if batch:
                yield batch
            if end is not None:
                if end.error is not None:
                    raise end.error
                return

    def take_queued(self) -> tuple[list[tuple[int, Delta] | object], EndOfOutputs | None]:
        """Everything queued now, consumed in order: the events, and the request's end if it came
        with them (its `error` set when it was aborted). What arrived before an abort comes out
        with it, so it still goes out before the error."""
        self.last_consumed = time.monotonic()
        batch: list[tuple[int, Delta] | object] = []
        choices, recorder = self.choices, self.recorder
        for item in self.queue.take_all():
            if item is KEEPALIVE:
                batch.append(item)
                continue
            if isinstance(item, EndOfOutputs):
                if item.error is None and self.outcome is None:
                    self.outcome = 200
                return batch, item
            index, delta = item
            choices[index].output.add(delta)
            recorder.output(delta)
            batch.append(item)
        return batch, None

    def _consume(self, item: Any) -> tuple[int, Delta] | object:
        """One queue item taken by the consumer: the event to hand out, or _ENDED; raises the abort."""
        self.last_consumed = time.monotonic()
        if item is KEEPALIVE:
            return item
        if isinstance(item, EndOfOutputs):
            if item.error is not None:
                raise item.error
            if self.outcome is None:
                self.outcome = 200
            return _ENDED
        index, delta = item
        self.choices[index].output.add(delta)
        self.recorder.output(delta)
        return index, delta

    def keep_alive(self) -> None:
        if self.streaming and not self.ended:
            self.queue.put_nowait(KEEPALIVE)
            self.last_activity = time.monotonic()

    # ---- the service's view ----------------------------------------------------------------------

    def holds_job_on(self, worker_id: str) -> bool:
        return any(c.worker_id == worker_id and not c.finished for c in self.choices)

    def tick(self, now: float, keepalive_s: float, stall_s: float) -> None:
        """The service's ticker: drop a client that stopped reading, or ping a quiet stream."""
        if not self.admitted:
            # Still waiting in the gateway: no stream is open, so nothing is read and a ping would
            # only pile up unread, and then be taken for a client that stopped reading.
            return
        # Finished requests count too: their last outputs may be stuck behind a client that
        # stopped reading, holding a connection.
        if self.queue.qsize() and now - self.last_consumed >= stall_s:
            logger.warning("client stopped reading; dropping it")
            self.abort(ServiceUnavailable("the client stopped reading", code="slow_reader"))
            self.drop_connection()
        elif not self.ended and now - self.last_activity >= keepalive_s:
            self.keep_alive()

    # ---- ending --------------------------------------------------------------------------------

    def abort(self, error: APIError) -> None:
        """The one way a request ends early: cancel every unfinished engine job, free its slots, and
        end the stream with `error` (an SSE error event, or the HTTP error if no stream started)."""
        if self.closed:
            return
        for choice in self.choices:
            choice.end_job(cancel=True)
        for task in self._continuations:
            task.cancel()
        for pending in self.token_cache.values():
            pending.cancel()
        self._unfinished = 0
        if self.ended:
            return  # every job had finished; only the client's reading was left
        self.ended = True
        self.error = error
        if not self._aborted.done():
            self._aborted.set_result(None)
        if self.outcome is None:
            self.outcome = error.status
        self.queue.put_nowait(EndOfOutputs(error))
        if not isinstance(error, ClientClosed):
            # The request's own fields: an end decided elsewhere (a worker's crash, in the supervisor's
            # task) would otherwise be logged without the request id that the access line has.
            logger.info("request ended early: %s (%s)", error.code, error.message, extra=self._log_fields)

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
        self.recorder.finish(
            self.outcome, totals.prompt_tokens, totals.completion_tokens, totals.cached_tokens
        )
        if self.span is not None:
            reasons = [c.finish_reason.value for c in self.outputs if c.finish_reason is not None]
            self.span.end(self.outcome, reasons, totals.prompt_tokens, totals.completion_tokens,
                          self.recorder.ttft_s, self.error)  # fmt: skip
