"""The engines checked against the contract, by mypy: never imported at run time.

Each engine class is assigned to the protocols it must satisfy (the core `Engine`, and each optional
capability its settings claim), so a missing or mistyped method is a type error in `make lint`,
not a worker that fails on its first request. tests/unit/test_engine_contract.py checks the
settings' claims against the classes at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from model_worker.engines.base import (
        CountsPrefill,
        Embeds,
        Engine,
        PreparesConstraints,
        ScoresPrompts,
        WarmsBatches,
    )
    from model_worker.engines.exllamav2.engine import ExLlamaV2Engine
    from model_worker.engines.exllamav3.engine import ExLlamaV3Engine
    from model_worker.engines.transformers.embedding import EmbeddingEngine
    from model_worker.engines.transformers.engine import TransformersEngine

    def engines_meet_the_contract(
        v2: ExLlamaV2Engine, v3: ExLlamaV3Engine, hf: TransformersEngine, embedder: EmbeddingEngine
    ) -> None:
        generators: list[Engine] = [v2, v3, hf, embedder]
        scorers: list[ScoresPrompts] = [v2, hf, embedder]
        preparers: list[PreparesConstraints] = [v2, hf]
        embedders: list[Embeds] = [embedder]
        batch_warmers: list[WarmsBatches] = [v2, v3]
        prefill_counters: list[CountsPrefill] = [v2, v3, hf]
        del generators, scorers, preparers, embedders, batch_warmers, prefill_counters
