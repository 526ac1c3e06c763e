"""Stored responses of the Responses API, behind one small interface.

Runs in the gateway process. Owns `StoredResponse` (a response object as it was returned, the
conversation it ends, who created it, and when), `ResponseStore`, the calls the HTTP routes make,
and `StoreUnavailable`, the one error a backend raises when it cannot answer (the routes turn it
into a 503). A stored response belongs to the API key that created it: every read and delete names
the owner, and another owner's response is exactly as absent as a missing one. Responses older than
the retention are absent too, and purged. `open_store` builds the configured backend: SQLite on
local disk (gateway.state.sqlite_store), or Redis shared by every gateway that uses it
(gateway.state.redis_store), which `auto` picks when `server.redis_url` is set.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gateway.config.server_config import ResponseStoreConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredResponse:
    id: str
    owner: str  # the creating API key's digest (hex), or "" when the gateway runs without keys
    created_at: float  # Unix time
    response: dict[str, Any]  # the response object, as it was returned
    # The conversation this response ends, as chat messages ({"role", "content"}): what a request
    # with previous_response_id continues. Instructions are not in it (they are not carried over).
    conversation: list[dict[str, Any]]


class StoreUnavailable(Exception):
    """The store cannot answer now (a disk error, Redis unreachable); the message says why, without
    secrets. The request fails with a 503; the gateway goes on."""


class ResponseStore(Protocol):
    """Every call raises StoreUnavailable, and nothing else, when the backend cannot answer."""

    async def check(self) -> None:
        """Raise StoreUnavailable if the store cannot take a response now (asked before generating
        one that is to be stored, so the client gets a 503 rather than a wasted generation)."""
        ...

    async def put(self, record: StoredResponse) -> None: ...

    async def get(self, response_id: str, owner: str) -> StoredResponse | None: ...

    async def delete(self, response_id: str, owner: str) -> bool: ...

    async def close(self) -> None: ...


def open_store(
    config: ResponseStoreConfig, base: Path, redis_url: str | None = None, redis_prefix: str = "llm-gateway:"
) -> ResponseStore | None:
    """The configured store (None: responses are not stored); `base` is the registry's folder,
    `redis_url` and `redis_prefix` the server's Redis settings (`server.redis_url`)."""
    backend = config.backend
    if backend == "auto":
        backend = "redis" if redis_url is not None else "sqlite"
    if backend == "none":
        return None
    if backend == "redis":
        if redis_url is None:
            raise ValueError("the redis response store needs server.redis_url")
        from gateway.state.redis_store import RedisResponseStore

        logger.info("stored responses are kept in Redis, shared with every gateway using it")
        return RedisResponseStore(redis_url, redis_prefix, config.retention_s)
    from gateway.state.sqlite_store import SqliteResponseStore

    path = Path(config.path).expanduser()
    return SqliteResponseStore(path if path.is_absolute() else base / path, config.retention_s)
