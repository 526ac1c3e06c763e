"""The transformers engine: any Hugging Face causal LM on CPU or one GPU (dev hosts, CI, the demo).

Imported in the worker process; `engine_class()` imports torch and transformers only when called.
"""

from __future__ import annotations

from model_worker.engines.transformers.settings import TransformersSettings as Settings

__all__ = ["Settings", "engine_class"]


def engine_class() -> type:
    from model_worker.engines.transformers.engine import TransformersEngine

    return TransformersEngine
