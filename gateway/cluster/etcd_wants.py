"""Which models the gateways of a cluster want loaded: one etcd key per model and gateway, on the
gateway's own lease, so the wants of a gateway that dies vanish with it.

Runs in the gateway process, on its asyncio loop. Owns `EtcdWants`: this gateway's wants (a model
with requests waiting and no replica loaded or loading, only a standby worker) written under
`PREFIX/wants/MODEL/IDENTITY` on a lease it keeps alive, and deleted once the model is ready here;
and the reading of every gateway's wants, for the leader (gateway.workers.cluster_loads), which
decides the loads. A want is a wish, not a decision: several gateways may want one model, and the
leader loads it once.

One background task writes what is wanted and refreshes the lease every third of its TTL (the
leader's `leader_ttl_s`). When etcd cannot be reached it retries every `retry_interval_s`; a lease
that expired meanwhile is granted anew and every current want written again.
"""

from __future__ import annotations

import asyncio
import logging

import aetcd.exceptions

from gateway.cluster.etcd_session import UNREACHABLE, EtcdSession
from gateway.cluster.membership import cancel_and_wait
from gateway.cluster.settings import EtcdSettings

logger = logging.getLogger(__name__)

_TROUBLE = (*UNREACHABLE, aetcd.exceptions.ClientError)


class EtcdWants:
    def __init__(self, settings: EtcdSettings, identity: str) -> None:
        self._identity = identity
        self._prefix = f"{settings.prefix}wants/"
        self._ttl_s = settings.leader_ttl_s
        self._retry_interval_s = settings.retry_interval_s
        self._session = EtcdSession(settings.endpoints, settings.request_timeout_s)
        self._reader = EtcdSession(settings.endpoints, settings.request_timeout_s)
        self._wanted: set[str] = set()  # what this gateway wants now
        self._written: set[str] = set()  # what etcd holds of it, on the current lease
        self._lease_id: int | None = None
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="etcd-wants")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        lease_id, self._lease_id = self._lease_id, None
        if lease_id is not None:
            try:  # this gateway's wants go with it at once, not after the TTL
                await self._session.call("revoke_lease", lease_id)
            except _TROUBLE as exc:
                logger.debug("revoking the wants' lease: %s", exc)
        await self._session.close()
        await self._reader.close()

    def want(self, model: str) -> None:
        """Requests for `model` wait and it has only standby workers: ask the leader to load one."""
        if model not in self._wanted:
            self._wanted.add(model)
            logger.info("model %s wanted: asking the leading gateway to load it", model)
            self._changed.set()

    def satisfied(self, model: str) -> None:
        """`model` is ready here: the want is withdrawn."""
        if model in self._wanted:
            self._wanted.discard(model)
            self._changed.set()

    async def wanted(self) -> set[str]:
        """Every model some gateway wants now (the leader's round); raises when etcd does not answer."""
        prefix = self._prefix.encode()
        try:
            listing = await self._reader.call("get_prefix", prefix)
        except _TROUBLE as exc:
            await self._reader.failed(exc)
            raise
        models = set()
        for kv in listing:
            model, _, _gateway = kv.key[len(prefix) :].decode(errors="replace").rpartition("/")
            if model:
                models.add(model)
        return models

    def _key(self, model: str) -> bytes:
        return f"{self._prefix}{model}/{self._identity}".encode()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_refresh = 0.0
        while True:
            # Cleared before the writes: a want that comes while they wait on etcd is seen next turn.
            self._changed.clear()
            try:
                if self._lease_id is None:
                    self._lease_id = (await self._session.call("lease", self._ttl_s)).id
                    self._written.clear()
                    next_refresh = loop.time() + self._ttl_s / 3
                elif loop.time() >= next_refresh:
                    reply = await self._session.call("refresh_lease", self._lease_id)
                    next_refresh = loop.time() + self._ttl_s / 3
                    if reply is None or reply.TTL <= 0:  # expired while etcd was away: start again
                        self._lease_id = None
                        continue
                await self._write()
            except _TROUBLE as exc:
                logger.debug("wants: etcd %s: %s", self._session.endpoint, exc)
                await self._session.failed(exc)
                await asyncio.sleep(self._retry_interval_s)
                continue
            try:
                await asyncio.wait_for(self._changed.wait(), max(next_refresh - loop.time(), 0.0))
            except asyncio.TimeoutError:
                pass

    async def _write(self) -> None:
        for model in sorted(self._wanted - self._written):
            await self._session.call("put", self._key(model), self._identity.encode(), lease=self._lease_id)
            self._written.add(model)
        for model in sorted(self._written - self._wanted):
            await self._session.call("delete", self._key(model))
            self._written.discard(model)
