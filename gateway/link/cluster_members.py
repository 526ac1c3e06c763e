"""Cluster mode: following the membership, connecting to the workers in it, and pinging them.

Runs in the gateway process, on its asyncio loop, started and stopped by the supervisor. Owns two
tasks: one that follows `Membership.changes()` (etcd, Kubernetes EndpointSlices, or a static list;
gateway.cluster) and dials each worker that joins and hangs up on each that leaves, and one that
sends every dialled worker a Ping each heartbeat interval, without which a listening worker takes
this gateway for dead and cancels its jobs. What a worker is once connected (its Hello, Ready,
heartbeats, being lost and back) is remote membership's business (gateway.workers.remote), exactly
as for a worker that connects to us; this module is handed only the few callables it uses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from gateway.cluster.membership import Membership, WorkerRecord, cancel_and_wait

logger = logging.getLogger(__name__)


class ClusterMembers:
    def __init__(
        self,
        membership: Membership,
        dial: Callable[[WorkerRecord], bool],
        hang_up: Callable[[str], None],
        forget: Callable[[str], None],
        ping: Callable[[], None],
        interval_s: float,
    ) -> None:
        self._membership = membership
        self._dial, self._hang_up, self._forget, self._ping = dial, hang_up, forget, ping
        self._interval_s = interval_s
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await self._membership.start()  # returns at once; the backend may still be unreachable
        self._tasks = [
            asyncio.create_task(self._follow(), name="cluster-membership"),
            asyncio.create_task(self._ping_forever(), name="cluster-ping"),
        ]

    def members(self) -> Mapping[str, WorkerRecord]:
        """The workers of the membership now (their endpoints say which host each is on)."""
        return self._membership.members()

    async def stop(self) -> None:
        for task in self._tasks:
            await cancel_and_wait(task)
        await self._membership.stop()

    async def _follow(self) -> None:
        async for change in self._membership.changes():
            record = change.record
            try:
                if change.kind == "join":
                    self._dial(record)
                else:
                    self._hang_up(record.worker_id)
                    self._forget(record.worker_id)
            except Exception:  # one bad record must not stop the gateway from following the others
                logger.exception("membership change for worker %s failed", record.worker_id)

    async def _ping_forever(self) -> None:
        while True:
            self._ping()
            await asyncio.sleep(self._interval_s)
