"""The exllamav2 engine: EXL2, GPTQ and FP16 models on CUDA GPUs, batched with paged attention.

Imported in the worker process; `engine_class()` imports torch and exllamav2 only when called.
"""

from __future__ import annotations

from model_worker.engines.exllamav2.settings import ExLlamaV2Settings as Settings

__all__ = ["Settings", "engine_class"]


def engine_class() -> type:
    from model_worker.engines.exllamav2.engine import ExLlamaV2Engine

    return ExLlamaV2Engine
