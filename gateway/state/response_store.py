"""Stored responses of the Responses API, behind one small interface.

Runs in the gateway process. Owns `StoredResponse` (a response object as it was returned, the
conversation it ends, who created it, and when) and `ResponseStore`, the four calls the HTTP routes
make. A stored response belongs to the API key that created it: every read and delete names the
owner, and another owner's response is exactly as absent as a missing one. Responses older than the
retention are absent too, and purged. `open_store` builds the configured backend: SQLite on local
disk (gateway.state.sqlite_store) by default; a shared backend (Redis, for several gateways) adds
one module and one line there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gateway.config.registry import ResponseStoreConfig


@dataclass(frozen=True)
class StoredResponse:
    id: str
    owner: str  # the creating API key's digest (hex), or "" when the gateway runs without keys
    created_at: float  # Unix time
    response: dict[str, Any]  # the response object, as it was returned
    # The conversation this response ends, as chat messages ({"role", "content"}): what a request
    # with previous_response_id continues. Instructions are not in it (they are not carried over).
    conversation: list[dict[str, Any]]


class ResponseStore(Protocol):
    async def put(self, record: StoredResponse) -> None: ...

    async def get(self, response_id: str, owner: str) -> StoredResponse | None: ...

    async def delete(self, response_id: str, owner: str) -> bool: ...

    async def close(self) -> None: ...


def open_store(config: ResponseStoreConfig, base: Path) -> ResponseStore | None:
    """The configured store (None: responses are not stored); `base` is the registry's folder."""
    if config.backend == "none":
        return None
    from gateway.state.sqlite_store import SqliteResponseStore

    path = Path(config.path).expanduser()
    return SqliteResponseStore(path if path.is_absolute() else base / path, config.retention_s)
