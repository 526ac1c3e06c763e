"""Where a listening worker registers: the registry file's `server.cluster.etcd`, read and checked.

Runs in a worker process started with `model-worker --listen`, before its model loads. Owns nothing
but the reading: it needs no etcd client, so a worker whose registry says another backend (or
none) never imports one (model_worker.registration holds the client).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wire.env_expand import UnsetVariable, expand_env
from wire.yaml_file import YamlFileError, read_yaml_file


@dataclass(frozen=True)
class EtcdTarget:
    """The registry file's `server.cluster.etcd`, as much of it as a worker uses."""

    endpoints: list[str]
    prefix: str = "/llm-gateway/"
    ttl_s: int = 10
    request_timeout_s: float = 1.0
    retry_interval_s: float = 1.0


class RegistrationConfigError(Exception):
    """str() names the file and the field."""


def etcd_target(config: str | Path) -> EtcdTarget | None:
    """The etcd this worker registers in: the registry's `server.cluster.etcd` when
    `server.cluster.backend` is etcd, else None. The gateway validates the whole section; here only
    what the worker reads is checked, and an error names the file and the field."""
    source = Path(config)
    try:
        raw = read_yaml_file(source)
    except YamlFileError as exc:
        raise RegistrationConfigError(str(exc)) from None
    if not isinstance(raw, dict):
        raise RegistrationConfigError(f"{source}: expected a mapping with a 'models' list")
    try:
        server = expand_env(raw.get("server") or {}, os.environ)
    except UnsetVariable as exc:
        field = ".".join(str(p) for p in exc.where)
        raise RegistrationConfigError(f"{source}: field 'server.{field}': {exc}") from None
    cluster = server.get("cluster") if isinstance(server, dict) else None
    if not isinstance(cluster, dict) or cluster.get("backend") != "etcd":
        return None
    etcd = cluster.get("etcd")
    where = f"{source}: field 'server.cluster.etcd"
    if not isinstance(etcd, dict):
        raise RegistrationConfigError(f"{where}': backend etcd needs this section (at least endpoints)")
    endpoints = etcd.get("endpoints")
    if not isinstance(endpoints, list) or not endpoints or not all(isinstance(e, str) for e in endpoints):
        raise RegistrationConfigError(f"{where}.endpoints': must be a list of host:port, not {endpoints!r}")
    values: dict[str, Any] = {"endpoints": endpoints}
    for key, name, kind in (
        ("prefix", "prefix", str),
        ("ttl_s", "worker_ttl_s", int),
        ("request_timeout_s", "request_timeout_s", (int, float)),
        ("retry_interval_s", "retry_interval_s", (int, float)),
    ):
        if name in etcd:
            value = etcd[name]
            positive = isinstance(value, str) or (isinstance(value, (int, float)) and value > 0)
            if isinstance(value, bool) or not isinstance(value, kind) or not positive:
                raise RegistrationConfigError(f"{where}.{name}': not a valid value: {value!r}")
            values[key] = value
    return EtcdTarget(**values)
