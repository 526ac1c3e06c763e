"""The SQLite response store: kept across instances (a restart), owned by one key, gone after the
retention or a delete, and no file at all until something is stored."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from gateway.config.registry import ResponseStoreConfig
from gateway.state.response_store import StoredResponse, open_store
from gateway.state.sqlite_store import SqliteResponseStore


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


def test_the_configured_backend_and_path(tmp_path: Path) -> None:
    store = open_store(ResponseStoreConfig(path=Path("kept.sqlite3")), tmp_path)
    assert isinstance(store, SqliteResponseStore) and store.path == tmp_path / "kept.sqlite3"
    asyncio.run(store.close())
    assert open_store(ResponseStoreConfig(backend="none"), tmp_path) is None
