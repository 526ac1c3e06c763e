"""Fixtures for the GPU tests: demo model folders and loaded exllamav2 engines, once per session.

Runs in the pytest process on the GPU machine. Owns the session's model folders (taken from
GPU_TEST_TINY_MODEL / GPU_TEST_BIG_MODEL when scripts/gpu_run.sh made them already, else written
here on the GPU) and the engines loaded from them. Every fixture checks that the engine is left
with no jobs, so one test's leftovers cannot skew the next one's timings.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from model_worker.engines.registry import create_engine
from tests.gpu.support import SKIP_REASON, greedy

TINY_SETTINGS = dict(max_seq_len=2048, max_batch_size=4, max_chunk_size=512)
BIG_SETTINGS = dict(max_seq_len=4096, max_batch_size=4, max_chunk_size=2048)


def _model_dir(env: str, tmp_path_factory: pytest.TempPathFactory, preset: str, seed: int) -> Path:
    if SKIP_REASON:
        pytest.skip(SKIP_REASON)
    given = os.environ.get(env)
    if given:
        return Path(given)
    from gateway.demo.model import make_demo_model

    return make_demo_model(
        tmp_path_factory.mktemp("models") / preset, preset=preset, seed=seed, device="cuda"
    )


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model_dir("GPU_TEST_TINY_MODEL", tmp_path_factory, "tiny-gpu", 0)


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second, different tiny model (other seed) for two-model tests."""
    return _model_dir("GPU_TEST_TINY_MODEL_B", tmp_path_factory, "tiny-gpu", 1)


@pytest.fixture(scope="session")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model_dir("GPU_TEST_BIG_MODEL", tmp_path_factory, "llama3-8b", 0)


def load_engine(path: Path, max_seq_len: int, **settings: Any) -> Any:
    """An exllamav2 engine, loaded; `settings` are its engine_settings (validated as in a registry)."""
    engine = create_engine("exllamav2", str(path), max_seq_len, settings)
    engine.load(lambda detail, progress: None)
    return engine


def _session_engine(path: Path, settings: dict[str, Any]) -> Iterator[Any]:
    engine = load_engine(path, **settings)
    # Pay one-time costs here so that tests time steady-state generation.
    engine.submit("fixture-warmup", engine.encode("warm up", True), greedy(16))
    while engine.has_work():
        engine.step()
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def tiny_engine(tiny_model: Path) -> Iterator[Any]:
    yield from _session_engine(tiny_model, TINY_SETTINGS)


@pytest.fixture(scope="session")
def big_engine(big_model: Path) -> Iterator[Any]:
    yield from _session_engine(big_model, BIG_SETTINGS)


@pytest.fixture
def engine(tiny_engine: Any) -> Iterator[Any]:
    """The session's tiny engine, checked to be idle before and after the test."""
    assert not tiny_engine.has_work()
    yield tiny_engine
    generator = tiny_engine.generator
    leftovers = [j.identifier for j in generator.pending_jobs + generator.active_jobs]
    for rid in leftovers:
        tiny_engine.cancel(rid)
    assert not leftovers, f"test left jobs in the generator: {leftovers}"
