"""The engine contract: the interface the serve loop drives, and the base of every settings model.

Imported in the worker process (and, for the settings base only, by `model_worker.settings_check`,
which the gateway runs at config time; nothing here imports torch). An engine owns exactly one
model, one generator and one cache, and is driven by one thread: the serve loop calls `submit`,
`cancel` and `step`, never concurrently. Only the tokenizer it hands out (`text_codec`) is used on
another thread, the worker's prompt thread. Engine result dictionaries stay inside each engine's
folder; the serve loop only sees the wire types (JobOutput, EngineStats, EngineInfo) and
`RequestRejected`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from wire.params import SamplingParams
from wire.results import JobOutput, RejectCode, TokenLogprob
from wire.stats import EngineInfo, EngineStats

# (detail, progress in [0, 1] or None) -> None; the serve loop forwards it as a Status message.
ProgressCallback = Callable[[str, "float | None"], None]

# Temperatures below this are greedy: dividing logits by them overflows to inf (vLLM does the same).
GREEDY_BELOW_TEMPERATURE = 1e-5


class RequestRejected(Exception):
    """One request cannot run (too long, bad parameter). Recoverable: the worker keeps serving."""

    def __init__(self, code: RejectCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


class EngineSettings(BaseModel):
    """Settings every engine takes; each engine's folder subclasses it with its own fields.

    Validated twice: by the gateway at config time (through `model_worker.settings_check`, with the
    registry's max_seq_len, GPU counts and folder in the validation context) and by the worker
    before it loads. Relative paths resolve against the registry file's folder.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    # Whether the engine refuses to run without a GPU (checked at config time for local workers).
    needs_gpu: ClassVar[bool] = False
    # The optional request parameters this engine implements (names as in
    # engines.validation.OPTIONAL_PARAMETERS); a job using any other is refused, naming it.
    supported_parameters: ClassVar[frozenset[str]] = frozenset()

    max_batch_size: int = Field(8, ge=1, description="Jobs batched in one generator step.")
    max_chunk_size: int = Field(
        2048, ge=16, description="Prompt tokens per prefill step; bounds the time of one step."
    )

    @field_validator("*", mode="before")
    @classmethod
    def _true_false_only_for_switches(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic reads true as 1 (`max_batch_size: true`, `gpu_split: [true]`); only a switch takes it.
        field = cls.model_fields.get(info.field_name or "")
        items = value if isinstance(value, list) else [value]
        if field is not None and field.annotation is not bool and any(isinstance(v, bool) for v in items):
            raise ValueError("true/false is not a value of this setting; write the value")
        return value

    def weight_dirs(self) -> list[Path]:
        """Model folders the engine loads besides the model's own (draft models): for placement."""
        return []

    def reserved_vram_gb(self) -> float:
        """GB per GPU that placement must leave free beside the weights."""
        return 0.0


def settings_error(model: type[BaseModel], field: str, message: str, value: Any) -> ValidationError:
    """A validation error that names `field`, for checks a model validator makes across fields (a
    plain ValueError there would name no field, and the registry error must say which one)."""
    error = PydanticCustomError("value_error", "{message}", {"message": message})
    return ValidationError.from_exception_data(
        model.__name__, [InitErrorDetails(type=error, loc=(field,), input=value)]
    )


def context_max_seq_len(context: Any) -> int | None:
    """The model's max_seq_len from the validation context (settings_check supplies it), if any."""
    value = (context or {}).get("max_seq_len")
    return int(value) if isinstance(value, int) and value > 0 else None


class TextCodec(Protocol):
    """The model's tokenizer, as the prompt side of a worker uses it."""

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class Engine(TextCodec, Protocol):
    """The narrow surface every engine implements. Adding an engine is a folder and a registry line."""

    def load(self, progress: ProgressCallback) -> None:
        """Load weights, tokenizer, cache and generator. Raises on failure (fatal)."""

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Tokenize with the model's own tokenizer."""

    def decode(self, token_ids: list[int]) -> str: ...

    def text_codec(self) -> TextCodec:
        """The tokenizer for the worker's prompt thread, which renders and tokenizes prompts while
        this engine steps (called once, after load): an instance of its own where sharing one
        across threads is unsafe."""

    def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a job that passed the shared checks (engines.validation); RequestRejected if this
        engine in particular cannot run it."""

    def cancel(self, rid: str) -> bool:
        """Stop a job and free its cache; False if it was unknown or already finished."""

    def step(self) -> list[JobOutput]:
        """Advance every active job by one step; one output per job that produced something.
        Every call that ran the model counts in stats().steps, prefill chunks that output nothing
        included: the gateway's wedge watchdog judges a worker by that counter."""

    def has_work(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def info(self) -> EngineInfo: ...

    def close(self) -> None: ...


# Optional capabilities: an engine declares one by implementing its method, and the serve loop
# asks with isinstance. mypy checks every engine against the protocols it claims
# (engines/contract_check.py), and a worker refuses to start an engine whose settings list a
# parameter that needs a capability the engine lacks.


@runtime_checkable
class ScoresPrompts(Protocol):
    def prompt_logprobs(self, prompt_ids: list[int], top: int) -> list[TokenLogprob]:
        """Each prompt token's logprob given the tokens before it, and its `top` alternatives; the
        first entry has logprob None."""


@runtime_checkable
class PreparesConstraints(Protocol):
    def prepare_constraints(self) -> None:
        """Build what structured output needs ahead (once, on a thread beside the serve loop)."""


@runtime_checkable
class Embeds(Protocol):
    def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        """One vector per input."""


@runtime_checkable
class WarmsBatches(Protocol):
    def warmup_batches(self) -> list[int]:
        """Batch sizes the warm-up runs once each, every job at once, ascending; the last is the
        largest batch the engine runs. A library that compiles kernels or captures CUDA graphs per
        batch size pays for it there, not in front of the first concurrent requests."""

    def prefill_chunk_tokens(self) -> int:
        """Prompt tokens one step prefills at most: the largest warm-up batch fills more."""


@runtime_checkable
class CountsPrefill(Protocol):
    def prefill_tokens(self) -> int:
        """Prompt tokens ingested by prefill since the engine loaded, as its library reports its
        progress (the per-step trace reads it around each step)."""

    def cached_prompt_tokens(self) -> int:
        """Of those, the prompt tokens found in the engine's prefix cache, not computed."""


# Request parameters that only an engine with the capability can honour.
CAPABILITY_OF_PARAMETER: dict[str, type] = {"prompt_logprobs": ScoresPrompts}


def missing_capabilities(engine_class: type, supported_parameters: frozenset[str]) -> list[str]:
    """The parameters an engine's settings list as supported whose capability the engine lacks."""
    return sorted(
        name
        for name, capability in CAPABILITY_OF_PARAMETER.items()
        if name in supported_parameters
        and not all(callable(getattr(engine_class, attr, None)) for attr in _methods(capability))
    )


def _methods(protocol: type) -> list[str]:
    return [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]
