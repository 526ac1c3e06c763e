"""Membership from a fixed list: the workers of the registry's `server.cluster.workers`.

Runs in the gateway process, on its asyncio loop. Owns nothing beyond the list it was given: for a
cluster without etcd or Kubernetes (a few hosts, or a test), it offers the same `Membership` the
other backends do, so the gateway connects to these workers exactly as it would to discovered ones.
The list never changes while the gateway runs; a worker that is down is `lost` until it is back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence

from gateway.cluster.membership import MembershipChange, MemberTable, WorkerRecord


class StaticMembership:
    def __init__(self, records: Sequence[WorkerRecord]) -> None:
        self._records = list(records)
        self._table = MemberTable()

    async def start(self) -> None:
        self._table.replace({r.worker_id: r for r in self._records})

    async def stop(self) -> None:
        return None

    async def synced(self) -> None:
        return None

    @property
    def connected(self) -> bool:
        return True

    def members(self) -> Mapping[str, WorkerRecord]:
        return self._table.members()

    def changes(self) -> AsyncIterator[MembershipChange]:
        return self._table.changes()
