"""A worker's record in etcd: put under PREFIX/workers/WORKER_ID on a lease, kept alive while the
worker lives, revoked when it stops, so that gateways forget it at once (or, if it dies, when the
lease's TTL runs out).

Runs in the worker process, on its asyncio loop (the one that serves the socket; the engine
thread is not involved). Imports nothing of the gateway beyond `gateway.cluster`'s own
dependency-free modules, so that it can move to a package the worker owns.

While etcd cannot be reached the worker keeps serving (gateways that know it keep routing to it)
and keeps trying: the same lease when it is back in time, a new lease and a new put when the old
one expired meanwhile (a restarted etcd that lost its data, or an outage longer than the TTL).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from gateway.cluster.etcd_session import UNREACHABLE, EtcdSession
from gateway.cluster.membership import WorkerRecord, cancel_and_wait

logger = logging.getLogger(__name__)


def worker_key(prefix: str, worker_id: str) -> bytes:
    return f"{prefix}workers/{worker_id}".encode()


class Registration:
    def __init__(
        self,
        record: WorkerRecord,
        endpoints: Sequence[str],
        *,
        prefix: str = "/llm-gateway/",
        ttl_s: int = 10,
        request_timeout_s: float = 1.0,
        retry_interval_s: float = 1.0,
    ) -> None:
        self.record = record
        self.key = worker_key(prefix, record.worker_id)
        self.ttl_s = ttl_s
        self.retry_interval_s = retry_interval_s
        self._session = EtcdSession(endpoints, request_timeout_s)
        self._lease_id: int | None = None
        self._registered = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def registered(self) -> bool:
        """Whether the record is known to be in etcd now (False from the first failed refresh on)."""
        return self._registered.is_set()

    async def wait_registered(self) -> None:
        await self._registered.wait()

    async def start(self) -> None:
        """Register in the background (returns at once: a worker serves whether etcd answers or not)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"etcd-registration-{self.record.worker_id}")

    async def stop(self) -> None:
        """Remove the record now: revoking the lease deletes it, and every gateway sees it leave."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if self._lease_id is not None:
            try:
                await self._session.call("revoke_lease", self._lease_id)
            except UNREACHABLE as exc:
                logger.warning(
                    "could not remove worker %s from etcd (%s): gateways forget it when its lease "
                    "expires, within %s s",
                    self.record.worker_id,
                    type(exc).__name__,
                    self.ttl_s,
                )
            self._lease_id = None
        self._registered.clear()
        await self._session.close()

    async def _run(self) -> None:
        failing = False
        while True:
            try:
                if self._lease_id is None or not await self._refresh():
                    await self._register()
                if failing:
                    logger.info("etcd reachable again: worker %s is registered", self.record.worker_id)
                    failing = False
                await asyncio.sleep(self.ttl_s / 3)
            except UNREACHABLE as exc:
                self._registered.clear()
                if not failing:
                    logger.warning(
                        "etcd unreachable at %s (%s): worker %s goes on serving and keeps trying to register",
                        self._session.endpoint,
                        type(exc).__name__,
                        self.record.worker_id,
                    )
                    failing = True
                await self._session.failed(exc)
                await asyncio.sleep(self.retry_interval_s)

    async def _register(self) -> None:
        if self._lease_id is not None:  # expired: etcd deleted the record with it
            logger.info("the lease of worker %s expired; registering anew", self.record.worker_id)
        lease = await self._session.call("lease", self.ttl_s)
        self._lease_id = lease.id
        await self._session.call("put", self.key, self.record.encode(), lease=lease.id)
        self._registered.set()
        logger.info(
            "worker %s registered in etcd at %s (lease %x, TTL %s s)",
            self.record.worker_id,
            self._session.endpoint,
            lease.id,
            self.ttl_s,
        )

    async def _refresh(self) -> bool:
        """Keep the lease alive; False when etcd says it has expired."""
        reply = await self._session.call("refresh_lease", self._lease_id)
        if reply is None or reply.TTL <= 0:
            return False
        self._registered.set()
        return True
