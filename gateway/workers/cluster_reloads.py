"""Cluster mode on etcd: a registry reload that changes what workers read, carried out once, by the
leading gateway, one replica at a time.

Runs in the gateway process, on its asyncio loop; started by the supervisor on the etcd backend.
Owns, on every gateway, asking for such a reload (`ask`: gateway.reloads calls it when a reload
changes a remote model's worker settings; the request goes to etcd, gateway.cluster.etcd_reloads,
whichever gateway leads), and, on the leader only, a round every `TICK_S`: take the oldest
pending reload, read its claims, ask gateway.workers.reload_plan for the next steps, claim each
and send it (Unload, then Load, through gateway.workers.cluster_loads' `DecisionSender`), and
record it finished when every worker it named is ready again.

A leader that dies mid-reload leaves the request and its claims in etcd; the next leader's first
round reads them and goes on from the worker being restarted, restarting none twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from gateway.cluster.etcd_reloads import TROUBLE, EtcdReloads
from gateway.cluster.membership import Leader, WorkerRecord, cancel_and_wait
from gateway.cluster.reload_request import ReloadRequest
from gateway.cluster.settings import EtcdSettings
from gateway.config.models import ModelConfig
from gateway.errors import ServiceUnavailable
from gateway.link.handle import WorkerHandle
from gateway.link.worker_link import WorkerLink
from gateway.workers.cluster_loads import TICK_S, DecisionSender, host_finder, worker_views
from gateway.workers.reload_plan import fingerprint, incarnation, next_steps
from wire.states import WorkerState

logger = logging.getLogger(__name__)


class ClusterReloads:
    def __init__(
        self,
        settings: EtcdSettings,
        workers: dict[str, WorkerHandle],
        link: WorkerLink,
        leader: Leader,
        members: Callable[[], Mapping[str, WorkerRecord]],
        grace_s: float,
    ) -> None:
        self._workers, self._leader = workers, leader
        self._host_of = host_finder(members)
        self._reloads = EtcdReloads(settings)
        self._sender = DecisionSender(link, leader, grace_s)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="cluster-reloads")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        await self._reloads.close()

    async def ask(self, changed: Mapping[str, ModelConfig]) -> dict[str, object]:
        """Ask the leader to restart the loaded workers of `changed` (their new settings) in place;
        ServiceUnavailable when etcd does not answer (then nothing is asked, nothing changes)."""
        fp = fingerprint(changed)
        views = worker_views(self._workers, self._host_of)
        try:
            done_before = await self._reloads.applied(fp)
            loaded = {
                v.worker_id: incarnation(v)
                for v in views
                if v.model in changed and v.state is WorkerState.READY
                and done_before.get(v.worker_id) != incarnation(v)
            }  # fmt: skip
            request = ReloadRequest(fp, tuple(sorted(changed)), loaded, self._leader.identity)
            if loaded:
                request = await self._reloads.ask(request)
            leader = await self._reloads.leader()
        except TROUBLE as exc:
            raise ServiceUnavailable(
                f"etcd did not answer ({type(exc).__name__}); the reload, which the cluster's leader "
                "carries out for the workers, was not asked for: nothing changed, try again"
            ) from None
        if loaded:
            logger.info(
                "reload %s of models %s asked of the leading gateway (%s): %d worker(s) to restart",
                fp, ", ".join(request.models), leader, len(request.workers),
            )  # fmt: skip
        return {
            "fingerprint": fp,
            "models": list(request.models),
            "workers": sorted(request.workers),
            "asked_by": request.by,
            "leader": leader,
            "decided_by": "the leading gateway, one replica at a time",
        }

    async def progress(self, asked: dict[str, object]) -> str:
        """Where a reload this gateway asked for (`ask`'s answer) stands: `restarting` while the
        leader restarts its workers, `applied` once it recorded them all ready again."""
        if not asked["workers"]:
            return "applied"
        try:
            finished = await self._reloads.finished(str(asked["fingerprint"]))
        except TROUBLE:
            return "unknown (etcd did not answer)"
        return "applied" if finished else "restarting"

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            if not self._leader.is_leader:
                self._sender.forget()
                continue
            try:
                await self._round()
            except TROUBLE as exc:
                logger.debug("reloads not read: %s", exc)
            except Exception:  # one failed round must not end the rounds
                logger.exception("a reload round failed")

    async def _round(self) -> None:
        pending = await self._reloads.pending()
        if not pending:
            return
        request = pending[0]  # one reload at a time, in the order they were asked for
        claimed = await self._reloads.claimed(request.fingerprint)
        steps = next_steps(request, claimed, worker_views(self._workers, self._host_of))
        for action in steps.actions:
            await self._sender.act(action)
        if steps.finished is not None and self._leader.is_leader:
            await self._reloads.finish(request, steps.finished, self._leader.identity)
            logger.info(
                "reload %s applied: model(s) %s, worker(s) restarted: %s",
                request.fingerprint, ", ".join(request.models),
                ", ".join(sorted(steps.finished)) or "none",
            )  # fmt: skip
