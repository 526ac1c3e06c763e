"""A remote worker's spec, read from its own copy of the registry file (models.yaml).

Runs in a remote worker process at start-up (`model-worker --config FILE --model NAME`). Owns the
worker's reading of the registry: only what a worker needs (engine, path, context length, chat
template, heartbeat interval and timeout, the engine's own settings, validated by the engine's settings
model, and the capacity the worker enforces itself: `limits.max_concurrent_jobs` running and
`limits.worker_queued_jobs` waiting). Everything else in the file is the gateway's business; the
gateway validates the whole file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

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


class RemoteSpecError(Exception):
    """The file cannot give this worker a spec; str() names the file, the model and the field."""


def _entry(raw: Any, source: Path, model: str) -> dict[str, Any]:
    models = raw.get("models") if isinstance(raw, dict) else None
    if not isinstance(models, list):
        raise RemoteSpecError(f"{source}: expected a mapping with a 'models' list")
    for entry in models:
        if isinstance(entry, dict) and model in (entry.get("name"), *(entry.get("aliases") or [])):
            if entry.get("remote") is not True:
                raise RemoteSpecError(f"{source}: model {model!r} is not `remote: true`")
            return entry
    raise RemoteSpecError(f"{source}: no model named {model!r}")


def remote_spec(config: str | Path, model: str) -> WorkerSpec:
    source = Path(config)
    try:
        raw = yaml.safe_load(source.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise RemoteSpecError(f"{source}: cannot read: {exc}") from None
    entry = _entry(raw, source, model)
    try:  # ${VAR} as the gateway expands them, from this host's environment
        entry = expand_env(entry, os.environ)
        raw = {**raw, "server": expand_env(raw.get("server") or {}, os.environ)}
    except UnsetVariable as exc:
        field = ".".join(str(p) for p in exc.where)
        raise RemoteSpecError(f"{source}: model {model!r}, field {field!r}: {exc}") from None
    base = source.resolve().parent
    name = str(entry["name"])
    engine = str(entry.get("engine", DEFAULT_ENGINE))
    max_seq_len = int(entry.get("max_seq_len", DEFAULT_MAX_SEQ_LEN))
    request = {"name": name, "engine": engine, "max_seq_len": max_seq_len,
               "engine_settings": entry.get("engine_settings") or {}, "local": False}  # fmt: skip
    _, report = check_model(request, str(base))
    if report["errors"]:
        where = "; ".join(f"field {e['field']!r}: {e['message']}" for e in report["errors"])
        raise RemoteSpecError(f"{source}: model {name!r}, {where}")
    server = raw.get("server") or {}
    template = entry.get("chat_template")
    if isinstance(template, str) and "{" not in template and (base / template).is_file():
        template = str(base / template)
    return WorkerSpec(
        name=name,
        engine=engine,
        path=str((base / str(entry.get("path", ""))).resolve()),
        max_seq_len=max_seq_len,
        engine_settings=report["engine_settings"],
        chat_template=template,
        heartbeat_interval_s=_number(
            server, "heartbeat_interval_s", DEFAULT_HEARTBEAT_INTERVAL_S, f"{source}: server"
        ),
        heartbeat_timeout_s=_number(
            server, "heartbeat_timeout_s", DEFAULT_HEARTBEAT_TIMEOUT_S, f"{source}: server"
        ),
        env={str(k): str(v) for k, v in (entry.get("env") or {}).items()},
        task=str(entry.get("task", "generate")),
        standby=entry.get("load") == "on_demand",
        **_constraint_budgets(entry),
        **_capacity(entry, f"{source}: model {name!r}"),
        admission_window_s=_wait_s(entry, "admission_window_ms", 0.0, 100, f"{source}: model {name!r}"),
        burst_gather_s=_wait_s(
            entry, "burst_gather_ms", DEFAULT_BURST_GATHER_MS, 1000, f"{source}: model {name!r}"
        ),
    )


def _number(section: dict[str, Any], key: str, default: float, where: str) -> float:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise RemoteSpecError(f"{where}, field {key!r}: must be a number above 0, not {value!r}")
    return float(value)


def _capacity(entry: dict[str, Any], where: str) -> dict[str, int]:
    """The jobs this worker runs and holds waiting, whichever gateways send them (model_worker.jobs)."""
    limits = entry.get("limits") or {}
    if not isinstance(limits, dict):
        raise RemoteSpecError(f"{where}, field 'limits': must be a mapping")
    capacity = {}
    for key, field, default, least in (
        ("max_jobs", "max_concurrent_jobs", DEFAULT_MAX_CONCURRENT_JOBS, 1),
        ("max_queue", "worker_queued_jobs", 0, 0),
    ):
        value = limits.get(field, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise RemoteSpecError(
                f"{where}, field 'limits.{field}': must be an integer >= {least}, not {value!r}"
            )
        capacity[key] = value
    return capacity


def _constraint_budgets(entry: dict[str, Any]) -> dict[str, Any]:
    """The entry's limits that the worker enforces itself (the rest are the gateway's)."""
    limits = entry.get("limits") or {}
    budgets = {
        key: limits[key] for key in ("max_constraint_states", "max_constraint_compile_s") if key in limits
    }
    return budgets


def _wait_s(entry: dict[str, Any], field: str, default: float, most: float, where: str) -> float:
    """limits.<field> in ms (admission_window_ms, burst_gather_ms), checked as the gateway's registry
    model checks it, in seconds."""
    value = (entry.get("limits") or {}).get(field, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= most:
        raise RemoteSpecError(f"{where}, field 'limits.{field}': must be a number from 0 to {most}, "
                              f"not {value!r}")  # fmt: skip
    return float(value) / 1000
