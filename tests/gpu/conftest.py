"""Fixtures for the GPU tests: demo model folders and loaded engines, once per session.

Runs in the pytest process on the GPU machine. Owns the session's model folders (taken from
GPU_TEST_TINY_MODEL / GPU_TEST_BIG_MODEL when scripts/gpu_run.sh made them already, else written
here on the GPU) and the engines loaded from them, one per engine mode:

    exllamav2-paged    exllamav2 with flash-attn: continuous batching over a paged cache
    exllamav2-unpaged  exllamav2 with `paged: false`: one job at a time
    exllamav3          exllamav3: batching through its own Triton paged attention

Tests that take the `engine` fixture run once per mode. A mode whose library is missing is
skipped, unless GPU_TEST_REQUIRE (comma-separated modes, set by gpu_run.sh) says it must run, in
which case its absence fails the test. Every fixture checks that the engine is left with no jobs,
so one test's leftovers cannot skew the next one's timings.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from model_worker.engines.registry import create_engine
from tests.gpu.support import (
    BIG_SETTINGS,
    ENGINE_MODES,
    PAGED_MODES,
    SKIP_REASON,
    TINY_SETTINGS,
    greedy,
    mode_unavailable,
)


def require_mode(mode: str) -> None:
    """Skip (or fail, if the run requires this mode) when the mode cannot run here."""
    if SKIP_REASON:
        pytest.skip(SKIP_REASON)
    reason = mode_unavailable(mode)
    if reason:
        required = {m.strip() for m in os.environ.get("GPU_TEST_REQUIRE", "").split(",") if m.strip()}
        if mode in required:
            pytest.fail(f"{mode} is required by this run but cannot run: {reason}")
        pytest.skip(f"{mode}: {reason}")


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


__all__ = ["load_engine", "require_mode"]


def load_engine(mode: str, path: Path, max_seq_len: int, **settings: Any) -> Any:
    """An engine of `mode`, loaded; `settings` are its engine_settings (validated as in a registry)."""
    require_mode(mode)
    engine_name, mode_settings = ENGINE_MODES[mode]
    engine = create_engine(engine_name, str(path), max_seq_len, {**mode_settings, **settings})
    engine.load(lambda detail, progress: None)
    if mode == "exllamav2-paged" and not engine.paged:
        engine.close()
        pytest.fail("exllamav2 loaded unpaged although flash-attn was found")
    return engine


class EnginePool:
    """Engines loaded on first use and kept for the session (tiny models: a few MB of GPU each)."""

    def __init__(self) -> None:
        self.engines: dict[tuple[str, str, str], Any] = {}

    def get(self, mode: str, model: Path, settings: dict[str, Any]) -> Any:
        key = (mode, str(model), repr(sorted(settings.items())))
        if key not in self.engines:
            engine = load_engine(mode, model, **settings)
            # Pay one-time costs here so that tests time steady-state generation.
            engine.submit("fixture-warmup", engine.encode("warm up", True), greedy(16))
            while engine.has_work():
                engine.step()
            self.engines[key] = engine
        return self.engines[key]

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


@pytest.fixture(scope="session")
def engine_pool() -> Iterator[EnginePool]:
    pool = EnginePool()
    yield pool
    pool.close()


def _checked(engine: Any) -> Iterator[Any]:
    assert not engine.has_work()
    yield engine
    generator = engine.generator
    leftovers = [j.identifier for j in generator.pending_jobs + generator.active_jobs]
    for rid in leftovers:
        engine.cancel(rid)
    assert not leftovers, f"test left jobs in the generator: {leftovers}"


@pytest.fixture(params=list(ENGINE_MODES))
def engine(request: pytest.FixtureRequest, engine_pool: EnginePool, tiny_model: Path) -> Iterator[Any]:
    """The session's tiny engine of each mode, checked to be idle before and after the test."""
    yield from _checked(engine_pool.get(request.param, tiny_model, TINY_SETTINGS))


@pytest.fixture(params=PAGED_MODES)
def paged_engine(request: pytest.FixtureRequest, engine_pool: EnginePool, tiny_model: Path) -> Iterator[Any]:
    """The session's tiny engine of each batching mode."""
    yield from _checked(engine_pool.get(request.param, tiny_model, TINY_SETTINGS))


@pytest.fixture(params=PAGED_MODES)
def big_engine(request: pytest.FixtureRequest, engine_pool: EnginePool, big_model: Path) -> Iterator[Any]:
    """The 8B-shape model on each batching mode."""
    yield from _checked(engine_pool.get(request.param, big_model, BIG_SETTINGS))


@pytest.fixture
def mode(request: pytest.FixtureRequest) -> str:
    """The engine mode of the test's `engine`/`paged_engine`/`big_engine` parameter."""
    return str(request.node.callspec.params.get("engine") or request.node.callspec.params.get("paged_engine")
               or request.node.callspec.params.get("big_engine"))  # fmt: skip
