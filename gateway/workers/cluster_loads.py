"""Cluster mode on etcd: loading and unloading listening workers' models on demand, decided by the
leading gateway alone.

Runs in the gateway process, on its asyncio loop; started by the supervisor when a remote model is
`load: on_demand`, has `idle_unload_s` or an `exclusive_group`. Owns, on every gateway, this
gateway's wants (gateway.cluster.etcd_wants: a request waits for a model whose workers all stand
by), and, on the leader only, a round every `TICK_S`: read every gateway's wants and the workers'
states, ask gateway.workers.cluster_plan what to do, claim each decision once
(`decide_once`) and send the worker Load or Unload, and delete the decisions whose worker has
moved on to another standby period (cluster_plan.ended).

Exactly once: the claim is written before the message is sent, so a new leader never claims a
decision again. A claimed decision whose worker still stands in the same standby period (its
leader died between the claim and the send, or the frame was lost) is sent again, after
`RESEND_S` or at once by a new leader: the worker takes at most one Load per standby period and
ignores an Unload for another, so the model loads once whoever sends. A worker already loading or
ready counts as done; a new leader re-reads the wants and the states and goes on from there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from gateway.cluster.membership import Leader, WorkerRecord, cancel_and_wait, decide_once
from gateway.cluster.settings import ClusterConfig
from gateway.config.registry import Registry
from gateway.link.handle import WorkerHandle
from gateway.link.worker_link import WorkerLink
from gateway.workers.cluster_plan import Action, WorkerView, ended, plan
from wire import messages as wire

if TYPE_CHECKING:  # etcd's client is imported only where on-demand loads run, never on a single host
    from gateway.cluster.etcd_wants import EtcdWants

logger = logging.getLogger(__name__)

TICK_S = 0.5
RESEND_S = 5.0  # a decision sent by this leader that has not taken effect is sent again after this


def loads_on_demand(registry: Registry) -> bool:
    """Whether the leader has anything to load or unload: a remote model on demand, with an idle
    unload or in an exclusive group."""
    return any(
        m.remote and (m.load == "on_demand" or m.idle_unload_s is not None or m.exclusive_group is not None)
        for m in registry.models
    )


class ClusterLoads:
    def __init__(
        self,
        workers: dict[str, WorkerHandle],
        link: WorkerLink,
        leader: Leader,
        wants: EtcdWants,
        host_of: Callable[[str], str | None],
        grace_s: float,
    ) -> None:
        self._workers, self._leader, self._wants = workers, leader, wants
        self._host_of = host_of
        self._sender = DecisionSender(link, leader, grace_s)
        self._taken: dict[str, tuple[str, str]] = {}  # decision -> (worker, incarnation), until it ended
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def on_etcd(
        cls,
        cluster: ClusterConfig,
        workers: dict[str, WorkerHandle],
        link: WorkerLink,
        leader: Leader,
        members: Callable[[], Mapping[str, WorkerRecord]],
        grace_s: float,
    ) -> ClusterLoads:
        """Wants in the cluster's etcd; a worker's host is its advertised endpoint's (exclusive groups)."""
        from gateway.cluster.backends import identity
        from gateway.cluster.etcd_wants import EtcdWants

        assert cluster.etcd is not None

        wants = EtcdWants(cluster.etcd, identity(cluster))
        return cls(workers, link, leader, wants, host_finder(members), grace_s)

    async def start(self) -> None:
        await self._wants.start()
        self._task = asyncio.create_task(self._run(), name="cluster-loads")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        await self._wants.stop()

    def want(self, handle: WorkerHandle) -> None:
        """A request waits for `handle`'s model, and every worker of it stands by."""
        self._wants.want(handle.model.name)

    def satisfied(self, model: str) -> None:
        self._wants.satisfied(model)

    async def _run(self) -> None:
        from gateway.cluster.etcd_session import UNREACHABLE

        while True:
            await asyncio.sleep(TICK_S)
            if not self._leader.is_leader:
                self._sender.forget()  # a later leadership starts from what etcd and the workers say
                self._taken.clear()
                continue
            try:
                wanted = await self._wants.wanted()
            except UNREACHABLE as exc:
                logger.debug("wants not read: %s", exc)
                continue
            views = worker_views(self._workers, self._host_of)
            incarnations = {view.worker_id: view.incarnation for view in views}
            for action in plan(wanted, views):
                try:
                    await self._sender.act(action)
                except Exception:  # one failed decision must not end the rounds
                    logger.exception("decision %s failed", action.decision)
                else:
                    self._taken[action.decision] = (action.worker_id, incarnations[action.worker_id])
            await self._forget_ended(views)

    async def _forget_ended(self, views: list[WorkerView]) -> None:
        """Delete the decisions this leadership took (or found taken) once their worker has moved
        on. Those of a leader gone before its worker moved on stay behind: at most one per worker
        and handover."""
        for decision in ended(self._taken, views):
            try:
                await self._leader.forget(decision)
            except Exception as exc:  # etcd away: tried again next round
                logger.debug("decision %s not forgotten yet: %s", decision, exc)
                return
            del self._taken[decision]


def host_finder(members: Callable[[], Mapping[str, WorkerRecord]]) -> Callable[[str], str | None]:
    """A worker's host is its advertised endpoint's (exclusive groups); None: not a member."""

    def host_of(worker_id: str) -> str | None:
        record = members().get(worker_id)
        return record.endpoint[len("tcp://") :].rpartition(":")[0] if record is not None else None

    return host_of


def worker_views(
    workers: Mapping[str, WorkerHandle], host_of: Callable[[str], str | None]
) -> list[WorkerView]:
    """The listening workers of the membership, as the leader's plans see them."""
    views = []
    for handle in list(workers.values()):
        host = host_of(handle.id)
        if not handle.remote or handle.pid is None or host is None:
            continue
        model = handle.model
        views.append(
            WorkerView(
                worker_id=handle.id,
                model=model.name,
                state=handle.state,
                pid=handle.pid,
                epoch=handle.standby_epoch,
                host=host,
                replica=handle.replica,
                group=model.exclusive_group,
                idle_s=handle.load.idle_s if handle.load is not None else None,
                idle_unload_s=model.idle_unload_s,
            )
        )
    return views


class DecisionSender:
    """The leader's hand: claims a decision once and sends its Load or Unload, and sends again one
    that was claimed before and has not taken effect (after RESEND_S by this leader, at once by a
    new one)."""

    def __init__(self, link: WorkerLink, leader: Leader, grace_s: float) -> None:
        self._link, self._leader, self._grace_s = link, leader, grace_s
        self._sent: dict[str, float] = {}  # decisions this gateway sent, when (resent after RESEND_S)

    def forget(self) -> None:
        self._sent.clear()

    async def act(self, action: Action) -> None:
        now = time.monotonic()
        self._sent = {d: at for d, at in self._sent.items() if now - at < 20 * RESEND_S}

        async def send() -> bool:
            logger.info("decided: %s %s (%s)", action.kind, action.worker_id, action.why)
            return self._send(action)

        claimed = await decide_once(self._leader, action.decision, send)
        if claimed is not None or not self._leader.is_leader:
            return
        # Claimed before (by this gateway, or a leader since gone) and not yet in effect.
        sent_at = self._sent.get(action.decision)
        if sent_at is None or time.monotonic() - sent_at >= RESEND_S:
            logger.info(
                "decision %s was claimed before and %s has not acted on it yet: sent again "
                "(the worker acts once per standby period)",
                action.decision, action.worker_id,
            )  # fmt: skip
            self._send(action)

    def _send(self, action: Action) -> bool:
        self._sent[action.decision] = time.monotonic()
        message: wire.Message = (
            wire.Load(action.epoch) if action.kind == "load" else wire.Unload(self._grace_s, action.epoch)
        )
        return self._link.send(action.worker_id, message)
