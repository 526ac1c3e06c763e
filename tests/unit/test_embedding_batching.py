"""The worker batches embeddings: every Embed drained from the socket goes through the model in one
call, and padding in a batch does not change any vector; a turn longer than one engine batch beats
the heartbeat between batches. Real embedding engine; the frames the worker would send are collected."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.demo.embedding_model import make_demo_embedding_model
from model_worker.embedding_batch import EmbeddingBatch
from model_worker.engines.registry import lookup
from wire import messages as wire
from wire.params import WorkerSpec


@pytest.fixture(scope="module")
def engine_and_spec(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, WorkerSpec]]:
    path = make_demo_embedding_model(tmp_path_factory.mktemp("models") / "embed", seed=3)
    spec = WorkerSpec("e", "transformers", str(path), 512, {"threads": 1, "max_batch_size": 4}, task="embed")
    entry = lookup("transformers")
    engine = entry.package.embedding_class()(
        str(path), 512, entry.settings.model_validate(spec.engine_settings)
    )
    engine.load(lambda detail, progress: None)
    yield engine, spec
    engine.close()


def test_embed_requests_are_batched(
    engine_and_spec: tuple[Any, WorkerSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, spec = engine_and_spec
    sent: list[wire.Message] = []
    calls: list[int] = []
    embed = engine.embed

    def counting_embed(inputs: list[list[int]]) -> list[list[float]]:
        calls.append(len(inputs))
        vectors: list[list[float]] = embed(inputs)
        return vectors

    monkeypatch.setattr(engine, "embed", counting_embed)
    batcher = EmbeddingBatch(engine, engine.info(), spec, sent.append)
    texts = [["a short one"], ["a somewhat longer input about the weather today", "x"], ["Once upon a time"]]
    for index, batch in enumerate(texts):
        batcher.queue.append(wire.Embed(f"r{index}", batch, None))
    batcher.queue.append(wire.Embed("bad", None, [[10**6]]))  # refused alone; the others still run
    batcher.run()
    assert calls == [4]  # one pass through the model for all three requests' four inputs
    replies = {m.rid: m for m in sent}  # type: ignore[attr-defined]
    assert isinstance(replies["bad"], wire.Rejected) and replies["bad"].param == "input"
    for index, batch in enumerate(texts):
        reply = replies[f"r{index}"]
        assert isinstance(reply, wire.Embeddings) and len(reply.vectors) == len(batch)
        alone = embed([engine.encode(t, add_special_tokens=True) for t in batch])
        for got, single in zip(reply.vectors, alone, strict=True):
            assert max(abs(a - b) for a, b in zip(got, single, strict=True)) < 1e-5
    assert not batcher.queue


def test_a_turn_of_several_engine_batches_beats_between_them(
    engine_and_spec: tuple[Any, WorkerSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, spec = engine_and_spec
    spec = dataclasses.replace(spec, heartbeat_interval_s=0.0)  # every chance to beat is due
    sent: list[wire.Message] = []
    events: list[str] = []
    embed = engine.embed

    def recording_embed(inputs: list[list[int]]) -> list[list[float]]:
        events.append(f"embed {len(inputs)}")
        vectors: list[list[float]] = embed(inputs)
        return vectors

    monkeypatch.setattr(engine, "embed", recording_embed)
    batcher = EmbeddingBatch(
        engine, engine.info(), spec, sent.append, heartbeat=lambda: events.append("beat")
    )
    texts = [f"input number {i} " * (1 + i % 3) for i in range(10)]  # max_batch_size 4: three batches
    batcher.queue.append(wire.Embed("r", texts, None))
    batcher.run()
    embeds = [e for e in events if e.startswith("embed")]
    assert embeds == ["embed 4", "embed 4", "embed 2"]
    # Without a beat between them the gateway hears nothing for the whole turn.
    for before, after in zip(events, events[1:], strict=False):
        assert not (before.startswith("embed") and after.startswith("embed")), events
    (reply,) = sent
    assert isinstance(reply, wire.Embeddings)
    alone = embed([engine.encode(t, add_special_tokens=True) for t in texts])
    for got, single in zip(reply.vectors, alone, strict=True):
        assert max(abs(a - b) for a, b in zip(got, single, strict=True)) < 1e-5
