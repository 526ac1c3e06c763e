"""Embedding requests answered in batches: every Embed that reached the engine thread by one turn of
the serve loop goes through the model together, one engine batch (`max_batch_size` inputs, sorted
by length so padding stays small) at a time.

Runs in the worker process, on the serve loop's (engine) thread, where it only runs the model: each
Embed arrives prepared by the prompt thread (model_worker.prompt_desk: its inputs tokenized and
checked, or the rejection to answer it with). Owns the queue of prepared Embeds, the turn that runs
them, and which of the turn's requests are still wanted. A turn can hold minutes of work (every
queued request's inputs), so between engine batches it
- calls the loop's heartbeat once one is due: without it the gateway would judge the worker hung
  after `heartbeat_timeout_s`, kill it and fail every request it held;
- takes what the link has passed on since (`arrived`): a Cancel (the request's deadline passed, or
  its client left) drops that request's inputs not yet run, and it is never answered, as a
  cancelled generation is not (the gateway has forgotten it).
The requests it holds are the worker's load (`counted`, model_worker.jobs), told as they change: those
of the running turn still wanted are active, those waiting for the next turn queued, so heartbeats
report them (and no idle time) and gateways route around a worker busy embedding.
While tracing is on, each traced Embed's span (model_worker.tracing) runs from its arrival to its
answer (or its cancel).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from model_worker.engines.base import Embeds, Engine, RequestRejected
from model_worker.prompt_desk import PreparedEmbed
from model_worker.tracing import JobSpans
from wire import messages as wire
from wire.params import WorkerSpec
from wire.results import RejectCode
from wire.stats import EngineInfo

EmbedCall = Callable[[list[list[int]]], list[list[float]]]


class EmbeddingBatch:
    def __init__(
        self,
        engine: Engine,
        info: EngineInfo,
        spec: WorkerSpec,
        send: Callable[[wire.Message], None],
        spans: JobSpans | None = None,
        heartbeat: Callable[[], None] | None = None,
        arrived: Callable[[], None] | None = None,
        counted: Callable[[int, int], None] | None = None,
    ) -> None:
        self.engine, self.info, self.spec, self.send = engine, info, spec, send
        self.spans = spans  # the worker's job spans while tracing is on (shared with JobDesk)
        self.heartbeat = heartbeat  # the serve loop's: sends one Heartbeat frame now
        self.arrived = arrived  # the serve loop's: handles what the link has passed on since
        self.counted = counted  # JobDesk's: the requests held (active, queued), for the load reported
        self.queue: list[PreparedEmbed] = []
        self._wanted: set[str] = set()  # the running turn's requests, until answered or cancelled
        self._last_beat = time.monotonic()

    def add(self, prepared: PreparedEmbed) -> None:
        """An Embed as the prompt thread prepared it: answered in the next turn, with the others."""
        if self.spans is not None:
            self.spans.start(prepared.message)
        self.queue.append(prepared)
        self._count()

    def cancel(self, rid: str) -> bool:
        """The gateway gave up on the request: its inputs not run yet never are, and no answer goes
        out. False if it is not here (answered already, or an id of some other kind)."""
        queued = [p for p in self.queue if p.message.rid == rid]
        if queued:
            self.queue = [p for p in self.queue if p.message.rid != rid]
        elif rid in self._wanted:
            self._wanted.discard(rid)
        else:
            return False
        self._count()
        if self.spans is not None:
            self.spans.cancelled(rid)
        return True

    def run(self) -> None:
        """Every Embed queued so far, through the model together; one reply each, unless cancelled."""
        turn, self.queue = self.queue, []  # what arrives meanwhile waits for the next turn
        self._last_beat = time.monotonic()  # the serve loop's own beat is at most an interval old
        try:
            self._run(turn)
        finally:
            self._wanted.clear()
            self._count()

    def _count(self) -> None:
        if self.counted is not None:
            self.counted(len(self._wanted), len(self.queue))

    def _run(self, turn: list[PreparedEmbed]) -> None:
        embed = self.engine.embed if isinstance(self.engine, Embeds) else None
        accepted: list[tuple[str, list[list[int]]]] = []
        for prepared in turn:
            rid, rejection = prepared.message.rid, prepared.rejection
            if rejection is None and embed is None:  # the prompt desk refuses these first
                message = f"model '{self.spec.name}' is not an embedding model"
                rejection = RequestRejected(RejectCode.INVALID_REQUEST, message, "model")
            if rejection is not None:
                self.send(wire.Rejected(rid, rejection.code, rejection.message, rejection.param))
                if self.spans is not None:
                    self.spans.rejected(rid, rejection.code.value)
                continue
            assert prepared.inputs is not None  # a PreparedEmbed holds inputs or a rejection
            accepted.append((rid, prepared.inputs))
        if not accepted:
            return
        assert embed is not None
        self._wanted = {rid for rid, _ in accepted}
        self._count()
        vectors = self._embed_in_batches(embed, accepted)
        for (rid, inputs), request_vectors in zip(accepted, vectors, strict=True):
            if rid not in self._wanted:  # cancelled meanwhile
                continue
            tokens = sum(len(ids) for ids in inputs)
            self.send(wire.Embeddings(rid, request_vectors, tokens))
            if self.spans is not None:
                self.spans.embedded(rid, tokens)

    def _embed_in_batches(
        self, embed: EmbedCall, accepted: list[tuple[str, list[list[int]]]]
    ) -> list[list[list[float]]]:
        """Each request's vectors, in its inputs' order; the model sees one engine batch at a time,
        and never the inputs of a request cancelled before their batch."""
        entries = [
            (n, index, ids) for n, (_, inputs) in enumerate(accepted) for index, ids in enumerate(inputs)
        ]
        order = collections.deque(sorted(entries, key=lambda entry: len(entry[2])))
        vectors: list[list[list[float]]] = [[[] for _ in inputs] for _, inputs in accepted]
        size = max(self.info.max_batch_size, 1)
        while order:
            batch: list[tuple[int, int, list[int]]] = []
            while order and len(batch) < size:
                entry = order.popleft()
                if accepted[entry[0]][0] in self._wanted:
                    batch.append(entry)
            if not batch:
                break
            for (n, index, _), vector in zip(batch, embed([ids for _, _, ids in batch]), strict=True):
                vectors[n][index] = vector
            self._beat_if_due()
            if self.arrived is not None:
                self.arrived()  # a Cancel for one of this turn's requests takes effect from here on
        return vectors

    def _beat_if_due(self) -> None:
        now = time.monotonic()
        if self.heartbeat is not None and now - self._last_beat >= self.spec.heartbeat_interval_s:
            self._last_beat = now
            self.heartbeat()
