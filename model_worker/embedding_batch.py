"""Embedding requests answered in batches: every Embed drained from the socket in one turn of the
serve loop goes through the model together, one engine batch (`max_batch_size` inputs, sorted by
length so padding stays small) at a time.

Runs in the worker process, on the serve loop's thread. Owns the queue of Embed messages and the
checks their inputs pass (empty, too long, token ids out of range), answered as Rejected. One turn
can hold minutes of work (every queued request's inputs) in which the serve loop sends nothing, so
between engine batches it calls the loop's heartbeat once one is due: without it the gateway would
judge the worker hung after `heartbeat_timeout_s`, kill it and fail every request it held.
While tracing is on, each traced Embed's span (model_worker.tracing) runs from its batch to its answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from model_worker.engines.base import Embeds, Engine, RequestRejected
from model_worker.tracing import JobSpans
from wire import messages as wire
from wire.params import WorkerSpec
from wire.results import RejectCode
from wire.stats import EngineInfo


class EmbeddingBatch:
    def __init__(
        self,
        engine: Engine,
        info: EngineInfo,
        spec: WorkerSpec,
        send: Callable[[wire.Message], None],
        spans: JobSpans | None = None,
        heartbeat: Callable[[], None] | None = None,
    ) -> None:
        self.engine, self.info, self.spec, self.send = engine, info, spec, send
        self.spans = spans  # the worker's job spans while tracing is on (shared with JobDesk)
        self.heartbeat = heartbeat  # the serve loop's: sends one Heartbeat frame now
        self.queue: list[wire.Embed] = []
        self._last_beat = time.monotonic()

    def run(self) -> None:
        """Every Embed queued so far, through the model together; one Embeddings reply each."""
        batch = list(self.queue)
        self.queue.clear()
        self._last_beat = time.monotonic()  # the serve loop's own beat is at most an interval old
        spans = self.spans
        if spans is not None:
            for msg in batch:
                spans.start(msg)
        embed = self.engine.embed if isinstance(self.engine, Embeds) else None
        accepted: list[tuple[wire.Embed, list[list[int]]]] = []
        for msg in batch:
            try:
                if embed is None or self.spec.task != "embed":
                    raise RequestRejected(
                        RejectCode.INVALID_REQUEST,
                        f"model '{self.spec.name}' is not an embedding model",
                        "model",
                    )
                accepted.append((msg, self._inputs(msg)))
            except RequestRejected as exc:
                self.send(wire.Rejected(msg.rid, exc.code, exc.message, exc.param))
                if spans is not None:
                    spans.rejected(msg.rid, exc.code.value)
        if not accepted:
            return
        assert embed is not None
        vectors = self._embed_in_batches(embed, [ids for _, inputs in accepted for ids in inputs])
        start = 0
        for msg, inputs in accepted:
            count = len(inputs)
            tokens = sum(len(ids) for ids in inputs)
            self.send(wire.Embeddings(msg.rid, vectors[start : start + count], tokens))
            if spans is not None:
                spans.embedded(msg.rid, tokens)
            start += count

    def _embed_in_batches(
        self, embed: Callable[[list[list[int]]], list[list[float]]], inputs: list[list[int]]
    ) -> list[list[float]]:
        """One vector per input, in order; the model sees one engine batch at a time."""
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        vectors: list[list[float]] = [[] for _ in inputs]
        size = max(self.info.max_batch_size, 1)
        for start in range(0, len(order), size):
            indices = order[start : start + size]
            for i, vector in zip(indices, embed([inputs[i] for i in indices]), strict=True):
                vectors[i] = vector
            self._beat_if_due()
        return vectors

    def _beat_if_due(self) -> None:
        now = time.monotonic()
        if self.heartbeat is not None and now - self._last_beat >= self.spec.heartbeat_interval_s:
            self._last_beat = now
            self.heartbeat()

    def _inputs(self, msg: wire.Embed) -> list[list[int]]:
        if msg.texts is not None:
            inputs = []
            for text in msg.texts:
                inputs.append(self.engine.encode(text, add_special_tokens=True))
                self._beat_if_due()  # megabytes of text take the tokenizer seconds
        else:
            inputs = [list(ids) for ids in msg.token_ids or []]
        limit, vocab = self.info.max_seq_len, self.info.vocab_size
        for ids in inputs:
            if not ids:
                raise RequestRejected(RejectCode.INVALID_PROMPT, "An input is empty.", "input")
            if len(ids) > limit:
                raise RequestRejected(
                    RejectCode.CONTEXT_LENGTH_EXCEEDED,
                    f"This model's maximum context length is {limit} tokens, however an input has "
                    f"{len(ids)} tokens.",
                    "input",
                )
            if any(not 0 <= t < vocab for t in ids):
                raise RequestRejected(
                    RejectCode.INVALID_TOKENS, f"Token ids must be in [0, {vocab}).", "input"
                )
        return inputs
