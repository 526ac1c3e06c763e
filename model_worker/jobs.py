"""The worker's desk for generation jobs: admitting them, holding those whose constraint compiles,
and the bookkeeping of live jobs between the socket and the engine.

Runs in the worker process, on the serve loop's (engine) thread. Takes each Generate as the prompt
thread prepared it (model_worker.prompt_desk: its prompt's ids, or why it cannot run). Owns the
refusal of a request id already running, the scoring pass for prompt logprobs, the jobs parked
while their output constraint compiles in its own process (the loop keeps stepping every other job
meanwhile), the set of live job ids (for cancels and for aborting at shutdown), and, while tracing is
on, the jobs' spans (model_worker.tracing), told of each job's start, answer, outputs and end.

It also owns the worker's own capacity (`spec.max_jobs`, `spec.max_queue`; 0: none, a spawned
worker whose gateway admits). Several gateways may send to one worker, each knowing the others'
load only from heartbeats, so the worker is the one that holds the line: at most max_jobs jobs run,
at most max_queue more wait here (answered Accepted once they start), and past that a Generate is
refused with `worker_full`, which a gateway takes to another replica or answers 429/503. Embedding
requests (model_worker.embedding_batch) are counted in the load it reports, told to it as they come
and go, but never refused here: a turn batches every one of them, and the gateways bound them with
their slots, reading that load.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from model_worker import tracing
from model_worker.constraints import ConstraintCompiler
from model_worker.engines.base import Engine, PreparesConstraints, RequestRejected, ScoresPrompts
from model_worker.prompt_desk import PreparedJob
from wire import messages as wire
from wire.params import WorkerSpec
from wire.results import AbortReason, FinishReason, JobOutput, RejectCode, TokenLogprob, Usage
from wire.stats import WorkerLoad


@dataclass(eq=False)
class _Parked:
    message: wire.Generate
    prompt_ids: list[int]
    constraint: tuple[Any, ...]


class JobDesk:
    def __init__(
        self,
        engine: Engine,
        spec: WorkerSpec,
        send: Callable[[wire.Message], None],
    ) -> None:
        self.engine, self.spec = engine, spec
        self.send = send
        self.live: set[str] = set()
        # Admitted beyond max_jobs: started in arrival order as running jobs end.
        self._queued: collections.OrderedDict[str, tuple[wire.Generate, list[int]]] = (
            collections.OrderedDict()
        )
        self.spans = tracing.job_spans(spec.name) if tracing.ENABLED else None
        self._parked: list[_Parked] = []
        self._starts_pending = False
        # Prompt logprobs computed at submit, sent with the job's first output.
        self._prompt_logprobs: dict[str, list[TokenLogprob]] = {}
        self._idle_since = time.monotonic()  # when it last held a job or embedded (or started)
        # Embedding requests in the running turn, and waiting for the next (model_worker.embedding_batch).
        self._embeds_active = self._embeds_queued = 0
        # Engines that enforce constraints with lm-format-enforcer (they build its tokenizer data in
        # prepare_constraints) get their parsers compiled ahead; exllamav3 compiles its own
        # (llguidance, lazily, in Rust) when the job is submitted.
        self._prepare: Callable[[], None] | None = (
            engine.prepare_constraints if isinstance(engine, PreparesConstraints) else None
        )
        self.compiler = (
            ConstraintCompiler(spec.max_constraint_compile_s, spec.max_constraint_states)
            if self._prepare is not None
            else None
        )

    @property
    def waiting(self) -> bool:
        """Jobs are parked: the loop must keep turning (briefly) even with nothing to step."""
        return bool(self._parked)

    @property
    def held(self) -> int:
        """Requests held: jobs running, compiling their constraint or queued, and embedding requests
        (a change is reported at once to gateways that share the worker: model_worker.serve_loop)."""
        jobs = len(self.live) + len(self._parked) + len(self._queued)
        return jobs + self._embeds_active + self._embeds_queued

    def load(self, embeds_arriving: int = 0) -> WorkerLoad:
        """What the heartbeat reports: the requests held (`yours` is the link's to fill in, when
        several gateways share the worker), `embeds_arriving` (Embeds the link has read and the engine
        thread not taken yet) among the queued, and how long it has held none (measured at
        heartbeats: within an interval, or when embedding requests last came or went)."""
        active = len(self.live) + len(self._parked) + self._embeds_active
        queued = len(self._queued) + self._embeds_queued + embeds_arriving
        now = time.monotonic()
        busy = active or queued
        if busy:
            self._idle_since = now
        idle_s = round(now - self._idle_since, 3) if not busy else 0.0
        return WorkerLoad(active, queued, self.spec.max_jobs, self.spec.max_queue, active + queued, idle_s)

    def count_embeds(self, active: int, queued: int) -> None:
        """The embedding requests held changed (one came, was cancelled, or a turn started or ended):
        counted here when it happens, not looked up at every step; the idle time counts from then."""
        self._embeds_active, self._embeds_queued = active, queued
        self._idle_since = time.monotonic()

    def _full(self) -> bool:
        cap = self.spec.max_jobs
        held = len(self.live) + len(self._parked) + len(self._queued)
        return cap > 0 and held >= cap + self.spec.max_queue

    def _running_full(self) -> bool:
        return self.spec.max_jobs > 0 and len(self.live) + len(self._parked) >= self.spec.max_jobs

    def generate(self, prepared: PreparedJob) -> None:
        msg = prepared.message
        self._idle_since = time.monotonic()
        if (
            msg.rid in self.live
            or msg.rid in self._queued
            or any(p.message.rid == msg.rid for p in self._parked)
        ):
            # Sent as is: the span under this id (if traced) belongs to the job already running.
            message = f"request id {msg.rid!r} is already running"
            self.send(wire.Rejected(msg.rid, RejectCode.DUPLICATE_REQUEST_ID, message, "rid"))
            return
        if self._full():
            held = f"{len(self.live) + len(self._parked)} running, {len(self._queued)} queued"
            caps = f"max_jobs {self.spec.max_jobs}, max_queue {self.spec.max_queue}"
            message = f"the worker is at capacity ({held}; {caps})"
            self.send(wire.Rejected(msg.rid, RejectCode.WORKER_FULL, message, None))
            return
        if self.spans is not None:
            self.spans.start(msg)
        try:
            if prepared.rejection is not None:
                raise prepared.rejection
            prompt_ids = prepared.prompt_ids
            assert prompt_ids is not None  # a PreparedJob holds ids or a rejection
            if self.compiler is not None and self.compiler.needed(msg.params):
                self._parked.append(_Parked(msg, prompt_ids, self.compiler.start(msg.params, self._prepare)))
                return
        except RequestRejected as exc:
            self._reject(msg.rid, exc)
            return
        if self._running_full():
            self._queued[msg.rid] = (msg, prompt_ids)  # answered when it starts
            return
        self._start(msg, prompt_ids)

    def _start_queued(self) -> None:
        """Running jobs ended: the longest waiting start, as many as there is room for."""
        while self._queued and not self._running_full():
            _, (msg, prompt_ids) = self._queued.popitem(last=False)
            self._start(msg, prompt_ids)

    def settle(self) -> None:
        """Start the parked jobs whose constraint is ready; refuse those that cannot have one."""
        for parked in list(self._parked):
            try:
                assert self.compiler is not None  # jobs are parked only with a compiler
                ready = self.compiler.result(parked.constraint)
            except RequestRejected as exc:
                self._parked.remove(parked)
                self._reject(parked.message.rid, exc)
                continue
            if ready:
                self._parked.remove(parked)
                self._start(parked.message, parked.prompt_ids)

    def _start(self, msg: wire.Generate, prompt_ids: list[int]) -> None:
        params = msg.params
        scored = None
        try:
            if params.prompt_logprobs is not None:
                # Its own pass over the prompt, before the job: scoring requests (max_tokens 0 or 1)
                # pay one extra prefill, and no engine's generation path changes.
                assert isinstance(self.engine, ScoresPrompts)  # checked against its settings at load
                scored = self.engine.prompt_logprobs(prompt_ids, params.prompt_logprobs)
            if params.max_tokens > 0:
                self.engine.submit(msg.rid, prompt_ids, params)
        except RequestRejected as exc:
            self._reject(msg.rid, exc)
            return
        self.send(wire.Accepted(msg.rid, len(prompt_ids)))
        if self.spans is not None:
            self.spans.accepted(msg.rid, len(prompt_ids))
        if params.max_tokens == 0:  # only the prompt was asked for: the job is over already
            usage = Usage(prompt_tokens=len(prompt_ids), completion_tokens=0)
            last = JobOutput(msg.rid, "", [], FinishReason.LENGTH, usage, None, scored)
            if self.spans is not None:
                self.spans.outputs([last])
            self.send(wire.Step([last]))
            return
        self.live.add(msg.rid)
        if scored is not None:
            self._prompt_logprobs[msg.rid] = scored

    def outputs(self, outputs: list[JobOutput]) -> list[JobOutput]:
        """A step's outputs as they leave: finished jobs forgotten, first outputs with their prompt
        logprobs."""
        if self.spans is not None:
            self.spans.outputs(outputs)
        ended = False
        for index, output in enumerate(outputs):
            if output.finish_reason is not None:
                self.live.discard(output.rid)
                ended = True
            if self._prompt_logprobs and output.rid in self._prompt_logprobs:
                scored = self._prompt_logprobs.pop(output.rid)
                outputs[index] = msgspec.structs.replace(output, prompt_logprobs=scored)
        if ended and self._queued:
            # After this step's frame is handed over (the caller sends it first): the started jobs'
            # Accepted then follows the outputs that made room for them.
            self._starts_pending = True
        return outputs

    def start_waiting(self) -> None:
        """Start queued jobs that the last step made room for (the loop calls it after sending)."""
        if self._starts_pending:
            self._starts_pending = False
            self._start_queued()

    def _reject(self, rid: str, exc: RequestRejected) -> None:
        self.send(wire.Rejected(rid, exc.code, exc.message, exc.param))
        if self.spans is not None:
            self.spans.rejected(rid, exc.code.value)

    def cancel(self, rid: str) -> bool:
        if self.spans is not None:
            self.spans.cancelled(rid)
        self.live.discard(rid)
        self._prompt_logprobs.pop(rid, None)
        self._parked = [p for p in self._parked if p.message.rid != rid]
        if self._queued.pop(rid, None) is not None:
            return True  # never reached the engine
        cancelled = self.engine.cancel(rid)
        self._start_queued()
        return cancelled

    def abort_all(self, reason: str) -> None:
        rids = sorted(self.live)
        for rid in rids:
            self.engine.cancel(rid)
        self.live.clear()
        for parked in self._parked:
            self._reject(parked.message.rid, RequestRejected(RejectCode.SHUTTING_DOWN, reason, None))
        self._parked.clear()
        for rid in list(self._queued):
            self._reject(rid, RequestRejected(RejectCode.SHUTTING_DOWN, reason, None))
        self._queued.clear()
        if rids:
            self.send(wire.JobsAborted(rids, AbortReason.SHUTDOWN, reason))
            if self.spans is not None:
                for rid in rids:
                    self.spans.aborted(rid, AbortReason.SHUTDOWN.value)

    def close(self) -> None:
        if self.spans is not None:
            self.spans.close()
        if self.compiler is not None:
            self.compiler.close()
