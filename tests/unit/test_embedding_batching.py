"""The worker batches embeddings: every Embed drained from the socket goes through the model in one
call, and padding in a batch does not change any vector. Real embedding engine, real worker object
(its socket is never connected; the frames it would send are collected)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.demo.embedding_model import make_demo_embedding_model
from model_worker.engines.registry import lookup
from model_worker.serve_loop import Worker
from wire import messages as wire
from wire.params import WorkerSpec


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = make_demo_embedding_model(tmp_path_factory.mktemp("models") / "embed", seed=3)
    spec = WorkerSpec("e", "transformers", str(path), 512, {"threads": 1, "max_batch_size": 4}, task="embed")
    worker = Worker("e#0", "ipc:///nonexistent", spec, parent_pid=None)
    entry = lookup("transformers")
    engine = entry.package.embedding_class()(
        str(path), 512, entry.settings.model_validate(spec.engine_settings)
    )
    engine.load(lambda detail, progress: None)
    worker.engine, worker.info = engine, engine.info()
    yield worker
    worker._sock.close()
    worker._ctx.term()


def test_embed_requests_are_batched(worker: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[wire.Message] = []
    calls: list[int] = []
    monkeypatch.setattr(worker, "_send", sent.append)
    embed = worker.engine.embed
    monkeypatch.setattr(worker.engine, "embed", lambda inputs: calls.append(len(inputs)) or embed(inputs))
    texts = [["a short one"], ["a somewhat longer input about the weather today", "x"], ["Once upon a time"]]
    for index, batch in enumerate(texts):
        worker._on_embed(wire.Embed(f"r{index}", batch, None))
    worker._on_embed(wire.Embed("bad", None, [[10**6]]))  # refused alone; the others still run
    worker._run_embeddings()
    assert calls == [4]  # one pass through the model for all three requests' four inputs
    replies = {m.rid: m for m in sent}
    assert isinstance(replies["bad"], wire.Rejected) and replies["bad"].param == "input"
    for index, batch in enumerate(texts):
        reply = replies[f"r{index}"]
        assert isinstance(reply, wire.Embeddings) and len(reply.vectors) == len(batch)
        alone = embed([worker.engine.encode(t, add_special_tokens=True) for t in batch])
        for got, single in zip(reply.vectors, alone, strict=True):
            assert max(abs(a - b) for a, b in zip(got, single, strict=True)) < 1e-5
    assert not worker._embed_queue
