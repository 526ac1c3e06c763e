"""A remote worker's spec, read from its own copy of the registry file (models.yaml).

Runs in a remote worker process at start-up (`model-worker --config FILE --model NAME`). Owns the
worker's reading of the registry: only what a worker needs (engine, path, context length, chat
template, heartbeat interval and the engine's own settings, validated by the engine's settings
model). Everything else in the file is the gateway's business; the gateway validates the whole file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from model_worker.settings_check import check_model
from wire.env_expand import UnsetVariable, expand_env
from wire.params import DEFAULT_ENGINE, DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_MAX_SEQ_LEN, WorkerSpec


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
        heartbeat_interval_s=float(server.get("heartbeat_interval_s", DEFAULT_HEARTBEAT_INTERVAL_S)),
        env={str(k): str(v) for k, v in (entry.get("env") or {}).items()},
        task=str(entry.get("task", "generate")),
        **_constraint_budgets(entry),
    )


def _constraint_budgets(entry: dict[str, Any]) -> dict[str, Any]:
    """The entry's limits that the worker enforces itself (the rest are the gateway's)."""
    limits = entry.get("limits") or {}
    budgets = {
        key: limits[key] for key in ("max_constraint_states", "max_constraint_compile_s") if key in limits
    }
    return budgets
