"""Leader election on an etcd lease: one gateway holds PREFIX/leader, the others wait for it to go.

Runs in the gateway process, on its asyncio loop. Owns `EtcdLeader`, one implementation of
`gateway.cluster.membership.Leader` (its term, step-down timer and task are kept by its base,
`gateway.cluster.backend_base.CampaigningLeader`), its etcd session and its lease.

- Campaign: grant a lease, then one transaction: if PREFIX/leader does not exist, put it (value:
  this gateway's identity) on that lease. The put's revision is the leadership's *term*, a
  fencing token: it changes whenever the key is created anew.
- Hold: refresh the lease every third of its TTL. A timer fires `leader_ttl_s - margin` after the
  last refresh that etcd confirmed was *sent*: if it fires, this gateway steps down, before etcd
  can expire the lease and another take over (etcd's expiry counts from when it received that
  refresh, which is later). A watch on the key steps down at once if it is deleted.
- Wait: a follower watches the key from the revision it saw it at, and campaigns again when it is
  deleted (resigned, or its lease expired).
- Holder: PREFIX/leader's value, read afresh; the key lives on its holder's lease, so it is there
  exactly while a leadership is live (etcd deletes it when the lease expires).
- Claim: a transaction that puts PREFIX/decisions/NAME only if the key does not exist *and*
  PREFIX/leader still has this term; so a decision is taken exactly once, and never by a leader
  that was deposed without knowing it yet.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aetcd.exceptions

from gateway.cluster.backend_base import CampaigningLeader
from gateway.cluster.etcd_session import UNREACHABLE, EtcdSession
from gateway.cluster.membership import HolderUnknown, cancel_and_wait
from gateway.cluster.settings import EtcdSettings

logger = logging.getLogger(__name__)

_TROUBLE = (*UNREACHABLE, aetcd.exceptions.ClientError)


class EtcdLeader(CampaigningLeader):
    _task_name = "etcd-leader"

    def __init__(
        self,
        settings: EtcdSettings,
        identity: str,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        super().__init__(identity, on_change)
        self._ttl_s = settings.leader_ttl_s
        # Step down this long before the lease could expire: a refresh in flight and the loop's own lag.
        self._margin_s = min(settings.request_timeout_s, settings.leader_ttl_s / 4)
        self._retry_interval_s = settings.retry_interval_s
        self._key = f"{settings.prefix}leader".encode()
        self._decisions = f"{settings.prefix}decisions/"
        self._session = EtcdSession(settings.endpoints, settings.request_timeout_s)
        self._lease_id: int | None = None
        self._lost = asyncio.Event()

    # -- Leader -------------------------------------------------------------------------------------

    async def _release(self, term: int | None) -> None:
        lease_id = self._lease_id
        if lease_id is not None:
            try:
                if term is not None:  # delete the key first: followers take over at once
                    await self._session.call(
                        "transaction",
                        compare=[self._tx.create(self._key) == term],
                        success=[self._tx.delete(self._key)],
                        failure=[],
                    )
                await self._session.call("revoke_lease", lease_id)
            except _TROUBLE as exc:
                logger.warning(
                    "could not resign in etcd (%s): the lease expires within %s s", exc, self._ttl_s
                )
            self._lease_id = None

    async def _close(self) -> None:
        await self._session.close()

    async def holder(self) -> str | None:
        # A task of its own: when the campaign finds etcd unreachable it closes the shared client,
        # which cancels this read; that must read as "unknown", not as this caller being cancelled.
        reading = asyncio.create_task(self._session.call("get", self._key), name="etcd-leader-holder")
        try:
            await asyncio.wait({reading})
        except asyncio.CancelledError:
            reading.cancel()
            raise
        if reading.cancelled():
            raise HolderUnknown(f"the read from etcd {self._session.endpoint} was cut short (reconnecting)")
        error = reading.exception()
        if isinstance(error, _TROUBLE):
            raise HolderUnknown(f"etcd {self._session.endpoint} did not answer: {error}") from error
        found = reading.result()  # raises any other error
        return found.value.decode(errors="replace") if found is not None else None

    async def claim(self, decision: str) -> bool:
        term = self._term
        if term is None:
            return False
        key = f"{self._decisions}{decision}".encode()
        try:
            succeeded, _ = await self._session.call(
                "transaction",
                compare=[self._tx.create(self._key) == term, self._tx.create(key) == 0],
                success=[self._tx.put(key, f"{self._identity} term {term}".encode())],
                failure=[],
            )
        except _TROUBLE as exc:
            # Unknown whether it was applied; "not claimed" is the safe answer (at most once).
            logger.warning("decision %s not claimed: etcd did not answer (%s)", decision, exc)
            return False
        logger.info(
            "decision %s %s by %s", decision, "claimed" if succeeded else "not claimed", self._identity
        )
        return bool(succeeded)

    async def forget(self, decision: str) -> None:
        await self._session.call("delete", f"{self._decisions}{decision}".encode())

    # -- campaigning --------------------------------------------------------------------------------

    @property
    def _tx(self) -> aetcd.client.Transactions:
        return self._session.client.transactions

    async def _campaign(self) -> None:
        while True:
            try:
                seen_at = await self._try_once()
                if seen_at is None:
                    await self._hold()
                else:
                    await self._wait_for_vacancy(seen_at)
            except _TROUBLE as exc:
                if self.is_leader:
                    logger.warning("etcd unreachable at %s (%s) while leading", self._session.endpoint, exc)
                else:
                    logger.debug("campaign: etcd %s: %s", self._session.endpoint, exc)
                await self._session.failed(exc)
                await asyncio.sleep(self._retry_interval_s)

    async def _try_once(self) -> int | None:
        """Become leader (None), or the revision at which another leader's key was seen."""
        if self._lease_id is not None and not self.is_leader:
            await self._drop_lease()  # a deposed leader's: it may have expired meanwhile
        if self._lease_id is None:
            lease = await self._session.call("lease", self._ttl_s)
            self._lease_id = lease.id
        sent = asyncio.get_running_loop().time()
        try:
            succeeded, responses = await self._session.call(
                "transaction",
                compare=[self._tx.create(self._key) == 0],
                success=[self._tx.put(self._key, self._identity.encode(), lease=self._lease_id)],
                failure=[self._tx.get(self._key)],
            )
        except aetcd.exceptions.ClientError as exc:
            if "lease not found" not in str(exc):
                raise
            # A leader back from an outage longer than its lease: its key is gone with the lease.
            self._lease_id = None
            self._step_down("its lease expired")
            return await self._try_once()
        if succeeded:
            self._become_leader(int(responses[0].response_put.header.revision), sent)
            return None
        ((holder, kv),) = responses[0]
        if kv.lease == self._lease_id:  # ours already: a reply lost on the way, then a retry
            self._become_leader(int(kv.create_revision), sent)
            return None
        logger.debug("%s leads (since revision %s)", holder.decode(errors="replace"), kv.create_revision)
        return int(kv.header.revision)

    async def _drop_lease(self) -> None:
        lease_id, self._lease_id = self._lease_id, None
        if lease_id is not None:
            await self._session.call("revoke_lease", lease_id)

    async def _wait_for_vacancy(self, seen_at: int) -> None:
        # Our lease is not needed while following: let it go, a new one is granted at the next try.
        await self._drop_lease()
        watch = await asyncio.wait_for(
            self._session.client.watch(self._key, start_revision=seen_at + 1),
            self._session.request_timeout_s,
        )
        try:
            async for event in watch:
                if event.kind == aetcd.EventKind.DELETE:
                    return
        finally:
            await self._cancel(watch)
        raise aetcd.exceptions.ConnectionFailedError("the watch stream ended")

    async def _hold(self) -> None:
        """Keep the lease alive until leadership is lost (the timer, a deleted key, an expired lease)."""
        watch = await asyncio.wait_for(
            self._session.client.watch(self._key, start_revision=self._term),
            self._session.request_timeout_s,
        )
        watcher = asyncio.create_task(self._watch_own_key(watch), name="etcd-leader-key")
        lost = asyncio.create_task(self._lost.wait(), name="etcd-leader-lost")
        refresher = asyncio.create_task(self._keep_alive(), name="etcd-leader-keepalive")
        tasks = (watcher, lost, refresher)
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not lost and task.exception() is not None and self.is_leader:
                    # etcd failing while leading: keep refreshing (the timer decides), campaign again.
                    raise task.exception()  # type: ignore[misc]
        finally:
            for task in tasks:
                await cancel_and_wait(task)
            await self._cancel(watch)
        self._step_down("lost the leadership")

    async def _watch_own_key(self, watch: aetcd.Watch) -> None:
        async for event in watch:
            if event.kind == aetcd.EventKind.DELETE or event.kv.create_revision != self._term:
                self._step_down("the leader key was deleted")
                return
        raise aetcd.exceptions.ConnectionFailedError("the watch stream ended")

    async def _keep_alive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:  # refresh first: after a reconnection the last refresh may be old already
            sent = loop.time()
            reply = await self._session.call("refresh_lease", self._lease_id)
            if reply is None or reply.TTL <= 0:
                self._lease_id = None
                self._step_down("its lease expired")
                return
            self._arm_timer(sent)
            await asyncio.sleep(self._ttl_s / 3)

    # -- state ----------------------------------------------------------------------------------------

    def _become_leader(self, term: int, sent: float) -> None:
        self._arm_timer(sent)
        if self._term == term:  # still leading: etcd was back before the timer ran out
            return
        self._lost.clear()
        self._begin_term(term, f"term {term}, lease TTL {self._ttl_s} s")

    def _arm_timer(self, refreshed_at: float) -> None:
        self._arm_step_down(
            refreshed_at + self._ttl_s - self._margin_s, "its lease could not be refreshed in time"
        )

    def _step_down(self, why: str) -> None:
        if self.is_leader:
            self._lost.set()  # ends _hold
        super()._step_down(why)

    async def _cancel(self, watch: aetcd.Watch) -> None:
        try:
            await asyncio.wait_for(watch.cancel(), self._session.request_timeout_s)
        except _TROUBLE:
            pass  # the stream is gone already
