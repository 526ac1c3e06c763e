"""API key sources: the keys file (`server.api_keys_file`) and the environment, and the bind rule.

Runs in the gateway process (and in `gateway serve` before it binds). Owns the keys file schema
(pydantic, extra=forbid; every error names the file, the entry and the field), the conversion of
each entry to an `ApiKey` that holds only the key's SHA-256 digest, and the rule that a gateway
without any key may listen on loopback only. Keys are never logged; names are.

Keys file:
    keys:
      - name: alice                    # shown in logs
        key_sha256: 5e88...            # or `key: <the key>` (then keep the file mode 600)
        models: [demo-small]           # names or aliases; "*" for every model
        rate_limit_rpm: 60             # optional, requests per minute on /v1/*
        budget_tokens_per_day: 200000  # optional, prompt + completion tokens per UTC day (also _per_month)
        priority: low                  # optional: high, normal (default) or low in the model queues
      - name: ops
        key_sha256: 9f86...
        admin: true                    # may use /admin/*; models as listed (none here)
      - name: prometheus
        key_sha256: 2c26...
        metrics: true                  # may read /metrics (and nothing else without models)
/metrics shows every model's figures, so it answers to admin keys, metrics keys and keys for every
model ("*"); a key scoped to some models gets 403 there.
Environment: GATEWAY_API_KEYS (comma-separated; every model) and GATEWAY_ADMIN_KEYS (admin, every model).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from gateway.config.registry import ConfigError, Registry
from wire.yaml_file import YamlFileError, read_yaml_file

logger = logging.getLogger(__name__)

MIN_KEY_LENGTH = 16
ENV_INFERENCE_KEYS = "GATEWAY_API_KEYS"
ENV_ADMIN_KEYS = "GATEWAY_ADMIN_KEYS"
API_KEY_VARIABLES = frozenset({ENV_INFERENCE_KEYS, ENV_ADMIN_KEYS})
# What metrics and logs call a request that showed no key; no configured key may take the name,
# or its figures would mix with those of refused strangers (gateway.observability.metrics).
ANONYMOUS = "anonymous"
# A request's class in a model's queue (gateway.serving.router serves higher classes first).
Priority = Literal["high", "normal", "low"]


# ---- the keys file ------------------------------------------------------------------------------


class KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(..., min_length=1, max_length=100, description="Shown in logs instead of the key.")
    key: SecretStr | None = Field(None, description="The key itself; prefer key_sha256 in shared files.")
    key_sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$", description="Hex SHA-256 of the key.")
    models: list[str] = Field(default_factory=list, description="Model names or aliases; '*' for all.")
    admin: bool = Field(False, description="May use /admin/*.")
    metrics: bool = Field(False, description="May read /metrics (every model's figures).")
    rate_limit_rpm: int | None = Field(None, ge=1, description="Requests per minute on /v1/*.")
    budget_tokens_per_day: int | None = Field(
        None, ge=1, description="Prompt plus completion tokens per UTC day; beyond it requests get 429."
    )
    budget_tokens_per_month: int | None = Field(
        None, ge=1, description="Prompt plus completion tokens per UTC month; beyond it requests get 429."
    )
    priority: Priority = Field(
        "normal",
        description="The key's class in the model queues: high, normal or low. A request may lower its "
        "own class with the X-Priority header; asking for one above its key's is a 403.",
    )

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str) -> str:
        if name == ANONYMOUS:
            raise ValueError(f"{ANONYMOUS!r} is what metrics call requests without a key; pick another name")
        return name

    @field_validator("key")
    @classmethod
    def _long_enough(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None and len(key.get_secret_value()) < MIN_KEY_LENGTH:
            raise ValueError(f"a key must be at least {MIN_KEY_LENGTH} characters")
        return key

    @model_validator(mode="after")
    def _one_secret(self) -> KeyEntry:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError("give exactly one of 'key' and 'key_sha256'")
        if not self.admin and not self.metrics and not self.models:
            raise ValueError("an inference key needs 'models' (names, or '*' for all)")
        return self


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: list[KeyEntry]


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: bytes
    models: frozenset[str] | None  # canonical model names; None means every model
    admin: bool = False
    rate_limit_rpm: int | None = None
    metrics: bool = False
    budget_tokens_per_day: int | None = None
    budget_tokens_per_month: int | None = None
    priority: Priority = "normal"

    @property
    def budgets(self) -> dict[str, int | None]:
        """Token budgets by period ("day", "month"); None where the key has none."""
        return {"day": self.budget_tokens_per_day, "month": self.budget_tokens_per_month}

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

    @property
    def sees_every_model(self) -> bool:
        """May see figures of every model (/metrics): admin, metrics, or unscoped keys."""
        return self.admin or self.metrics or self.models is None


def digest_of(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _entry_where(error: ErrorDetails, raw: Any) -> str:
    return _where_in_keys(raw, error["loc"])


def _where_in_keys(raw: Any, location: tuple[str | int, ...]) -> str:
    """`key 'name' (entry #N), field 'a'` for a location in the keys file."""
    loc = list(location)
    where = []
    if len(loc) >= 2 and loc[0] == "keys" and isinstance(loc[1], int):
        entries = raw.get("keys") if isinstance(raw, dict) else None
        entry = entries[loc[1]] if isinstance(entries, list) and loc[1] < len(entries) else None
        name = entry.get("name") if isinstance(entry, dict) else None
        where.append(f"key {name!r} (entry #{loc[1] + 1})" if name else f"entry #{loc[1] + 1}")
        loc = loc[2:]
    if loc:
        where.append("field " + repr(".".join(str(p) for p in loc)))
    return ", ".join(where) or "keys file"


def parse_keys_file(path: Path, registry: Registry) -> list[ApiKey]:
    """Read and validate a keys file; ConfigError naming the file, the entry and the field."""
    try:
        raw = read_yaml_file(path, _where_in_keys, kind="keys file")
    except YamlFileError as exc:
        raise ConfigError(str(exc)) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping with 'keys' at the top level")
    try:
        parsed = KeysFile.model_validate(raw)
    except ValidationError as exc:
        lines = [
            f"{path}: {_entry_where(e, raw)}: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors()
        ]
        raise ConfigError("\n".join(lines)) from None
    keys = []
    for number, entry in enumerate(parsed.keys, 1):
        where = f"{path}: key {entry.name!r} (entry #{number})"
        models: set[str] = set()
        for name in entry.models:
            model = registry.model(name)
            if name != "*" and model is None:
                raise ConfigError(f"{where}, field 'models': unknown model {name!r}")
            models.add(model.name if model else "*")
        if entry.key is not None:
            digest = digest_of(entry.key.get_secret_value())
        else:
            digest = bytes.fromhex(entry.key_sha256 or "")
        scope = None if "*" in models else frozenset(models)
        keys.append(
            ApiKey(
                entry.name,
                digest,
                scope,
                entry.admin,
                entry.rate_limit_rpm,
                entry.metrics,
                entry.budget_tokens_per_day,
                entry.budget_tokens_per_month,
                entry.priority,
            )
        )
    return keys


def env_keys(environ: Mapping[str, str]) -> list[ApiKey]:
    """Keys from the environment: inference keys may use every model; admin keys may do anything."""
    keys = []
    for variable, admin in ((ENV_INFERENCE_KEYS, False), (ENV_ADMIN_KEYS, True)):
        values = [v.strip() for v in environ.get(variable, "").split(",") if v.strip()]
        for number, value in enumerate(values, 1):
            if len(value) < MIN_KEY_LENGTH:
                raise ConfigError(f"{variable}: key #{number} is shorter than {MIN_KEY_LENGTH} characters")
            keys.append(ApiKey(f"{variable.lower()}#{number}", digest_of(value), None, admin))
    return keys


def keys_file_path(registry: Registry) -> Path | None:
    path = registry.server.api_keys_file
    if path is None:
        return None
    base = registry.source.parent if registry.source is not None else Path.cwd()
    return base / path  # an absolute path stays as it is


def check_unique(keys: list[ApiKey]) -> None:
    names: set[str] = set()
    digests: set[bytes] = set()
    for key in keys:
        if key.name in names:
            raise ConfigError(f"API key name {key.name!r} is used twice")
        if key.digest in digests:
            raise ConfigError(f"API key {key.name!r} has the same secret as another key")
        names.add(key.name)
        digests.add(key.digest)


# ---- binding without keys -----------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything


def check_bind_allowed(registry: Registry, host: str, environ: Mapping[str, str]) -> None:
    """Refuse (ConfigError) to listen beyond loopback when no key is configured at all."""
    if is_loopback(host) or keys_file_path(registry) is not None or env_keys(environ):
        return
    raise ConfigError(
        f"refusing to listen on {host!r} without API keys: anyone who can reach it could use every "
        f"model. Set server.api_keys_file in the registry or {ENV_INFERENCE_KEYS}/{ENV_ADMIN_KEYS}, "
        "or bind a loopback address (127.0.0.1, ::1)."
    )


def warn_if_readable(path: Path) -> None:
    try:
        plain = path.stat().st_mode & 0o077 and re.search(r"^[\s-]*key\s*:", path.read_text(), re.M)
    except OSError:
        return
    if plain:
        logger.warning("keys file %s holds plain keys and is readable by others; chmod 600 it", path)
