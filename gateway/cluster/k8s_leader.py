"""Leader election on a Kubernetes Lease (coordination.k8s.io/v1), the way client-go does it.

Runs in the gateway process, on its asyncio loop. Owns `LeaseLeader`, one implementation of
`gateway.cluster.membership.Leader` (its term, step-down timer and task are kept by its base,
`gateway.cluster.backend_base.CampaigningLeader`), and the leader Lease as this gateway last saw it.

Every `retry_period_s` each gateway reads the Lease:
- nobody holds it (absent, or no holderIdentity): take it (create, or replace);
- another holds it: take it over only when its record (holder, renewTime, resourceVersion) has
  not changed for `lease_duration_s` as measured on *this* gateway's clock since it last saw it
  change; renewTime is never compared with local time, so skewed clocks do not matter;
- this gateway holds it: renew (renewTime = now).
Every write is a replace carrying the resourceVersion read, so two gateways racing get one 200
and one 409 Conflict; the loser stays a follower. A leader that has not renewed for
`renew_deadline_s` (below the lease duration) steps down on a timer, before anyone may take over.
Resigning writes an empty holder, so a follower takes over at its next read. A leadership's term is
the Lease's leaseTransitions when it began.

Holder (who leads now, for a decision asked of a follower): the Lease read afresh; its
holderIdentity, or none when it is empty or renewTime + leaseDurationSeconds has passed. This one
place compares renewTime with this gateway's clock: it only chooses between refusing a decision at
once and waiting for a takeover, never who takes over, so a skewed clock can cost a needless wait
or an early refusal, never a second leader.

Decisions: `claim` creates a Lease named after the decision; creation is atomic (409 AlreadyExists
for every later caller), so a decision is claimed once. Unlike etcd there is no transaction
across two objects, so the claim is not fenced by the leadership term: a leader deposed a moment
ago (before its own timer ran out) could still claim a decision nobody has claimed yet, once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease

from gateway.cluster.backend_base import CampaigningLeader
from gateway.cluster.k8s_membership import API_TROUBLE, api_client
from gateway.cluster.membership import HolderUnknown
from gateway.cluster.settings import KubernetesSettings

logger = logging.getLogger(__name__)

DECISION_ANNOTATION = "llm-gateway.io/decision"


class LeaseLeader(CampaigningLeader):
    _task_name = "k8s-leader"

    def __init__(
        self,
        settings: KubernetesSettings,
        identity: str,
        on_change: Callable[[bool], None] | None = None,
        client: AsyncClient | None = None,
    ) -> None:
        super().__init__(identity, on_change)
        self._settings = settings
        self._client = client if client is not None else api_client(settings)
        self._owns_client = client is None
        self._lease: Lease | None = None  # as last read or written
        self._observed: tuple[str | None, datetime | None, str | None] | None = None
        self._observed_at = 0.0  # loop time at which _observed last changed

    # -- Leader -------------------------------------------------------------------------------------

    async def _release(self, term: int | None) -> None:
        lease = self._lease
        if term is not None and lease is not None and lease.spec is not None:
            lease.spec.holderIdentity = None
            lease.spec.renewTime = _now()
            try:
                await self._client.replace(lease)
            except API_TROUBLE as exc:
                logger.warning(
                    "could not release the Lease (%s): it is taken over after %s s",
                    exc,
                    self._settings.lease_duration_s,
                )

    async def _close(self) -> None:
        if self._owns_client:
            await self._client.close()

    async def holder(self) -> str | None:
        try:
            lease = await asyncio.wait_for(
                self._client.get(Lease, self._settings.lease_name, namespace=self._settings.namespace),
                self._settings.request_timeout_s,
            )
        except ApiError as exc:
            if exc.status.code == 404:  # never created: nobody has led yet
                return None
            raise HolderUnknown(f"the Lease could not be read: {exc}") from exc
        except API_TROUBLE as exc:
            raise HolderUnknown(f"the API did not answer: {exc}") from exc
        spec = lease.spec or LeaseSpec()
        if not spec.holderIdentity:
            return None
        duration = timedelta(seconds=spec.leaseDurationSeconds or self._settings.lease_duration_s)
        if spec.renewTime is not None and spec.renewTime + duration <= _now():
            return None  # not renewed in time: the holder is gone, a takeover is due
        return spec.holderIdentity

    async def claim(self, decision: str) -> bool:
        if not self.is_leader:
            return False
        digest = hashlib.sha256(decision.encode()).hexdigest()[:20]
        record = Lease(
            metadata=ObjectMeta(
                name=f"{self._settings.lease_name}-d-{digest}",
                namespace=self._settings.namespace,  # None: the client's (the pod's) namespace
                annotations={DECISION_ANNOTATION: decision},
            ),
            spec=LeaseSpec(holderIdentity=self._identity, acquireTime=_now()),
        )
        try:
            await self._client.create(record)
        except ApiError as exc:
            if exc.status.code == 409:
                logger.info("decision %s not claimed: taken already", decision)
                return False
            raise
        except API_TROUBLE as exc:
            logger.warning("decision %s not claimed: the API did not answer (%s)", decision, exc)
            return False
        logger.info("decision %s claimed by %s", decision, self._identity)
        return True

    async def forget(self, decision: str) -> None:
        digest = hashlib.sha256(decision.encode()).hexdigest()[:20]
        try:
            await self._client.delete(
                Lease, f"{self._settings.lease_name}-d-{digest}", namespace=self._settings.namespace
            )
        except ApiError as exc:
            if exc.status.code != 404:
                raise

    # -- campaigning --------------------------------------------------------------------------------

    async def _campaign(self) -> None:
        while True:
            try:
                await self._try_once()
            except API_TROUBLE as exc:
                logger.debug("Lease %s: %s", self._settings.lease_name, exc)
            await asyncio.sleep(self._settings.retry_period_s)

    async def _try_once(self) -> None:
        loop = asyncio.get_running_loop()
        sent = loop.time()
        try:
            lease = await self._client.get(
                Lease, self._settings.lease_name, namespace=self._settings.namespace
            )
        except ApiError as exc:
            if exc.status.code != 404:
                raise
            await self._create(sent)
            return
        spec = lease.spec or LeaseSpec()
        observed = (
            spec.holderIdentity,
            spec.renewTime,
            lease.metadata.resourceVersion if lease.metadata else None,
        )
        if observed != self._observed:
            self._observed, self._observed_at = observed, sent
        self._lease = lease
        if spec.holderIdentity == self._identity:  # ours (also after a restart, as client-go does)
            spec.renewTime = _now()
            await self._write(lease, sent, spec.leaseTransitions or 0)
        elif not spec.holderIdentity or sent - self._observed_at >= (
            spec.leaseDurationSeconds or self._settings.lease_duration_s
        ):
            transitions = (spec.leaseTransitions or 0) + (1 if spec.holderIdentity != self._identity else 0)
            now = _now()
            lease.spec = LeaseSpec(
                holderIdentity=self._identity,
                leaseDurationSeconds=self._settings.lease_duration_s,
                acquireTime=now,
                renewTime=now,
                leaseTransitions=transitions,
            )
            await self._write(lease, sent, transitions)
        elif self.is_leader:  # someone else holds it: we lost it without noticing
            self._step_down(f"the Lease is held by {spec.holderIdentity}")

    async def _create(self, sent: float) -> None:
        now = _now()
        lease = Lease(
            metadata=ObjectMeta(name=self._settings.lease_name, namespace=self._settings.namespace),
            spec=LeaseSpec(
                holderIdentity=self._identity,
                leaseDurationSeconds=self._settings.lease_duration_s,
                acquireTime=now,
                renewTime=now,
                leaseTransitions=0,
            ),
        )
        try:
            self._lease = await self._client.create(lease)
        except ApiError as exc:
            if exc.status.code == 409:  # another gateway created it first
                return
            raise
        self._won(0, sent)

    async def _write(self, lease: Lease, sent: float, term: int) -> None:
        """Replace with the resourceVersion read: 409 means someone wrote in between."""
        try:
            self._lease = await self._client.replace(lease)
        except ApiError as exc:
            if exc.status.code == 409:
                logger.debug("Lease %s changed while writing it: not ours", self._settings.lease_name)
                return
            raise
        self._won(term, sent)

    # -- state ----------------------------------------------------------------------------------------

    def _won(self, term: int, sent: float) -> None:
        """The Lease is ours as of `sent` (when the read that led to this write was sent)."""
        self._arm_step_down(sent + self._settings.renew_deadline_s, "the Lease was not renewed in time")
        if self._term is None:
            self._begin_term(term, f"Lease {self._settings.lease_name}, transition {term}")


def _now() -> datetime:
    return datetime.now(timezone.utc)
