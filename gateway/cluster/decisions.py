"""The decisions one gateway of the cluster takes for all: gated on leadership, taken exactly once.

Runs in the gateway process, on its asyncio loop; started with cluster mode when the backend has a
leader (etcd or Kubernetes; a static list has none, and then every gateway decides for itself).
Owns this gateway's `Leader` (gateway.cluster.backends) and the wait for it.

What is gated: in cluster mode gateways spawn no worker (every model is `remote: true`, served by
workers that are services of their own). Decided once for the whole cluster, each under a claim
that etcd (or the API server) grants to one caller ever:

- retiring a listening worker (`POST /admin/workers/{id}/retire`): it stops for every gateway, so
  exactly one gateway, the leader, sends it `Retire` (here);
- with etcd, loading a standby worker's model on demand, unloading it when idle, and swapping the
  models of an exclusive group on a host (`Load`, `Unload`): the leader decides them from every
  gateway's wants and the workers' states (gateway.workers.cluster_loads, with this gateway's
  `Leader`), so no model is loaded twice by two gateways;
- with etcd, restarting listening workers in place for a registry reload that changes what they
  read (gateway.workers.cluster_reloads): any gateway asks, the leader restarts each worker once,
  one replica of a model at a time. The reload's other changes (routes, queues, aliases) are each
  gateway's own: every gateway applies them when it is reloaded itself.

A decision asked of a follower first asks the backend who leads (`Leader.holder`). While another
gateway holds a live leadership it is refused at once with 409 `not_leader`, naming that gateway,
so the operator knows where to send it. Only while no gateway leads (the leader's lease ran out
and a takeover is due), or when the backend cannot be read, does it wait for this gateway to take
over, up to a handover's length (`handover_s`), and then take it or refuse it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gateway.cluster.membership import HolderUnknown, Leader, decide_once
from gateway.cluster.settings import ClusterConfig

logger = logging.getLogger(__name__)


class Outcome(enum.Enum):
    DONE = "done"  # this gateway leads, claimed the decision and acted
    ALREADY_DECIDED = "already_decided"  # someone claimed it before (now, or before a handover)
    NOT_LEADER = "not_leader"  # another gateway leads, or none took over in time


@dataclass(frozen=True)
class Verdict:
    """What became of a decision, and, when refused, the gateway that leads instead (None: none
    did, or the backend could not say)."""

    outcome: Outcome
    leader: str | None = None


LeaderFactory = Callable[[ClusterConfig, Callable[[bool], None]], Leader]


class Decisions:
    def __init__(self, config: ClusterConfig, make_leader: LeaderFactory | None = None) -> None:
        """`make_leader`: the backend's (gateway.cluster.backends) unless a test passes its own."""
        if make_leader is None:
            from gateway.cluster import backends

            make_leader = backends.make_leader
        self._leading = asyncio.Event()
        self.leader: Leader = make_leader(config, self._on_change)
        # How long a decision waits for a leader: a handover takes at most the lease's TTL.
        if config.backend == "etcd":
            assert config.etcd is not None
            # etcd finds an expired lease within half a second; the follower's watch then campaigns.
            self.handover_s: float = config.etcd.leader_ttl_s + 1.0 + config.etcd.retry_interval_s
        else:
            k8s = config.kubernetes_settings()
            self.handover_s = k8s.lease_duration_s + 2 * k8s.retry_period_s

    def _on_change(self, leading: bool) -> None:
        logger.info("this gateway %s", "leads the cluster now" if leading else "no longer leads")
        if leading:
            self._leading.set()
        else:
            self._leading.clear()

    async def start(self) -> None:
        await self.leader.start()

    async def stop(self) -> None:
        await self.leader.stop()

    async def decide(self, decision: str, action: Callable[[], Awaitable[Any]]) -> Verdict:
        """Run `action` if this gateway leads and is the first ever to claim `decision`. A follower
        refuses at once while another gateway leads, and waits up to a handover for this one to
        lead only while none does."""
        if not self.leader.is_leader:
            holder = await self._holder()
            if holder is not None and holder != self.leader.identity:
                return Verdict(Outcome.NOT_LEADER, holder)
            try:
                await asyncio.wait_for(self._leading.wait(), self.handover_s)
            except asyncio.TimeoutError:
                return Verdict(Outcome.NOT_LEADER, await self._holder())
        done = False

        async def act() -> None:
            nonlocal done
            await action()
            done = True

        await decide_once(self.leader, decision, act)
        if done:
            logger.info("decision %s taken by this gateway", decision)
            return Verdict(Outcome.DONE)
        if self.leader.is_leader:
            return Verdict(Outcome.ALREADY_DECIDED)
        return Verdict(Outcome.NOT_LEADER, await self._holder())  # deposed while deciding

    async def _holder(self) -> str | None:
        """Who leads now, as the backend says; None when no one does or it cannot be read (then the
        caller waits, as it would for a takeover)."""
        try:
            return await self.leader.holder()
        except HolderUnknown as exc:
            logger.warning("who leads the cluster is unknown (%s): waiting for a takeover", exc)
            return None

    def view(self) -> dict[str, Any]:
        return {"identity": self.leader.identity, "leader": self.leader.is_leader}
