"""The SQLite backend of the response store: one file on local disk, kept across restarts.

Runs in the gateway process. Every database call runs on one thread of its own (a one-worker
executor that owns the connection), never on the event loop; the file is opened on first use, in
WAL mode, so a gateway that never stores a response never creates it. The file holds prompts and
outputs, so it is created readable by the gateway's user only (mode 600, in a new folder of mode
700; SQLite gives its -wal and -shm files the same mode), and an existing one that others may read
is warned about. Rows older than the retention are invisible at once and deleted at most once a
minute, as responses are stored. A database or disk error leaves as StoreUnavailable.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from gateway.state.response_store import StoredResponse, StoreUnavailable

logger = logging.getLogger(__name__)
T = TypeVar("T")
PURGE_EVERY_S = 60.0
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, owner TEXT NOT NULL, "
    "created_at REAL NOT NULL, response TEXT NOT NULL, conversation TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at)",
)


class SqliteResponseStore:
    def __init__(self, path: Path, retention_s: float) -> None:
        self.path = path
        self.retention_s = retention_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="response-store")
        self._connection: sqlite3.Connection | None = None
        self._purged_at = 0.0

    async def _run(self, work: Any, *args: Any) -> Any:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, work, *args)
        except (sqlite3.Error, OSError) as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc

    def _db(self) -> sqlite3.Connection | None:
        """The connection, opened on first use (on the store's thread, which alone uses it); None
        while nothing was ever stored (reads then create no file)."""
        if self._connection is None and not self.path.exists():
            return None
        return self._open()

    def _open(self) -> sqlite3.Connection:
        if self._connection is None:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:  # before SQLite creates it with the umask's mode
                os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            except FileExistsError:
                if self.path.stat().st_mode & 0o077:
                    logger.warning("stored responses in %s are readable by others; chmod 600 it", self.path)
            connection = sqlite3.connect(self.path, isolation_level=None)
            connection.execute("PRAGMA journal_mode=WAL")
            for statement in _SCHEMA:
                connection.execute(statement)
            self._connection = connection
        return self._connection

    def _cutoff(self) -> float:
        return time.time() - self.retention_s

    async def check(self) -> None:
        """Nothing to ask: a local file's errors show when it is written."""

    async def put(self, record: StoredResponse) -> None:
        row = (record.id, record.owner, record.created_at, json.dumps(record.response, ensure_ascii=False),
               json.dumps(record.conversation, ensure_ascii=False))  # fmt: skip
        await self._run(self._put, row)

    def _put(self, row: tuple[Any, ...]) -> None:
        db = self._open()
        db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)", row)
        if time.monotonic() - self._purged_at >= PURGE_EVERY_S:
            self._purged_at = time.monotonic()
            db.execute("DELETE FROM responses WHERE created_at < ?", (self._cutoff(),))

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        row = await self._run(self._get, response_id, owner)
        if row is None:
            return None
        return StoredResponse(row[0], row[1], row[2], json.loads(row[3]), json.loads(row[4]))

    def _get(self, response_id: str, owner: str) -> tuple[Any, ...] | None:
        db = self._db()
        if db is None:
            return None
        query = "SELECT * FROM responses WHERE id = ? AND owner = ? AND created_at >= ?"
        return db.execute(query, (response_id, owner, self._cutoff())).fetchone()  # type: ignore[no-any-return]

    async def delete(self, response_id: str, owner: str) -> bool:
        return await self._run(self._delete, response_id, owner)  # type: ignore[no-any-return]

    def _delete(self, response_id: str, owner: str) -> bool:
        db = self._db()
        if db is None:
            return False
        query = "DELETE FROM responses WHERE id = ? AND owner = ? AND created_at >= ?"
        return db.execute(query, (response_id, owner, self._cutoff())).rowcount > 0

    async def close(self) -> None:
        await self._run(self._close)
        self._executor.shutdown(wait=True)

    def _close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
