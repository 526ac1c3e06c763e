"""One model's entry of the registry (`models[]` in config/models.yaml): its schema.

Runs in the gateway process (and in `gateway check-config`). Owns `ModelConfig`, with its sampling
defaults (`SamplingDefaults`) and admission limits (`ModelLimits`), and the checks that need only
the one entry; checks across models, and the loading that resolves `path` and `chat_template`
against the registry file, are gateway.config.registry's. `engine_settings` stay a plain mapping
here: the engine's own settings model validates them (gateway.config.engine_check).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, PrivateAttr, field_validator, model_validator

from gateway.config.hub import HubRef
from gateway.config.strict_model import Location, StrictModel, field_errors
from wire.params import DEFAULT_BURST_GATHER_MS, DEFAULT_ENGINE, DEFAULT_MAX_SEQ_LEN

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Parts split by single slashes (org/model), as a URL path carries them (/v1/models/{name}).
_MODEL_NAME = re.compile(r"^[A-Za-z0-9._:-]+(/[A-Za-z0-9._:-]+)*$")
# Set by the gateway for each worker; a model's `env` may not override them.
RESERVED_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "LOG_FORMAT"})
# Tool-call output formats the gateway can read (gateway.tools.parsers implements each).
ToolCallParserName = Literal["hermes", "qwen", "llama3_json", "mistral"]
# Reasoning output formats the gateway can split from the answer (gateway.reasoning.parsers).
ReasoningParserName = Literal["deepseek_r1", "qwen3"]


def _model_name(name: str) -> str:
    # Clients and proxies resolve `.` and `..` in URL paths: /v1/models/.. would never reach the model.
    if not _MODEL_NAME.match(name) or any(part in (".", "..") for part in name.split("/")):
        raise ValueError(
            f"{name!r} is not a model name: letters, digits and . _ : - in parts split by single "
            "slashes, no part '.' or '..' (clients send it in URL paths)"
        )
    return name


ModelName = Annotated[str, AfterValidator(_model_name)]


class SamplingDefaults(StrictModel):
    """Per-model defaults; a request's own values override them."""

    max_tokens: int = Field(512, ge=1, description="Completion length when the request gives none.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling; 1 disables it.")
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Minimum probability relative to the top token.")
    typical_p: float = Field(1.0, gt=0.0, le=1.0, description="Locally typical sampling; 1 disables it.")
    repetition_penalty: float = Field(1.0, gt=0.0, description="Multiplicative penalty on repeated tokens.")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI's, by count of each token.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI's, once per token present.")


class ModelLimits(StrictModel):
    max_concurrent_jobs: int = Field(8, ge=1, description="Jobs sent to the worker at once.")
    max_queued_requests: int = Field(64, ge=0, description="Requests waiting in the gateway beyond that.")
    worker_queued_jobs: int = Field(
        0,
        ge=0,
        description="Remote and cluster workers: jobs a worker holds waiting beyond max_concurrent_jobs "
        "(it enforces both itself, whichever gateways send them; jobs sent by several gateways at once "
        "wait here instead of being refused). Past it the worker refuses: the request tries another "
        "replica, else gets full_queue_status. Read by the worker from its copy of the registry.",
    )
    max_queued_prompt_tokens: int = Field(1_000_000, ge=0, description="Prompt tokens waiting, summed.")
    admission_window_ms: float = Field(
        0.0,
        ge=0.0,
        le=100.0,
        description="A worker with nothing to run that receives a job waits up to this long for more before "
        "its first step, so that requests sent together (a burst) are prefilled together instead of one "
        "step each; it stops waiting once no job has come for a quarter of it. Costs a lone request up to "
        "a quarter of it in time to first token. 0: no wait. Read by the worker (also from its copy of "
        "the registry).",
    )
    burst_gather_ms: float = Field(
        DEFAULT_BURST_GATHER_MS,
        ge=0.0,
        le=1000.0,
        description="A worker with nothing to run that receives a job its gateway sent while still admitting "
        "more requests (for this model, or not yet read far enough to know) waits for them before its first "
        "step, up to this long in all and a quarter of it for each next one, so that a burst is prefilled in "
        "one step. A lone request does not wait. 0: never wait. Read by the worker (also from its copy of "
        "the registry).",
    )
    request_timeout_s: float = Field(600.0, gt=0, description="Deadline for one request, queueing included.")
    full_queue_status: Literal[429, 503] = Field(429, description="HTTP status when the queue is full.")
    priority_aging_s: float = Field(
        10.0,
        gt=0,
        description="A request waiting in the queue moves up one priority class (low, normal, high) for "
        "every this many seconds it has waited, so higher classes go first but never starve lower ones.",
    )
    max_constraint_states: int = Field(
        4096,
        ge=16,
        description="A response_format or regex whose automaton would need more states (estimated from its "
        "repeats) is refused with a 400 at once.",
    )
    max_constraint_compile_s: float = Field(
        5.0,
        gt=0,
        description="A response_format or regex not compiled within this many seconds is refused with a 400; "
        "the worker's other jobs never wait for it.",
    )
    wedge_timeout_s: float = Field(
        120.0,
        gt=0,
        description="Jobs in flight but no generator step for this long: the worker is killed and restarted. "
        "Must exceed the longest legitimate step (one prefill chunk of max_chunk_size tokens).",
    )


class ModelConfig(StrictModel):
    name: ModelName = Field(..., description="What clients send.")
    engine: str = Field(DEFAULT_ENGINE, description="exllamav2 (GPU) or transformers (CPU or GPU).")
    path: Path = Field(
        ...,
        description="Model folder (HF layout), relative to the registry file; or hf://ORG/NAME[@REVISION], "
        "downloaded into server.model_cache_dir before the worker starts.",
    )
    gpus: list[int] = Field(default_factory=list, description="GPU indices; empty means CPU.")
    max_seq_len: int = Field(
        DEFAULT_MAX_SEQ_LEN, ge=16, description="Context length: prompt plus completion."
    )
    replicas: int = Field(1, ge=1, le=64, description="Worker processes serving this model.")
    replica_gpus: list[list[int]] | None = Field(
        None, description="GPU indices per replica, e.g. [[0], [1]]; default: every replica uses gpus."
    )
    aliases: list[ModelName] = Field(default_factory=list, description="Other names clients may send for it.")
    defaults: SamplingDefaults = Field(
        default_factory=SamplingDefaults, description="Sampling defaults; a request's own values win."
    )
    limits: ModelLimits = Field(default_factory=ModelLimits, description="Admission, queue and deadlines.")
    chat_template: str | None = Field(
        None,
        description="Inline Jinja template or a path to a file, overriding the model's own: the folder's "
        "chat_template.jinja (where transformers 5 saves it), else tokenizer_config.json's.",
    )
    remote: bool = Field(False, description="Served only by workers that connect from other hosts.")
    load: Literal["startup", "on_demand"] = Field(
        "startup",
        description="on_demand: loaded at its first request, which waits (within its deadline). In "
        "cluster mode (backend etcd) its listening workers stand by and the leading gateway loads one.",
    )
    idle_unload_s: float | None = Field(
        None,
        gt=0,
        description="Unload after this long without requests (the worker exits, its VRAM is free; in "
        "cluster mode the leading gateway sends the listening worker back to standby).",
    )
    engine_settings: dict[str, Any] = Field(
        default_factory=dict,
        description="The engine's own settings (batch size, cache, ...); its settings model validates them.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables for this model's worker processes (set before the engine loads).",
    )
    exclusive_group: str | None = Field(
        None,
        min_length=1,
        description="Models in one group share GPUs: loading one on demand first drains and unloads the "
        "others (llama-swap's swap). In cluster mode (backend etcd), the others on the same host.",
    )
    task: Literal["generate", "embed"] = Field(
        "generate",
        description="generate: chat and completions. embed: /v1/embeddings only (transformers engine, "
        "a sentence-transformers model folder).",
    )
    tool_call_parser: ToolCallParserName | None = Field(
        None,
        description="How tool calls are read from this model's output (tool_choice auto): hermes, "
        "qwen, llama3_json or mistral. Without one, tool_choice auto is refused.",
    )
    reasoning_parser: ReasoningParserName | None = Field(
        None,
        description="How this model's thinking is split from its answer (<think>...</think>): deepseek_r1 "
        "(the answer starts in thinking) or qwen3 (the same, unless chat_template_kwargs enable_thinking "
        "is false). Without one, the whole output is the answer and reasoning budgets are refused.",
    )
    fallbacks: list[str] = Field(
        default_factory=list,
        description="Models (names or aliases) that answer in this one's place, in order, when its queue is "
        "full or none of its workers is ready; the response's model says which answered. Not followed "
        "further (a fallback's own fallbacks are not tried). Generate models only (embeddings answer "
        "from the named model).",
    )
    # Set from the engine's settings after they are checked (gateway.config.engine_check).
    _weight_dirs: tuple[Path, ...] = PrivateAttr(default=())
    _reserve_vram_gb: float = PrivateAttr(default=0.0)
    # Set when `path` names a Hugging Face repository (gateway.config.hub); `path` is then its folder
    # in the cache.
    _hub: HubRef | None = PrivateAttr(default=None)

    @field_validator("gpus")
    @classmethod
    def _gpus_unique(cls, gpus: list[int]) -> list[int]:
        _check_gpu_indices(gpus)
        return gpus

    @field_validator("replica_gpus")
    @classmethod
    def _replica_gpus_unique(cls, replica_gpus: list[list[int]] | None) -> list[list[int]] | None:
        for gpus in replica_gpus or []:
            _check_gpu_indices(gpus)
        return replica_gpus

    @field_validator("path", mode="before")
    @classmethod
    def _path_given(cls, path: Any) -> Any:
        # An empty string would be the registry's own folder, which is no model.
        if isinstance(path, str) and not path.strip():
            raise ValueError("empty: give the model folder (relative to the registry file) or hf://ORG/NAME")
        return path

    def gpus_of_replica(self, replica: int) -> list[int]:
        return list(self.replica_gpus[replica]) if self.replica_gpus else list(self.gpus)

    @property
    def weight_dirs(self) -> tuple[Path, ...]:
        """Every folder of weights this model loads: its own, then any its engine adds (draft models)."""
        return (self.path, *self._weight_dirs)

    @property
    def reserve_vram_gb(self) -> float:
        return self._reserve_vram_gb

    @property
    def hub(self) -> HubRef | None:
        return self._hub

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not _ENV_NAME.match(name):
                raise ValueError(f"{name!r} is not an environment variable name")
            if name in RESERVED_ENV:
                raise ValueError(f"{name} is set by the gateway for each worker; it cannot be overridden")
        return env

    @model_validator(mode="after")
    def _embedding_engine(self) -> ModelConfig:
        if self.task != "embed":
            return self
        problems: list[tuple[Location, str]] = []
        if self.engine != "transformers":
            problems.append((("engine",), "task embed runs on the transformers engine only"))
        if self.tool_call_parser is not None:
            problems.append((("tool_call_parser",), "an embedding model has no tool_call_parser"))
        if self.reasoning_parser is not None:
            problems.append((("reasoning_parser",), "an embedding model has no reasoning_parser"))
        if problems:
            raise field_errors("ModelConfig", problems)
        return self

    @model_validator(mode="after")
    def _default_fits_the_context(self) -> ModelConfig:
        # The default applies to every request that gives no max_tokens; past the context length
        # each of them would be refused (gateway.http.schemas), though the client asked nothing wrong.
        if self.task == "generate" and self.defaults.max_tokens > self.max_seq_len:
            given = "" if "max_tokens" in self.defaults.model_fields_set else " (the default)"
            raise field_errors(
                "ModelConfig",
                [
                    (
                        ("defaults", "max_tokens"),
                        f"{self.defaults.max_tokens}{given} exceeds max_seq_len {self.max_seq_len}: every "
                        f"request without max_tokens would be refused; set it to at most {self.max_seq_len}",
                    )
                ],
            )
        return self

    @model_validator(mode="after")
    def _replicas_have_gpus(self) -> ModelConfig:
        if self.replica_gpus is not None:
            if len(self.replica_gpus) != self.replicas:
                message = f"replica_gpus needs one GPU list per replica ({self.replicas})"
                raise field_errors("ModelConfig", [(("replica_gpus",), message)])
            if any(not gpus for gpus in self.replica_gpus):
                message = "every replica in replica_gpus needs at least one GPU"
                raise field_errors("ModelConfig", [(("replica_gpus",), message)])
        return self


def _check_gpu_indices(gpus: list[int]) -> None:
    if len(set(gpus)) != len(gpus) or any(g < 0 for g in gpus):
        raise ValueError("GPU indices must be distinct and non-negative")
