"""The registry's `server` section (config/models.yaml): its schema.

Runs in the gateway process (and in `gateway check-config`). Owns `ServerConfig`, the settings of
the gateway as a whole, with its listener for workers on other hosts (`RemoteWorkersConfig`) and
the Responses API's store (`ResponseStoreConfig`); the `cluster` section is
gateway.cluster.settings'. Relative paths stay as written here: gateway.config.registry resolves
them against the registry file when it loads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from gateway.cluster.settings import ClusterConfig
from gateway.config.strict_model import Location, StrictModel, field_errors
from wire.params import DEFAULT_HEARTBEAT_INTERVAL_S

# ZeroMQ's ipc:// paths are at most 107 bytes (a unix socket's sun_path), and the gateway's socket
# file name (gateway.core) is added to runtime_dir: leave it room.
MAX_RUNTIME_DIR_BYTES = 90


class RemoteWorkersConfig(StrictModel):
    """A tcp listener for workers on other hosts; CURVE-encrypted, and only for known worker keys."""

    bind: str = Field(..., pattern=r"^tcp://", description="e.g. tcp://0.0.0.0:5555")
    secret_key_file: Path = Field(..., description="The gateway's CURVE secret key (`gateway keys`).")
    authorized_keys_dir: Path = Field(
        ...,
        description="Public keys of the workers allowed to connect, each naming the models it may serve "
        "(`gateway keys DIR --name NAME --models A,B`); re-read when it changes.",
    )
    handshake_timeout_s: float = Field(
        5.0, gt=0, description="A connection without a finished CURVE handshake by then is dropped."
    )
    max_connections: int = Field(
        256, ge=1, description="Open tcp connections at most; beyond it the listener stops accepting."
    )
    max_workers: int = Field(64, ge=1, description="Remote workers known at once, in all.")
    max_workers_per_key: int = Field(8, ge=1, description="Remote workers known at once with one key.")
    forget_lost_after_s: float = Field(
        600.0, gt=0, description="A remote worker lost for this long is forgotten (its entry removed)."
    )


class ResponseStoreConfig(StrictModel):
    """Where the Responses API keeps responses stored with `store: true` (and for how long)."""

    backend: Literal["auto", "sqlite", "redis", "none"] = Field(
        "auto",
        description="auto: redis when `server.redis_url` is set, else sqlite. sqlite: a file on this host "
        "(each gateway has its own). redis: the Redis of `server.redis_url`, shared by every gateway "
        "using it, so a response stored through one gateway is fetched, continued or deleted through "
        "any (while Redis cannot be reached, requests that store, fetch, continue or delete a response "
        "are a 503; others go on). none: nothing is stored (store: true is a 400).",
    )
    path: Path = Field(
        Path("~/.local/share/llm-gateway/responses.sqlite3"),
        description="The SQLite file, relative to the registry file; created at the first stored response "
        "(sqlite only).",
    )
    retention_s: float = Field(
        30 * 86400.0,
        gt=0,
        description="A stored response is deleted this long after it was created (in Redis, by key expiry).",
    )
    store_by_default: bool = Field(
        False,
        description="What a request that leaves `store` out gets (OpenAI's default is true: set this for "
        "clients that rely on it).",
    )


class ServerConfig(StrictModel):
    host: str = Field("127.0.0.1", description="Bind address (HOST and --host override).")
    port: int = Field(8000, ge=0, le=65535, description="Bind port (PORT and --port override).")
    runtime_dir: Path | None = Field(None, description="Where ipc sockets live; default a private temp dir.")
    remote_workers: RemoteWorkersConfig | None = Field(None, description="Accept workers from other hosts.")
    cluster: ClusterConfig | None = Field(
        None,
        description="Cluster mode: connect to workers that listen (`model-worker --listen`), found through "
        "etcd, Kubernetes or a static list; several gateways share them (docs/scale-out.md).",
    )
    api_keys_file: Path | None = Field(
        None,
        description="YAML file of API keys (gateway/api_keys.py shows the format), relative to the registry "
        "file; re-read when it changes. With no keys here nor in GATEWAY_API_KEYS / GATEWAY_ADMIN_KEYS, "
        "the gateway serves without auth and only on a loopback address.",
    )
    worker_start_timeout_s: float = Field(600.0, gt=0, description="Load plus warm-up deadline per worker.")
    heartbeat_interval_s: float = Field(
        DEFAULT_HEARTBEAT_INTERVAL_S, gt=0, description="How often each worker reports its state and load."
    )
    heartbeat_timeout_s: float = Field(30.0, gt=0, description="No frame for this long: worker lost.")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="Larger request bodies get 413.")
    shutdown_grace_s: float = Field(
        10.0, ge=0, description="On SIGTERM, requests in flight may finish for this long."
    )
    sse_keepalive_s: float = Field(15.0, gt=0, description="SSE comment ping while a stream waits.")
    restart_backoff_s: float = Field(1.0, gt=0, description="First restart delay; doubles per failed start.")
    restart_backoff_max_s: float = Field(30.0, gt=0, description="The longest restart delay.")
    restart_limit: int = Field(
        5, ge=1, description="Failed starts in a row before a worker is marked failed."
    )
    retry_failed_after_s: float | None = Field(
        300.0,
        ge=0,
        description="A failed worker is tried again after this many seconds (another restart_limit starts; "
        "an on-demand model goes back to unloaded, so its next request loads it). 0 or null: it stays "
        "failed until loaded by hand.",
    )
    write_stall_timeout_s: float = Field(
        30.0, gt=0, description="A streaming client that reads nothing for this long is dropped."
    )
    keep_alive_timeout_s: float = Field(
        5.0,
        gt=0,
        description="An idle HTTP connection is closed after this long; it is also the deadline for a new "
        "connection's request headers (slow-header clients are dropped).",
    )
    max_connections: int = Field(
        8192, ge=16, description="Open HTTP connections at most; more are refused at once (reset)."
    )
    max_connections_per_client: int = Field(
        512, ge=1, description="Open HTTP connections from one client address at most."
    )
    reuse_port: bool = Field(
        False,
        description="Listen with SO_REUSEPORT, so that several gateway processes on one host can share "
        "the port (every one of them must set it); the kernel spreads new connections over them. Give "
        "them the same registry: in cluster mode they share its workers.",
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Host names served without API keys besides loopback ones (localhost, 127.0.0.1, "
        "::1): a keyless gateway refuses any other Host header, against DNS rebinding.",
    )
    allowed_origins: list[str] = Field(
        default_factory=list,
        description="Browser origins (https://ui.example:8443) besides the gateway's own that may send "
        "POST and other state-changing requests; any other Origin is refused with 403.",
    )
    readiness: Literal["all_startup", "any"] = Field(
        "all_startup",
        description="When /health/ready answers 200: every startup model is ready (all_startup), or at "
        "least one model can serve (any). Models unloaded on purpose never count.",
    )
    max_concurrent_loads: int | None = Field(
        None, ge=1, description="Workers loading a model at once; others wait their turn. None: no limit."
    )
    model_cache_dir: Path | None = Field(
        None,
        description="Where hf:// models are downloaded, relative to the registry file; default "
        "~/.cache/llm-gateway/models.",
    )
    redis_url: str | None = Field(
        None,
        pattern=r"^(redis|rediss|unix)://",
        description="Share per-key rate limits and token budgets with every gateway using this Redis "
        "(redis://host:6379/0, rediss:// for TLS). Unset: each gateway counts its own. While Redis "
        "cannot be reached, each gateway falls back to its own counts. Stored responses live there too "
        "unless `server.responses.backend` says otherwise.",
    )
    redis_key_prefix: str = Field(
        "llm-gateway:", min_length=1, description="Prefix of every Redis key the gateways write."
    )
    responses: ResponseStoreConfig = Field(
        default_factory=ResponseStoreConfig, description="Stored responses of the Responses API."
    )

    @field_validator("host")
    @classmethod
    def _host_named(cls, host: str) -> str:
        # An empty host binds every interface, which nobody writes on purpose as "".
        if not host.strip() or any(c.isspace() for c in host):
            raise ValueError(
                f"{host!r} is not a host: an address or name, e.g. 127.0.0.1, or 0.0.0.0 for every interface"
            )
        return host

    @field_validator("runtime_dir")
    @classmethod
    def _socket_path_fits(cls, runtime_dir: Path | None) -> Path | None:
        if runtime_dir is not None and len(os.fsencode(runtime_dir)) > MAX_RUNTIME_DIR_BYTES:
            raise ValueError(
                f"longer than {MAX_RUNTIME_DIR_BYTES} bytes: the ipc socket in it would pass ZeroMQ's "
                "limit of 107 bytes; choose a shorter folder"
            )
        return runtime_dir

    @model_validator(mode="after")
    def _consistent(self) -> ServerConfig:
        problems: list[tuple[Location, str]] = []
        if self.responses.backend == "redis" and self.redis_url is None:
            problems.append((("responses", "backend"), "redis, but server.redis_url is not set"))
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            # An idle worker sends nothing but heartbeats: it would be declared lost between two.
            problems.append(
                (
                    ("heartbeat_timeout_s",),
                    f"{self.heartbeat_timeout_s} must exceed heartbeat_interval_s "
                    f"({self.heartbeat_interval_s}), or idle workers are lost between two heartbeats",
                )
            )
        if self.restart_backoff_max_s < self.restart_backoff_s:
            problems.append(
                (
                    ("restart_backoff_max_s",),
                    f"{self.restart_backoff_max_s} is less than restart_backoff_s "
                    f"({self.restart_backoff_s}), the first delay it caps",
                )
            )
        if problems:
            raise field_errors("ServerConfig", problems)
        return self
