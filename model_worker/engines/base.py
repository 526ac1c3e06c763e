"""The engine interface, as seen by the worker's serve loop.

Runs in a worker process. An engine owns exactly one model, one generator and one cache, and is
driven by one thread: the serve loop calls `submit`, `cancel` and `step` between socket polls,
never concurrently. Engine-specific result dictionaries stay inside the engine module; the
serve loop only sees `JobOutput` (from the wire protocol) and `RequestRejected`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from model_worker.protocol import JobOutput, SamplingParams

# (detail, progress in [0, 1] or None) -> None; the serve loop forwards it as a Status message.
ProgressCallback = Callable[[str, "float | None"], None]


# Temperatures below this are greedy: dividing logits by them overflows to inf (vLLM does the same).
GREEDY_BELOW_TEMPERATURE = 1e-5


class RequestRejected(Exception):
    """One request cannot run (too long, bad parameter). Recoverable: the worker keeps serving."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


class EngineFatal(Exception):
    """The engine's state can no longer be trusted; the worker must report it and exit."""


@dataclass
class EngineSettings:
    """The registry entry's engine-relevant fields, as the worker received them."""

    path: str
    max_seq_len: int
    max_batch_size: int = 8
    max_chunk_size: int = 2048
    cache_size: int | None = None
    cache_mode: str = "FP16"
    gpu_split: list[float] | None = None
    reserve_vram_gb: float = 0.0
    dtype: str = "auto"
    threads: int | None = None
    draft_path: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Engine(Protocol):
    """The narrow surface every engine implements. Adding an engine means adding one module."""

    def load(self, progress: ProgressCallback) -> None:
        """Load weights, tokenizer, cache and generator. Raises on failure (fatal)."""

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Tokenize with the model's own tokenizer."""

    def decode(self, token_ids: list[int]) -> str: ...

    def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> int:
        """Queue a job; returns its prompt token count. Raises RequestRejected if it cannot run."""

    def cancel(self, rid: str) -> bool:
        """Stop a job and free its cache; False if it was unknown or already finished."""

    def step(self) -> list[JobOutput]:
        """Advance every active job by one step; one output per job that produced something."""

    def has_work(self) -> bool: ...

    def stats(self) -> dict[str, Any]:
        """active_jobs, queued_jobs and engine figures for heartbeats (plain msgpack types)."""

    def info(self) -> dict[str, Any]:
        """engine name, max_seq_len, devices, limits (batch size, paged); plain msgpack types."""

    def close(self) -> None: ...


def load_engine(name: str, settings: EngineSettings) -> Engine:
    """Import only the engine asked for: the exllamav2 module needs CUDA, the other does not."""
    if name == "transformers":
        from model_worker.engines.transformers_engine import TransformersEngine

        return TransformersEngine(settings)
    if name == "exllamav2":
        from model_worker.engines.exllamav2_engine import ExLlamaV2Engine

        return ExLlamaV2Engine(settings)
    if name.startswith("test:") and os.environ.get("GATEWAY_ALLOW_TEST_ENGINES") == "1":
        # Fault-injection engines live under tests/ and are importable only when tests put them
        # on the path; they are not part of the product.
        import importlib

        module_name, _, class_name = name[len("test:") :].rpartition(".")
        engine_class = getattr(importlib.import_module(module_name), class_name)
        return engine_class(settings)  # type: ignore[no-any-return]
    raise ValueError(f"unknown engine {name!r}")
