"""The transformers engine: any Hugging Face causal LM on CPU or one GPU (dev hosts, CI, the demo).

Imported in the worker process; `engine_class()` imports torch and transformers only when called.
"""

from __future__ import annotations

from model_worker.engines.transformers.settings import TransformersSettings as Settings

__all__ = ["Settings", "embedding_class", "engine_class"]


def engine_class() -> type:
    from model_worker.engines.transformers.engine import TransformersEngine

    return TransformersEngine


def embedding_class() -> type:
    """The engine of `task: embed` models: a sentence-transformers model (pooling, Normalize)."""
    from model_worker.engines.transformers.embedding import EmbeddingEngine

    return EmbeddingEngine
