"""The model registry (config/models.yaml): schema, loading and error reporting.

Runs in the gateway process (and in `gateway check-config`). Owns the pydantic models of the
registry's gateway-level fields. Each model's `engine_settings` belong to its engine: the engine's
own settings model validates them (gateway.config.engine_check asks the worker package, in a
short-lived process, so the gateway never imports it). Configs are frozen once loaded; unknown
keys are errors; every error names the file, the model and the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from wire.params import DEFAULT_ENGINE, DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_MAX_SEQ_LEN, WorkerSpec

# Tool-call output formats the gateway can read (gateway.tools.parsers implements each).
ToolCallParserName = Literal["hermes", "qwen", "llama3_json", "mistral"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplingDefaults(_Strict):
    """Per-model defaults; a request's own values override them."""

    max_tokens: int = Field(512, ge=1, description="Completion length when the request gives none.")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    typical_p: float = Field(1.0, gt=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)


class ModelLimits(_Strict):
    max_concurrent_jobs: int = Field(8, ge=1, description="Jobs sent to the worker at once.")
    max_queued_requests: int = Field(64, ge=0, description="Requests waiting in the gateway beyond that.")
    max_queued_prompt_tokens: int = Field(1_000_000, ge=0, description="Prompt tokens waiting, summed.")
    request_timeout_s: float = Field(600.0, gt=0, description="Deadline for one request, queueing included.")
    full_queue_status: Literal[429, 503] = Field(429, description="HTTP status when the queue is full.")
    wedge_timeout_s: float = Field(
        120.0,
        gt=0,
        description="Jobs in flight but no generator step for this long: the worker is killed and restarted. "
        "Must exceed the longest legitimate step (one prefill chunk of max_chunk_size tokens).",
    )


class ModelConfig(_Strict):
    name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9._:/-]+$", description="What clients send.")
    engine: str = Field(DEFAULT_ENGINE, description="exllamav2 (GPU) or transformers (CPU or GPU).")
    path: Path = Field(..., description="Model folder (HF layout); relative to the registry file.")
    gpus: list[int] = Field(default_factory=list, description="GPU indices; empty means CPU.")
    max_seq_len: int = Field(DEFAULT_MAX_SEQ_LEN, ge=16)
    replicas: int = Field(1, ge=1, le=64, description="Worker processes serving this model.")
    replica_gpus: list[list[int]] | None = Field(
        None, description="GPU indices per replica, e.g. [[0], [1]]; default: every replica uses gpus."
    )
    aliases: list[str] = Field(default_factory=list)
    defaults: SamplingDefaults = Field(default_factory=SamplingDefaults)
    limits: ModelLimits = Field(default_factory=ModelLimits)
    chat_template: str | None = Field(None, description="Inline Jinja template or a path to a file.")
    remote: bool = Field(False, description="Served only by workers that connect from other hosts.")
    load: Literal["startup", "on_demand"] = Field(
        "startup", description="on_demand: loaded at its first request, which waits (within its deadline)."
    )
    idle_unload_s: float | None = Field(
        None,
        gt=0,
        description="Unload after this long without requests (the worker exits, its VRAM is free).",
    )
    engine_settings: dict[str, Any] = Field(
        default_factory=dict,
        description="The engine's own settings (batch size, cache, ...); its settings model validates them.",
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
    # Set from the engine's settings after they are checked (gateway.config.engine_check).
    _weight_dirs: tuple[Path, ...] = PrivateAttr(default=())
    _reserve_vram_gb: float = PrivateAttr(default=0.0)

    @field_validator("gpus")
    @classmethod
    def _gpus_unique(cls, gpus: list[int]) -> list[int]:
        if len(set(gpus)) != len(gpus) or any(g < 0 for g in gpus):
            raise ValueError("GPU indices must be distinct and non-negative")
        return gpus

    def gpus_of_replica(self, replica: int) -> list[int]:
        return list(self.replica_gpus[replica]) if self.replica_gpus else list(self.gpus)

    @property
    def weight_dirs(self) -> tuple[Path, ...]:
        """Every folder of weights this model loads: its own, then any its engine adds (draft models)."""
        return (self.path, *self._weight_dirs)

    @property
    def reserve_vram_gb(self) -> float:
        return self._reserve_vram_gb

    @model_validator(mode="after")
    def _embedding_engine(self) -> ModelConfig:
        if self.task == "embed" and self.engine != "transformers":
            raise ValueError("task embed runs on the transformers engine only")
        if self.task == "embed" and self.tool_call_parser is not None:
            raise ValueError("an embedding model has no tool_call_parser")
        return self

    @model_validator(mode="after")
    def _replicas_have_gpus(self) -> ModelConfig:
        if self.replica_gpus is not None:
            if len(self.replica_gpus) != self.replicas:
                raise ValueError(f"replica_gpus needs one GPU list per replica ({self.replicas})")
            if any(not gpus for gpus in self.replica_gpus):
                raise ValueError("every replica in replica_gpus needs at least one GPU")
        return self


class RemoteWorkersConfig(_Strict):
    """A tcp listener for workers on other hosts; CURVE-encrypted, and only for known worker keys."""

    bind: str = Field(..., pattern=r"^tcp://", description="e.g. tcp://0.0.0.0:5555")
    secret_key_file: Path = Field(..., description="The gateway's CURVE secret key (`gateway keys`).")
    authorized_keys_dir: Path = Field(..., description="Public keys of the workers allowed to connect.")


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    runtime_dir: Path | None = Field(None, description="Where ipc sockets live; default a private temp dir.")
    remote_workers: RemoteWorkersConfig | None = Field(None, description="Accept workers from other hosts.")
    api_keys_file: Path | None = Field(
        None,
        description="YAML file of API keys (gateway/api_keys.py shows the format), relative to the registry "
        "file; re-read when it changes. With no keys here nor in GATEWAY_API_KEYS / GATEWAY_ADMIN_KEYS, "
        "the gateway serves without auth and only on a loopback address.",
    )
    worker_start_timeout_s: float = Field(600.0, gt=0, description="Load plus warm-up deadline per worker.")
    heartbeat_interval_s: float = Field(DEFAULT_HEARTBEAT_INTERVAL_S, gt=0)
    heartbeat_timeout_s: float = Field(30.0, gt=0, description="No frame for this long: worker lost.")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    shutdown_grace_s: float = Field(10.0, ge=0)
    sse_keepalive_s: float = Field(15.0, gt=0, description="SSE comment ping while a stream waits.")
    restart_backoff_s: float = Field(1.0, gt=0, description="First restart delay; doubles per failed start.")
    restart_backoff_max_s: float = Field(30.0, gt=0)
    restart_limit: int = Field(
        5, ge=1, description="Failed starts in a row before a worker is marked failed."
    )
    write_stall_timeout_s: float = Field(
        30.0, gt=0, description="A streaming client that reads nothing for this long is dropped."
    )


class Registry(_Strict):
    server: ServerConfig = Field(default_factory=ServerConfig)
    models: list[ModelConfig] = Field(..., min_length=1)
    source: Path | None = Field(None, exclude=True)

    @model_validator(mode="after")
    def _names_unique(self) -> Registry:
        seen: dict[str, str] = {}
        for model in self.models:
            for name in (model.name, *model.aliases):
                if name in seen:
                    raise ValueError(
                        f"name {name!r} of model {model.name!r} is already used by {seen[name]!r}"
                    )
                seen[name] = model.name
        return self

    @model_validator(mode="after")
    def _remote_needs_listener(self) -> Registry:
        remote = [m.name for m in self.models if m.remote]
        if remote and self.server.remote_workers is None:
            raise ValueError(f"models {remote} are remote, but server.remote_workers is not configured")
        return self

    def model(self, name: str) -> ModelConfig | None:
        for model in self.models:
            if name == model.name or name in model.aliases:
                return model
        return None


class ConfigError(Exception):
    """A registry that cannot be used; str() is the message shown to the operator."""


def _describe(error: Any, raw: Any) -> str:
    loc = list(error["loc"])
    where = []
    if len(loc) >= 2 and loc[0] == "models" and isinstance(loc[1], int):
        entry = raw["models"][loc[1]] if isinstance(raw, dict) else None
        name = entry.get("name") if isinstance(entry, dict) else None
        where.append(f"model {name!r}" if name else f"model #{loc[1] + 1}")
        loc = loc[2:]
    elif loc and loc[0] == "server":
        where.append("server")
        loc = loc[1:]
    if loc:
        where.append("field " + repr(".".join(str(p) for p in loc)))
    message = error["msg"].removeprefix("Value error, ")
    return f"{', '.join(where) or 'registry'}: {message}"


def _resolve_template(template: str | None, base: Path) -> str | None:
    """A chat_template that names a file is relative to the registry file; inline Jinja has braces."""
    if template is None or "{" in template:
        return template
    candidate = (base / template).resolve()
    return str(candidate) if candidate.is_file() else template


def parse_registry(raw: Any, source: Path, check_engines: bool = True) -> Registry:
    """Validate already-parsed YAML; relative paths resolve against the file's folder. With
    `check_engines`, each model's engine_settings are validated by its engine's settings model."""
    from gateway.config.engine_check import apply_engine_checks

    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping with 'models' at the top level")
    try:
        registry = Registry.model_validate({**raw, "source": source})
    except ValidationError as exc:
        lines = [f"{source}: {_describe(e, raw)}" for e in exc.errors()]
        raise ConfigError("\n".join(lines)) from None
    base = source.parent
    models = [
        m.model_copy(
            update={
                "path": (base / m.path).resolve(),
                "chat_template": _resolve_template(m.chat_template, base),
            }
        )
        for m in registry.models
    ]
    server = registry.server
    if server.remote_workers is not None:
        remote = server.remote_workers
        resolved = remote.model_copy(
            update={
                "secret_key_file": (base / remote.secret_key_file).resolve(),
                "authorized_keys_dir": (base / remote.authorized_keys_dir).resolve(),
            }
        )
        server = server.model_copy(update={"remote_workers": resolved})
    if check_engines:
        models = apply_engine_checks(models, source)
    return registry.model_copy(update={"models": models, "server": server})


def worker_spec(model: ModelConfig, heartbeat_interval_s: float) -> WorkerSpec:
    """What a spawned worker needs to run this model (remote workers build theirs from the file)."""
    return WorkerSpec(
        name=model.name,
        engine=model.engine,
        path=str(model.path),
        max_seq_len=model.max_seq_len,
        engine_settings=dict(model.engine_settings),
        chat_template=model.chat_template,
        heartbeat_interval_s=heartbeat_interval_s,
        task=model.task,
    )


def load_registry(path: str | Path) -> Registry:
    source = Path(path)
    try:
        text = source.read_text()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{source}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    return parse_registry(raw, source)
