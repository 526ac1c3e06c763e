"""The exllamav3 engine: EXL3 and unquantized models on CUDA GPUs, batched with its Triton paged attention.

Imported in the worker process; `engine_class()` imports torch and exllamav3 only when called.
"""

from __future__ import annotations

from model_worker.engines.exllamav3.settings import ExLlamaV3Settings as Settings

__all__ = ["Settings", "engine_class"]


def engine_class() -> type:
    from model_worker.engines.exllamav3.engine import ExLlamaV3Engine

    return ExLlamaV3Engine
