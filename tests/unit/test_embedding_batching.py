"""The worker batches embeddings: every Embed taken in one turn goes through the model in one call,
and padding in a batch does not change any vector; a turn longer than one engine batch beats the
heartbeat between batches, takes cancels between them, and counts in the load the worker reports
(active while its turn runs, queued before) and as work for its idle time. The inputs come
prepared as the prompt thread prepares them (model_worker.prompt_desk). Real embedding engine; the
frames the worker would send are collected."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.demo.embedding_model import make_demo_embedding_model
from model_worker.embedding_batch import EmbeddingBatch
from model_worker.engines.registry import lookup
from model_worker.jobs import JobDesk
from model_worker.prompt_desk import PromptDesk
from wire import messages as wire
from wire.params import WorkerSpec
from wire.results import RejectCode
from wire.stats import WorkerLoad


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


def desk_for(engine: Any, spec: WorkerSpec) -> PromptDesk:
    return PromptDesk(engine.text_codec(), None, spec, engine.info(), frozenset())


def recording(engine: Any, monkeypatch: pytest.MonkeyPatch, events: list[str]) -> Any:
    """The engine's own embed, recorded as `embed N` per engine batch; returns the original."""
    embed = engine.embed

    def recording_embed(inputs: list[list[int]]) -> list[list[float]]:
        events.append(f"embed {len(inputs)}")
        vectors: list[list[float]] = embed(inputs)
        return vectors

    monkeypatch.setattr(engine, "embed", recording_embed)
    return embed


def assert_vectors(engine: Any, embed: Any, got: list[list[float]], texts: list[str]) -> None:
    alone = embed([engine.encode(t, add_special_tokens=True) for t in texts])
    for vector, single in zip(got, alone, strict=True):
        assert max(abs(a - b) for a, b in zip(vector, single, strict=True)) < 1e-5


def test_embed_requests_are_batched(
    engine_and_spec: tuple[Any, WorkerSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, spec = engine_and_spec
    sent: list[wire.Message] = []
    events: list[str] = []
    embed = recording(engine, monkeypatch, events)
    desk, batcher = desk_for(engine, spec), EmbeddingBatch(engine, engine.info(), spec, sent.append)
    texts = [["a short one"], ["a somewhat longer input about the weather today", "x"], ["Once upon a time"]]
    for index, batch in enumerate(texts):
        batcher.add(desk.prepare_embed(wire.Embed(f"r{index}", batch, None)))
    batcher.add(desk.prepare_embed(wire.Embed("bad", None, [[10**6]])))  # refused alone; the others run
    batcher.run()
    assert events == ["embed 4"]  # one pass through the model for all three requests' four inputs
    replies = {m.rid: m for m in sent}  # type: ignore[attr-defined]
    assert isinstance(replies["bad"], wire.Rejected) and replies["bad"].param == "input"
    assert replies["bad"].code is RejectCode.INVALID_TOKENS
    for index, batch in enumerate(texts):
        reply = replies[f"r{index}"]
        assert isinstance(reply, wire.Embeddings) and len(reply.vectors) == len(batch)
        assert_vectors(engine, embed, reply.vectors, batch)
    assert not batcher.queue


def test_the_prompt_desk_refuses_what_the_model_cannot_embed(engine_and_spec: tuple[Any, WorkerSpec]) -> None:
    engine, spec = engine_and_spec
    desk = desk_for(engine, spec)
    refused = {
        "empty": desk.prepare_embed(wire.Embed("empty", None, [[5], []])),
        "long": desk.prepare_embed(wire.Embed("long", ["word " * 600], None)),
        "chat": desk_for(engine, dataclasses.replace(spec, task="generate")).prepare_embed(
            wire.Embed("chat", ["hi"], None)
        ),
    }
    codes = {rid: (p.rejection.code, p.rejection.param) for rid, p in refused.items() if p.rejection}
    assert codes == {
        "empty": (RejectCode.INVALID_PROMPT, "input"),
        "long": (RejectCode.CONTEXT_LENGTH_EXCEEDED, "input"),
        "chat": (RejectCode.INVALID_REQUEST, "model"),
    }


def test_a_turn_of_several_engine_batches_beats_between_them(
    engine_and_spec: tuple[Any, WorkerSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, spec = engine_and_spec
    spec = dataclasses.replace(spec, heartbeat_interval_s=0.0)  # every chance to beat is due
    sent: list[wire.Message] = []
    events: list[str] = []
    embed = recording(engine, monkeypatch, events)
    batcher = EmbeddingBatch(
        engine, engine.info(), spec, sent.append, heartbeat=lambda: events.append("beat")
    )
    texts = [f"input number {i} " * (1 + i % 3) for i in range(10)]  # max_batch_size 4: three batches
    batcher.add(desk_for(engine, spec).prepare_embed(wire.Embed("r", texts, None)))
    batcher.run()
    embeds = [e for e in events if e.startswith("embed")]
    assert embeds == ["embed 4", "embed 4", "embed 2"]
    # Without a beat between them the gateway hears nothing for the whole turn.
    for before, after in zip(events, events[1:], strict=False):
        assert not (before.startswith("embed") and after.startswith("embed")), events
    (reply,) = sent
    assert isinstance(reply, wire.Embeddings)
    assert_vectors(engine, embed, reply.vectors, texts)


def test_a_cancel_taken_between_engine_batches_drops_the_rest_of_its_request(
    engine_and_spec: tuple[Any, WorkerSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway gave up on "dropped" (its deadline, or its client left) while its turn ran: its
    inputs after the batch in progress never reach the model, and it is not answered; the request
    beside it in the turn is."""
    engine, spec = engine_and_spec
    sent: list[wire.Message] = []
    events: list[str] = []
    embed = recording(engine, monkeypatch, events)
    batcher: EmbeddingBatch

    def arrived() -> None:  # what the serve loop's Cancel handler does, once the first batch is run
        events.append("arrived")
        if events.count("arrived") == 1:
            assert batcher.cancel("dropped")

    batcher = EmbeddingBatch(engine, engine.info(), spec, sent.append, arrived=arrived)
    desk = desk_for(engine, spec)
    kept = ["one", "two"]  # the shortest: in the first engine batch, with two of the other's
    batcher.add(desk.prepare_embed(wire.Embed("kept", kept, None)))
    batcher.add(desk.prepare_embed(wire.Embed("dropped", ["a longer input, and more of it"] * 10, None)))
    batcher.run()
    assert events == ["embed 4", "arrived"]  # without the cancel: three engine batches
    (reply,) = sent
    assert isinstance(reply, wire.Embeddings) and reply.rid == "kept"
    assert_vectors(engine, embed, reply.vectors, kept)
    assert not batcher.cancel("dropped")  # forgotten: a second Cancel is nothing


def test_a_cancel_before_its_turn_runs_nothing(
    engine_and_spec: tuple[Any, WorkerSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, spec = engine_and_spec
    sent: list[wire.Message] = []
    events: list[str] = []
    recording(engine, monkeypatch, events)
    batcher = EmbeddingBatch(engine, engine.info(), spec, sent.append)
    batcher.add(desk_for(engine, spec).prepare_embed(wire.Embed("r", ["queued"], None)))
    assert batcher.cancel("r") and not batcher.cancel("r")
    batcher.run()
    assert events == [] and sent == []


def test_an_embedding_turn_is_load_and_work_for_the_idle_time_the_worker_reports(
    engine_and_spec: tuple[Any, WorkerSpec],
) -> None:
    """An embedding worker holds no generation job: its request must still count in its load (the
    gateways route by it), queued until its turn and active while it runs, and its idle time must
    stop while it embeds (the leading gateway unloads a model idle for `idle_unload_s`), and count
    from its last turn."""
    engine, spec = engine_and_spec
    spec = dataclasses.replace(spec, heartbeat_interval_s=0.0)  # a heartbeat after every engine batch
    jobs = JobDesk(engine, spec, lambda message: None)
    beats: list[WorkerLoad] = []
    batcher = EmbeddingBatch(engine, engine.info(), spec, lambda message: None,
                             heartbeat=lambda: beats.append(jobs.load()),
                             counted=jobs.count_embeds)  # fmt: skip
    texts = [f"input number {i} " * 20 for i in range(12)]  # three engine batches
    assert jobs.load(embeds_arriving=1).queued == 1  # its inputs being tokenized
    batcher.add(desk_for(engine, spec).prepare_embed(wire.Embed("r", texts, None)))
    assert (jobs.load().active, jobs.load().queued, jobs.load().yours, jobs.held) == (0, 1, 1, 1)
    started = time.monotonic()
    batcher.run()
    ended = time.monotonic()
    # The premise: a worker that counted only generation jobs would report the whole turn as idle.
    assert ended - started > 0.01, "make the turn longer"
    assert len(beats) == 3, beats
    assert all((load.active, load.queued, load.yours, load.idle_s) == (1, 0, 1, 0.0) for load in beats), beats
    assert (jobs.load().active, jobs.load().queued, jobs.held) == (0, 0, 0)
    assert jobs.load().idle_s <= time.monotonic() - ended + 0.001  # counted from the turn's end
