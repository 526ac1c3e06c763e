"""The response stores. SQLite: kept across instances (a restart), owned by one key, gone after the
retention or a delete, and no file at all until something is stored. The backend the configuration
picks (Redis when `server.redis_url` is set), and a Redis that cannot be reached (its behaviour with
a real Redis is tests/integration/test_responses_redis.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.config.server_config import ResponseStoreConfig, ServerConfig
from gateway.state.redis_store import RedisResponseStore
from gateway.state.response_store import StoredResponse, StoreUnavailable, open_store
from gateway.state.sqlite_store import SqliteResponseStore
from tests.harness import free_port


def record(response_id: str, owner: str, age_s: float = 0.0) -> StoredResponse:
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    return StoredResponse(response_id, owner, time.time() - age_s, {"id": response_id, "output": []}, turns)


def test_stored_responses_outlive_the_store_and_belong_to_their_owner(tmp_path: Path) -> None:
    path = tmp_path / "state" / "responses.sqlite3"

    async def scenario() -> None:
        store = SqliteResponseStore(path, retention_s=3600)
        assert await store.get("resp_1", "a") is None and not await store.delete("resp_1", "a")
        assert not path.exists()  # reads create nothing
        await store.put(record("resp_1", "a"))
        await store.put(record("resp_old", "a", age_s=7200))  # older than the retention
        await store.close()

        again = SqliteResponseStore(path, retention_s=3600)  # a new gateway process on the same file
        found = await again.get("resp_1", "a")
        assert found is not None and found.response == {"id": "resp_1", "output": []}
        assert found.conversation[-1] == {"role": "assistant", "content": "hello"}
        assert await again.get("resp_1", "b") is None  # another key's: absent
        assert not await again.delete("resp_1", "b")
        assert await again.get("resp_old", "a") is None  # past the retention: absent
        assert await again.delete("resp_1", "a") and await again.get("resp_1", "a") is None
        await again.close()

    asyncio.run(scenario())


def test_stored_prompts_and_outputs_are_readable_by_the_gateway_user_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state" / "responses.sqlite3"
    umask = os.umask(0o022)  # the usual one: files 644, folders 755 unless asked otherwise
    try:

        async def scenario() -> None:
            store = SqliteResponseStore(path, retention_s=3600)
            await store.put(record("resp_1", "a"))
            await store.close()

        asyncio.run(scenario())
    finally:
        os.umask(umask)
    for made in [path, path.parent, *path.parent.glob("responses.sqlite3-*")]:
        assert made.stat().st_mode & 0o077 == 0, f"{made.name} is open to others"
    path.chmod(0o644)  # an existing file that others may read: kept as it is, and warned about

    async def reopen() -> None:
        store = SqliteResponseStore(path, retention_s=3600)
        await store.put(record("resp_2", "a"))
        await store.close()

    with caplog.at_level(logging.WARNING, logger="gateway.state.sqlite_store"):
        asyncio.run(reopen())
    assert "readable by others" in caplog.text


def test_the_configured_backend_and_path(tmp_path: Path) -> None:
    store = open_store(ResponseStoreConfig(path=Path("kept.sqlite3")), tmp_path)
    assert isinstance(store, SqliteResponseStore) and store.path == tmp_path / "kept.sqlite3"
    asyncio.run(store.close())
    assert open_store(ResponseStoreConfig(backend="none"), tmp_path) is None


def test_auto_picks_redis_when_the_server_names_one(tmp_path: Path) -> None:
    url = "redis://127.0.0.1:1/0"
    store = open_store(ResponseStoreConfig(), tmp_path, url, "p:")
    assert isinstance(store, RedisResponseStore) and store.prefix == "p:"
    asyncio.run(store.close())
    sqlite = open_store(ResponseStoreConfig(backend="sqlite"), tmp_path, url)
    assert isinstance(sqlite, SqliteResponseStore)
    asyncio.run(sqlite.close())
    assert isinstance(open_store(ResponseStoreConfig(), tmp_path), SqliteResponseStore)


def test_a_redis_store_needs_the_server_redis_url() -> None:
    with pytest.raises(ValidationError, match="server.redis_url is not set"):
        ServerConfig(responses=ResponseStoreConfig(backend="redis"))
    assert ServerConfig(redis_url="redis://r:6379/0", responses=ResponseStoreConfig(backend="redis"))


def test_an_unreachable_redis_is_store_unavailable_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.state.redis_store")
    store = RedisResponseStore(f"redis://127.0.0.1:{free_port()}/0", "p:", retention_s=60)

    async def scenario() -> None:
        for call in (store.check(), store.put(record("resp_1", "a")), store.get("resp_1", "a"),
                     store.delete("resp_1", "a")):  # fmt: skip
            with pytest.raises(StoreUnavailable, match="Redis unreachable"):
                await call
        await store.close()

    asyncio.run(scenario())
    warnings = [r for r in caplog.records if r.name == "gateway.state.redis_store"]
    assert len(warnings) == 1 and "stored responses are unavailable" in warnings[0].getMessage()
