"""Extreme but valid sampling settings never raise inside the engine (a crash would take every request
on that worker down with it). Found by fuzzing: temperature=5e-324 overflowed to NaN probabilities."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_worker.engines.registry import create_engine
from model_worker.engines.transformers.engine import TransformersEngine
from wire.params import SamplingParams
from wire.results import FinishReason


@pytest.fixture(scope="module")
def engine(demo_model_dir: Path) -> TransformersEngine:
    loaded: TransformersEngine = create_engine("transformers", str(demo_model_dir), 256, {"threads": 1})
    loaded.load(lambda detail, progress: None)
    return loaded


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 5e-324},
        {"temperature": 1e-300, "top_p": 0.5},
        {"temperature": 2.0, "typical_p": 1e-300},
        {"temperature": 1.0, "min_p": 1.0, "top_p": 1e-300},
        {"temperature": 1.0, "logit_bias": {i: -100.0 for i in range(1000)}},
        {"temperature": 0.5, "repetition_penalty": 1e-300},
        {"temperature": 2.0, "frequency_penalty": 2.0, "presence_penalty": -2.0},
    ],
    ids=lambda s: "-".join(sorted(s)),
)
def test_extreme_settings_finish_normally(engine: TransformersEngine, settings: dict[str, object]) -> None:
    rid = f"r{id(settings)}"
    engine.submit(rid, engine.encode("hello", True), SamplingParams(max_tokens=5, **settings))  # type: ignore[arg-type]
    finish = None
    while engine.has_work():
        for output in engine.step():
            finish = output.finish_reason or finish
    assert finish in (FinishReason.LENGTH, FinishReason.STOP)


def test_tiny_temperature_is_greedy(engine: TransformersEngine) -> None:
    def run(rid: str, temperature: float) -> list[int]:
        engine.submit(rid, engine.encode("same", True), SamplingParams(max_tokens=8, temperature=temperature))
        ids: list[int] = []
        while engine.has_work():
            for output in engine.step():
                ids += output.token_ids
        return ids

    assert run("a", 1e-9) == run("b", 0.0)
