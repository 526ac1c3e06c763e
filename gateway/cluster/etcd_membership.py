"""The gateway's view of the workers registered in etcd: a listing of PREFIX/workers/, then a
watch from the listing's revision on; a record whose lease expires is deleted by etcd and leaves.

Runs in the gateway process, on its asyncio loop (aetcd is asyncio-native). Owns `EtcdMembership`,
one implementation of `gateway.cluster.membership.Membership` (its task and table are kept by its
base, `gateway.cluster.backend_base.WatchingMembership`), and its etcd session.

When etcd cannot be reached the view stays as it was (routing goes on to the workers known,
whose own link tells whether they are alive), with one warning; the session then tries the next
endpoint every `retry_interval_s`. When etcd answers again a fresh listing is compared with the
view and only the difference is emitted (workers that joined or left meanwhile), with one info
line; then the watch resumes from that listing's revision, so nothing between is missed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aetcd.exceptions
from pydantic import ValidationError

from gateway.cluster.backend_base import WatchingMembership
from gateway.cluster.etcd_session import UNREACHABLE, EtcdSession
from gateway.cluster.membership import WorkerRecord
from gateway.cluster.settings import EtcdSettings

logger = logging.getLogger(__name__)


def worker_key(prefix: str, worker_id: str) -> bytes:
    """Where a worker's record lives (model_worker.registration writes it there)."""
    return f"{prefix}workers/{worker_id}".encode()


class EtcdMembership(WatchingMembership):
    _task_name = "etcd-membership"

    def __init__(self, settings: EtcdSettings) -> None:
        super().__init__()
        self._prefix = worker_key(settings.prefix, "")
        self._retry_interval_s = settings.retry_interval_s
        self._session = EtcdSession(settings.endpoints, settings.request_timeout_s)

    async def _close(self) -> None:
        await self._session.close()

    # -- listing and watching -----------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                revision = await self._list()
                await self._watch(revision + 1)
            except (*UNREACHABLE, aetcd.exceptions.ClientError) as exc:
                # A compacted revision (RevisionCompactedError) lands here too: the relisting mends it.
                if self._connected:
                    logger.warning(
                        "etcd unreachable at %s (%s): routing goes on with the last membership (%d workers)",
                        self._session.endpoint,
                        type(exc).__name__,
                        len(self._table.members()),
                    )
                self._connected = False
                await self._session.failed(exc)
                await asyncio.sleep(self._retry_interval_s)

    async def _list(self) -> int:
        """Replace the view by a fresh listing; its revision, from which the watch goes on."""
        listing = await self._session.call("get_prefix", self._prefix)
        records: dict[str, WorkerRecord] = {}
        for kv in listing:
            record = self._decode(kv.key, kv.value)
            if record is not None:
                records[record.worker_id] = record
        was_synced = self._synced.is_set()
        self._table.replace(records)
        self._connected = True
        self._synced.set()
        if was_synced:
            logger.info("etcd reachable again at %s: %d workers", self._session.endpoint, len(records))
        return int(listing.header.revision)

    async def _watch(self, start_revision: int) -> None:
        watch = await asyncio.wait_for(
            self._session.client.watch_prefix(self._prefix, start_revision=start_revision),
            self._session.request_timeout_s,
        )
        try:
            async for event in watch:
                worker_id = event.kv.key[len(self._prefix) :].decode(errors="replace")
                if event.kind == aetcd.EventKind.PUT:
                    record = self._decode(event.kv.key, event.kv.value)
                    if record is not None:
                        self._table.put(record)
                        continue
                self._table.remove(worker_id)  # a delete, or a record no longer readable
        finally:
            try:
                await asyncio.wait_for(watch.cancel(), self._session.request_timeout_s)
            except (*UNREACHABLE, aetcd.exceptions.ClientError):
                pass  # the stream is gone already
        # A watch that ends without an error was closed by the server (e.g. a leader change): relist.
        raise aetcd.exceptions.ConnectionFailedError("the watch stream ended")

    def _decode(self, key: bytes, value: bytes) -> WorkerRecord | None:
        worker_id = key[len(self._prefix) :].decode(errors="replace")
        try:
            record = WorkerRecord.decode(value)
        except ValidationError as exc:
            logger.warning("ignoring the unreadable record of worker %s in etcd: %s", worker_id, _first(exc))
            return None
        if record.worker_id != worker_id:
            logger.warning("ignoring the record under %s: it names worker %s", worker_id, record.worker_id)
            return None
        return record


def _first(exc: ValidationError) -> Any:
    error = exc.errors()[0]
    return f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}"
