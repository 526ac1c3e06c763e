"""What the leading gateway should load and unload now, from the wants and the workers' states.

Runs in the gateway process (called by gateway.workers.cluster_loads on the leader, every round);
pure: no I/O, no clock. Owns the rules, and the name of each decision, which etcd lets one leader
claim once, ever:

- a wanted model with no worker loading or ready gets one of its standby workers loaded
  (`load/WORKER/PID-EPOCH`: a worker's standby period is named by its process and its count, so a
  worker unloaded and wanted again is a new decision);
- exclusive groups: before a worker of group G loads on a host, the ready workers of G's other
  models on that host are unloaded (`unload/WORKER/PID-EPOCH`), and the load waits until none of
  them holds its model any more (draining, or loading for another want, is waited for). Of two
  wanted models of one group on one host, one loads per round, the first by name;
- idle unloads: a ready worker of a model with `idle_unload_s` that has held no job of any gateway
  for that long (its own count, in its heartbeats), and that no gateway wants now, is unloaded.

And which of the decisions taken have `ended`: their worker has moved on, so the leader deletes
them (every load and unload would otherwise leave its key in etcd for good).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from wire.states import WorkerState

S = WorkerState
HOLDS_MODEL = frozenset({S.STARTING, S.LOADING, S.WARMING, S.READY, S.DRAINING})
LOADED_OR_LOADING = frozenset({S.STARTING, S.LOADING, S.WARMING, S.READY})


@dataclass(frozen=True)
class WorkerView:
    """One listening worker as the leader sees it."""

    worker_id: str
    model: str
    state: WorkerState
    pid: int
    epoch: int  # its standby period (the one its model was loaded from, while loaded)
    host: str
    replica: int = 0
    group: str | None = None  # its model's exclusive_group
    idle_s: float | None = None  # no job for this long, as of its last heartbeat
    idle_unload_s: float | None = None  # its model's

    @property
    def incarnation(self) -> str:
        """Its process and standby period: a decision about it is named after this."""
        return f"{self.pid}-{self.epoch}"


@dataclass(frozen=True)
class Action:
    kind: Literal["load", "unload"]
    worker_id: str
    epoch: int
    why: str
    decision: str


def _action(kind: Literal["load", "unload"], worker: WorkerView, why: str) -> Action:
    decision = f"{kind}/{worker.worker_id}/{worker.incarnation}"
    return Action(kind, worker.worker_id, worker.epoch, why, decision)


def plan(wanted: set[str], workers: list[WorkerView]) -> list[Action]:
    actions: dict[str, Action] = {}
    swapping: set[tuple[str, str]] = set()  # (host, group) acted on this round
    for model in sorted(wanted):
        mine = [w for w in workers if w.model == model]
        if any(w.state in LOADED_OR_LOADING for w in mine):
            continue  # loaded or on its way: nothing to decide
        standby = [w for w in mine if w.state is S.UNLOADED]
        if not standby:
            continue

        def in_the_way(worker: WorkerView) -> list[WorkerView]:
            return [
                p
                for p in workers
                if worker.group is not None
                and p.group == worker.group
                and p.host == worker.host
                and p.model != worker.model
                and p.state in HOLDS_MODEL
            ]

        # A host whose group has nothing to unload first, then the lowest replica.
        chosen = min(standby, key=lambda w: (len(in_the_way(w)), w.replica, w.worker_id))
        if chosen.group is not None:
            place = (chosen.host, chosen.group)
            if place in swapping:
                continue  # another wanted model of the group goes first on this host
            swapping.add(place)
            peers = in_the_way(chosen)
            if peers:
                why = f"exclusive group {chosen.group}: {model} is wanted on {chosen.host}"
                for peer in peers:
                    if peer.state is S.READY:
                        actions.setdefault(peer.worker_id, _action("unload", peer, why))
                continue  # loads once none of them holds its model
        actions.setdefault(chosen.worker_id, _action("load", chosen, f"{model} is wanted"))
    for worker in workers:
        limit = worker.idle_unload_s
        if (
            worker.state is S.READY
            and limit
            and worker.idle_s is not None
            and worker.idle_s >= limit
            and worker.model not in wanted
        ):
            why = f"idle for {worker.idle_s:.0f}s (idle_unload_s {limit:g})"
            actions.setdefault(worker.worker_id, _action("unload", worker, why))
    return list(actions.values())


def ended(taken: dict[str, tuple[str, str]], workers: list[WorkerView]) -> list[str]:
    """The decisions in `taken` (decision -> the worker and incarnation it was about) whose worker
    has moved on to another incarnation, or is no member now. Such a name comes up again only for
    a new process that happens to reach the same standby period, and for that one a claim anew is
    right; until the worker moves on, its decision must stay (a new leader must not claim it again)."""
    now = {w.worker_id: w.incarnation for w in workers}
    return [decision for decision, (worker_id, was) in taken.items() if now.get(worker_id) != was]
