"""A remote worker's spec, read from its own copy of the registry file (models.yaml).

Runs in a remote worker process at start-up (`model-worker --config FILE --model NAME`). Owns the
worker's reading of the registry: only what a worker needs (engine, path, context length, chat
template, heartbeat interval and timeout, the engine's own settings, validated by the engine's settings
model, and the capacity the worker enforces itself: `limits.max_concurrent_jobs` running and
`limits.worker_queued_jobs` waiting). Everything else in the file is the gateway's business; the
gateway validates the whole file. The fields read here are checked by type and range as the gateway
checks them (msgspec): `true` is not a number, a list is not a path; a string that holds a number is
one, since `${VAR}` expands to text. A file the gateway would refuse never starts a worker with a
guessed value.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from model_worker.settings_check import check_model
from wire.env_expand import UnsetVariable, expand_env
from wire.params import (
    DEFAULT_BURST_GATHER_MS,
    DEFAULT_ENGINE,
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_MAX_CONCURRENT_JOBS,
    DEFAULT_MAX_SEQ_LEN,
    WorkerSpec,
)
from wire.yaml_file import YamlFileError, read_yaml_file

MAX_INT = 2**31 - 1  # as the gateway's registry (gateway.config.strict_model)
MAX_SECONDS = 1e9  # finite: .inf is no duration

Seconds = Annotated[float, msgspec.Meta(gt=0, le=MAX_SECONDS)]


class RemoteSpecError(Exception):
    """The file cannot give this worker a spec; str() names the file, the model and the field."""


class _Limits(msgspec.Struct):
    """The entry's `limits` that the worker enforces itself (the rest are the gateway's)."""

    max_concurrent_jobs: Annotated[int, msgspec.Meta(ge=1, le=MAX_INT)] = DEFAULT_MAX_CONCURRENT_JOBS
    worker_queued_jobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)] = 0
    max_constraint_states: Annotated[int, msgspec.Meta(ge=16, le=MAX_INT)] = 4096
    max_constraint_compile_s: Seconds = 5.0
    admission_window_ms: Annotated[float, msgspec.Meta(ge=0, le=100)] = 0.0
    burst_gather_ms: Annotated[float, msgspec.Meta(ge=0, le=1000)] = DEFAULT_BURST_GATHER_MS


class _Entry(msgspec.Struct):
    """One model of the file, as much of it as a worker reads."""

    name: str
    remote: bool = False
    aliases: list[str] = []
    engine: str = DEFAULT_ENGINE
    path: str = ""
    max_seq_len: Annotated[int, msgspec.Meta(ge=16, le=MAX_INT)] = DEFAULT_MAX_SEQ_LEN
    engine_settings: dict[str, Any] = {}
    chat_template: str | None = None
    env: dict[str, str] = {}
    task: Literal["generate", "embed"] = "generate"
    load: Literal["startup", "on_demand"] = "startup"
    limits: _Limits = msgspec.field(default_factory=_Limits)


class _Server(msgspec.Struct):
    heartbeat_interval_s: Seconds = DEFAULT_HEARTBEAT_INTERVAL_S
    heartbeat_timeout_s: Seconds = DEFAULT_HEARTBEAT_TIMEOUT_S


def _field(error: msgspec.ValidationError) -> tuple[str, str]:
    """msgspec's `Expected int, got str - at $.limits.max_concurrent_jobs` as ('limits.max_...', text)."""
    message, _, where = str(error).replace("`", "").rpartition(" - at $")
    if not message:
        return "", where
    return re.sub(r"\[(\d+)\]", r".\1", where.lstrip(".")).replace("[...]", ""), message


def _entry(raw: Any, source: Path, model: str) -> tuple[int, dict[str, Any]]:
    models = raw.get("models") if isinstance(raw, dict) else None
    if not isinstance(models, list):
        raise RemoteSpecError(f"{source}: expected a mapping with a 'models' list")
    for index, entry in enumerate(models):
        if not isinstance(entry, dict):
            raise RemoteSpecError(f"{source}: field 'models.{index}': must be a mapping, not {entry!r}")
        names = [entry.get("name"), *(entry.get("aliases") or [])]
        if model in names:
            if entry.get("remote") is not True:
                raise RemoteSpecError(f"{source}: model {model!r} is not `remote: true`")
            return index, entry
    raise RemoteSpecError(f"{source}: no model named {model!r}")


def _convert(value: Any, kind: type[Any], where: str) -> Any:
    """`value` as `kind`; a RemoteSpecError naming `where` (the file, and the model or section) and
    the field."""
    try:
        return msgspec.convert(value, kind, strict=False)
    except msgspec.ValidationError as exc:
        field, message = _field(exc)
        raise RemoteSpecError(
            f"{where}, field {field!r}: {message}" if field else f"{where}: {message}"
        ) from None


def remote_spec(config: str | Path, model: str) -> WorkerSpec:
    source = Path(config)
    try:  # within the bounds the gateway reads the same file in (wire.yaml_file)
        raw = read_yaml_file(source)
    except YamlFileError as exc:
        raise RemoteSpecError(str(exc)) from None
    index, raw_entry = _entry(raw, source, model)
    named = f"{source}: model {str(raw_entry.get('name', index))!r}"
    try:  # ${VAR} as the gateway expands them, from this host's environment
        raw_entry = expand_env(raw_entry, os.environ)
        raw_server = expand_env(raw.get("server") or {}, os.environ)
    except UnsetVariable as exc:
        field = ".".join(str(p) for p in exc.where)
        raise RemoteSpecError(f"{named}, field {field!r}: {exc}") from None
    entry: _Entry = _convert(raw_entry, _Entry, named)
    server: _Server = _convert(raw_server, _Server, f"{source}: server")
    if server.heartbeat_timeout_s <= server.heartbeat_interval_s:
        raise RemoteSpecError(
            f"{source}: server, field 'heartbeat_timeout_s': {server.heartbeat_timeout_s} must exceed "
            f"heartbeat_interval_s ({server.heartbeat_interval_s})"
        )
    base = source.resolve().parent
    request = {"name": entry.name, "engine": entry.engine, "max_seq_len": entry.max_seq_len,
               "engine_settings": entry.engine_settings, "local": False}  # fmt: skip
    _, report = check_model(request, str(base))
    if report["errors"]:
        where = "; ".join(f"field {e['field']!r}: {e['message']}" for e in report["errors"])
        raise RemoteSpecError(f"{source}: model {entry.name!r}, {where}")
    template = entry.chat_template
    if template is not None and "{" not in template and (base / template).is_file():
        template = str(base / template)
    limits = entry.limits
    return WorkerSpec(
        name=entry.name,
        engine=entry.engine,
        path=str((base / entry.path).resolve()),
        max_seq_len=entry.max_seq_len,
        engine_settings=report["engine_settings"],
        chat_template=template,
        heartbeat_interval_s=server.heartbeat_interval_s,
        heartbeat_timeout_s=server.heartbeat_timeout_s,
        env=entry.env,
        task=entry.task,
        standby=entry.load == "on_demand",
        max_constraint_states=limits.max_constraint_states,
        max_constraint_compile_s=limits.max_constraint_compile_s,
        max_jobs=limits.max_concurrent_jobs,
        max_queue=limits.worker_queued_jobs,
        admission_window_s=limits.admission_window_ms / 1000,
        burst_gather_s=limits.burst_gather_ms / 1000,
    )
