"""What the gateway asks of a worker: sampling parameters, chat messages and the worker's spec.

Imported by the gateway (which builds these at the API edge, already validated and normalized) and
by the worker (which receives them in Generate and on its command line). Plain dataclasses; the
codec in wire.codec derives their wire form and validation from the type hints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

_FINITE_FIELDS = ("temperature", "top_p", "min_p", "typical_p", "repetition_penalty")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Everything the engine needs to run one job; already validated and normalized at the API edge."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    # None: no logprobs. 0: logprob of the chosen token only. k > 0: also the top k alternatives.
    logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Structured output: json_object asks for any JSON object; json_schema (JSON text) for one
    # matching that schema. Engines enforce it by constrained decoding.
    json_object: bool = False
    json_schema: str | None = None

    def check(self) -> None:
        """Called by the codec after decoding: what the types alone do not say."""
        for name in _FINITE_FIELDS:
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} is not finite")

    def with_seed(self, seed: int | None) -> SamplingParams:
        return SamplingParams(**{**_as_kwargs(self), "seed": seed})


def _as_kwargs(params: SamplingParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in SamplingParams.__dataclass_fields__}


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat message as the model's chat template sees it (content already one string)."""

    role: str
    content: str
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        return message


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker process needs to serve one model: written by the gateway for the workers it
    spawns, or built by a remote worker from its own copy of the registry.

    `engine_settings` is the engine's own section of the registry entry. The gateway does not know
    its fields: the engine's settings model (model_worker/engines/<engine>/settings.py) validates it
    at config time and again in the worker.
    """

    name: str
    engine: str
    path: str
    max_seq_len: int
    engine_settings: dict[str, Any]
    chat_template: str | None = None
    heartbeat_interval_s: float = 1.0
    warmup_runs: int = 2
    # The model's `env` from the registry: set in the worker before its engine is imported.
    env: dict[str, str] = field(default_factory=dict)


# Registry defaults that both processes apply: the gateway to the entries it validates, a remote
# worker to the same file it reads on its own host.
DEFAULT_ENGINE = "exllamav2"
DEFAULT_MAX_SEQ_LEN = 4096
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
