"""The engines against their contract: every parameter an engine's settings claim needs a method
the engine implements (mypy checks the signatures, in engines/contract_check.py)."""

from __future__ import annotations

import pytest

from model_worker.engines import registry
from model_worker.engines.base import ScoresPrompts, missing_capabilities
from model_worker.engines.transformers.engine import TransformersEngine


@pytest.mark.parametrize("name", sorted(registry.ENGINES))
def test_each_engine_implements_what_its_settings_claim(name: str) -> None:
    entry = registry.lookup(name)
    assert missing_capabilities(entry.engine_class(), entry.settings.supported_parameters) == []


def test_exllamav3_does_not_claim_prompt_logprobs_it_cannot_compute() -> None:
    entry = registry.lookup("exllamav3")
    assert not hasattr(entry.engine_class(), "prompt_logprobs")
    assert "prompt_logprobs" not in entry.settings.supported_parameters


def test_a_claim_without_the_method_is_named() -> None:
    class Claims:
        def step(self) -> list[object]:
            return []

    assert missing_capabilities(Claims, frozenset({"prompt_logprobs", "logit_bias"})) == ["prompt_logprobs"]
    assert missing_capabilities(TransformersEngine, frozenset({"prompt_logprobs"})) == []
    assert issubclass(TransformersEngine, ScoresPrompts)
