"""The model registry (config/models.yaml): its top level, loading and error reporting.

Runs in the gateway process (and in `gateway check-config`). Owns `Registry`, the whole file: the
`server` section (gateway.config.server_config) and the `models` list (gateway.config.models),
with the checks across models; and the loading: YAML, `${VAR}` expansion, paths resolved against
the file's folder, hf:// references, and `ConfigError`. Each model's `engine_settings` belong to
its engine: the engine's own settings model validates them (gateway.config.engine_check asks the
worker package, in a short-lived process, so the gateway never imports it). Configs are frozen
once loaded; unknown keys are errors; every error names the file, the model and the field.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from gateway.cluster.settings import ClusterConfig
from gateway.config.hub import HUB_SCHEME, HubRef, parse_hub_path
from gateway.config.models import ModelConfig
from gateway.config.server_config import ServerConfig
from gateway.config.strict_model import Location, StrictModel, field_errors
from wire.env_expand import UnsetVariable, expand_env
from wire.params import WorkerSpec
from wire.yaml_file import YamlFileError, read_yaml_file

DEFAULT_MODEL_CACHE = Path("~/.cache/llm-gateway/models")


class Registry(StrictModel):
    server: ServerConfig = Field(default_factory=ServerConfig)
    models: list[ModelConfig] = Field(..., min_length=1)
    source: Path | None = Field(None, exclude=True)

    @model_validator(mode="after")
    def _names_unique(self) -> Registry:
        owner: dict[str, int] = {}  # each name or alias -> the index of the model it names
        problems: list[tuple[Location, str]] = []
        for index, model in enumerate(self.models):
            names: list[tuple[Location, str]] = [(("name",), model.name)]
            names += [(("aliases", n), alias) for n, alias in enumerate(model.aliases)]
            for field, name in names:
                first = owner.get(name)
                if first is None:
                    owner[name] = index
                    continue
                other = f"model #{first + 1} ({self.models[first].name!r})"
                whose = "this model" if first == index else other
                problems.append((("models", index, *field), f"{name!r} already names {whose}"))
        if problems:
            raise field_errors("Registry", problems)
        return self

    @model_validator(mode="after")
    def _remote_needs_listener(self) -> Registry:
        problems: list[tuple[Location, str]] = []
        if self.server.remote_workers is None and self.server.cluster is None:
            problems += [
                (
                    ("models", index, "remote"),
                    "a remote model needs server.remote_workers or server.cluster, where its workers "
                    "connect, and neither is configured",
                )
                for index, model in enumerate(self.models)
                if model.remote
            ]
        cluster = self.server.cluster
        if cluster is not None:
            if cluster.secret_key_file is None:
                problems.append(
                    (
                        ("server", "cluster", "secret_key_file"),
                        "required (the gateway's CURVE key: gateway keys)",
                    )
                )
            if cluster.backend == "kubernetes" and cluster.worker_public_key_file is None:
                problems.append(
                    (
                        ("server", "cluster", "worker_public_key_file"),
                        "required with backend: kubernetes (EndpointSlices carry no key)",
                    )
                )
            for number, worker in enumerate(cluster.workers):
                model = self.model(worker.model)
                if model is None or not model.remote or worker.worker_id.split("@", 1)[0] != model.name:
                    problems.append(
                        (
                            ("server", "cluster", "workers", number),
                            f"{worker.worker_id!r} must be MODEL@NAME of a `remote: true` model, and "
                            f"model {worker.model!r} must be that model",
                        )
                    )
        if problems:
            raise field_errors("Registry", problems)
        return self

    @model_validator(mode="after")
    def _groups_start_one(self) -> Registry:
        problems: list[tuple[Location, str]] = []
        starters: dict[str, list[str]] = {}
        for index, model in enumerate(self.models):
            if model.exclusive_group is not None and model.remote and self.server.cluster is None:
                # In cluster mode on etcd the leader swaps listening workers (gateway.workers.cluster_loads).
                message = "this model is remote; exclusive groups are for local models"
                problems.append((("models", index, "exclusive_group"), message))
            if model.exclusive_group is not None and model.load == "startup":
                starters.setdefault(model.exclusive_group, []).append(model.name)
                if len(starters[model.exclusive_group]) > 1:
                    problems.append(
                        (
                            ("models", index, "load"),
                            f"exclusive_group {model.exclusive_group!r}: models "
                            f"{starters[model.exclusive_group]} are all `load: startup`, but only one model "
                            "of a group runs at a time; make the others `load: on_demand`",
                        )
                    )
        if problems:
            raise field_errors("Registry", problems)
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
        models = raw.get("models") if isinstance(raw, dict) else None
        entry = models[loc[1]] if isinstance(models, list) and loc[1] < len(models) else None
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
    """A chat_template that names a file is relative to the registry file; inline Jinja has braces.
    ValueError when it has none and names no file: the worker would take the text itself for the
    template, and every prompt would be that text."""
    if template is None or "{" in template:
        return template
    if not template.strip():
        raise ValueError("empty: leave chat_template out to use the model's own template")
    candidate = (base / template).resolve()
    try:
        if candidate.is_file():
            return str(candidate)
        why = "is not a file"
    except OSError as exc:  # a name too long, a folder not readable
        why = f"cannot be read ({exc.strerror})"
    raise ValueError(
        f"{candidate} {why}; a template file is relative to the registry file, and an inline template "
        "has Jinja tags ({{ }} or {% %})"
    )


def _template_of(model: ModelConfig, base: Path, source: Path) -> str | None:
    try:
        return _resolve_template(model.chat_template, base)
    except ValueError as exc:
        if model.remote:  # its workers resolve it against their own copy of the file
            return model.chat_template
        raise ConfigError(f"{source}: model {model.name!r}, field 'chat_template': {exc}") from None


def _where(raw: Any, location: tuple[str | int, ...]) -> str:
    """`model 'name', field 'a.b'` for a location in the raw file, as pydantic errors are described."""
    return _describe({"loc": location, "msg": ""}, raw).removesuffix(": ")


def expand_registry_env(raw: Any, source: Path, environ: Mapping[str, str]) -> Any:
    """`${VAR}` / `${VAR:-default}` in every string of the file; an unset one names where it is."""
    try:
        return expand_env(raw, environ)
    except UnsetVariable as exc:
        raise ConfigError(f"{source}: {_where(raw, exc.where)}: {exc}") from None


def _hub_refs(raw: Any, registry: Registry, source: Path) -> list[HubRef | None]:
    """The hf:// reference of each model's `path`, read from the raw text (a Path would mangle it)."""
    refs: list[HubRef | None] = []
    errors = []
    for index, model in enumerate(registry.models):
        text = str(raw["models"][index].get("path", ""))
        if not text.startswith(HUB_SCHEME):
            refs.append(None)
            continue
        try:
            ref = parse_hub_path(text)
        except ValueError as exc:
            errors.append(f"{source}: model {model.name!r}, field 'path': {exc}")
            continue
        if model.remote:
            errors.append(
                f"{source}: model {model.name!r}, field 'path': hf:// paths are for local models; a remote "
                "worker's host needs the model folder itself"
            )
        refs.append(ref)
    if errors:
        raise ConfigError("\n".join(errors))
    return refs


# Decided by the leading gateway, which loads and unloads standby workers: only etcd has that part.
LEADER_LOADS = ("load", "idle_unload_s", "exclusive_group")


def _check_cluster_models(registry: Registry, source: Path) -> None:
    """Cluster mode: a gateway spawns no worker (each would spawn its own, and a model would load
    once per gateway); every model is served by listening workers (gateway.cluster.decisions).
    Loads on demand, idle unloads and exclusive groups are the etcd leader's to decide
    (gateway.workers.cluster_loads); with another backend they are refused."""
    cluster = registry.server.cluster
    if cluster is None:
        return
    local = [m.name for m in registry.models if not m.remote]
    if local:
        raise ConfigError(
            "\n".join(
                f"{source}: model {name!r}, field 'remote': in cluster mode (server.cluster.backend: "
                f"{cluster.backend}) gateways spawn no worker, so that no model is loaded twice by two "
                "gateways: set `remote: true` and run its workers with `model-worker --listen`"
                for name in local
            )
        )
    if cluster.backend != "etcd":
        errors = [
            f"{source}: model {model.name!r}, field {field!r}: in cluster mode only backend etcd loads "
            f"and unloads listening workers' models (server.cluster.backend is {cluster.backend}); "
            "remove the field and run the workers loaded"
            for model in registry.models
            for field in LEADER_LOADS
            if model.remote and getattr(model, field) not in (None, "startup")
        ]
        if errors:
            raise ConfigError("\n".join(errors))
        return
    # After an idle unload or a swap the worker stands by; only a request loads it again.
    stuck = [
        f"{source}: model {model.name!r}, field 'load': in cluster mode a model with {field} must be "
        "`load: on_demand` (its worker stands by after an unload, and only a request loads it again)"
        for model in registry.models
        for field in ("idle_unload_s", "exclusive_group")
        if model.remote and getattr(model, field) is not None and model.load != "on_demand"
    ]
    if stuck:
        raise ConfigError("\n".join(stuck))


def _check_fallbacks(registry: Registry, source: Path) -> None:
    """Each fallback names another model of the same task; only generate models have fallbacks."""
    errors = []
    for model in registry.models:
        if model.fallbacks and model.task != "generate":
            # The embeddings route answers from the named model only: a fallback there would never act.
            errors.append(
                f"{source}: model {model.name!r}, field 'fallbacks': fallbacks apply to generate models; "
                f"this model has task {model.task}"
            )
            continue
        for name in model.fallbacks:
            other = registry.model(name)
            where = f"{source}: model {model.name!r}, field 'fallbacks'"
            if other is None:
                errors.append(f"{where}: {name!r} is not a model of this registry")
            elif other.name == model.name:
                errors.append(f"{where}: {name!r} is this model itself")
            elif other.task != model.task:
                errors.append(f"{where}: {name!r} has task {other.task}, this model has task {model.task}")
    if errors:
        raise ConfigError("\n".join(errors))


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
    _check_fallbacks(registry, source)
    _check_cluster_models(registry, source)
    base = source.parent
    cache = registry.server.model_cache_dir
    cache_dir = (base / cache).resolve() if cache is not None else DEFAULT_MODEL_CACHE.expanduser()
    models = []
    for model, hub in zip(registry.models, _hub_refs(raw, registry, source), strict=True):
        path = hub.folder(cache_dir) if hub is not None else (base / model.path).resolve()
        copy = model.model_copy(update={"path": path, "chat_template": _template_of(model, base, source)})
        copy._hub = hub
        models.append(copy)
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
    if server.cluster is not None:
        server = server.model_copy(update={"cluster": _resolve_cluster(server.cluster, base)})
    server = server.model_copy(update={"model_cache_dir": cache_dir})
    if check_engines:
        models = apply_engine_checks(models, source)
    return registry.model_copy(update={"models": models, "server": server})


def _resolve_cluster(cluster: ClusterConfig, base: Path) -> ClusterConfig:
    """The cluster section's key files, relative to the registry file."""

    def resolved(path: Path | None) -> Path | None:
        return (base / path).resolve() if path is not None else None

    workers = [w.model_copy(update={"public_key_file": resolved(w.public_key_file)}) for w in cluster.workers]
    return cluster.model_copy(
        update={
            "secret_key_file": resolved(cluster.secret_key_file),
            "worker_public_key_file": resolved(cluster.worker_public_key_file),
            "workers": workers,
        }
    )


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
        env=dict(model.env),
        task=model.task,
        max_constraint_states=model.limits.max_constraint_states,
        max_constraint_compile_s=model.limits.max_constraint_compile_s,
        admission_window_s=model.limits.admission_window_ms / 1000,
        burst_gather_s=model.limits.burst_gather_ms / 1000,
    )


def load_registry(path: str | Path, environ: Mapping[str, str] | None = None) -> Registry:
    source = Path(path)
    try:
        raw = read_yaml_file(source, _where)
    except YamlFileError as exc:
        raise ConfigError(str(exc)) from None
    raw = expand_registry_env(raw, source, os.environ if environ is None else environ)
    return parse_registry(raw, source)
