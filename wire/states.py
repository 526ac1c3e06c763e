"""Worker states, named once, and the table of every change between them that may happen.

Imported by the worker (its own lifecycle, reported in Status and Heartbeat) and by the gateway
(supervisor, remote workers, router, health, metrics and the status page all read these). A change
that is not in `TRANSITIONS` is a bug: `check_transition` raises `InvalidTransition`, and the
gateway's one place that changes a worker's state refuses it and logs it.

    unloaded --launch--> starting -> loading -> warming -> ready -> draining -> stopped | unloaded
    any live state --process died--> restarting -> starting ... | failed (too many failed starts)
    remote workers: any live state --silence--> lost --frames again--> ready | loading | starting
    standby workers (cluster mode): starting -> unloaded --Load--> starting ... ready --Unload-->
    draining -> unloaded; unloaded --silence--> lost --frames again--> unloaded
"""

from __future__ import annotations

import enum


class WorkerState(str, enum.Enum):
    # No model on purpose: on-demand and not yet needed, or unloaded by hand or when idle (a spawned
    # worker has no process then; a standby worker in cluster mode keeps its process, without a model).
    UNLOADED = "unloaded"
    STARTING = "starting"  # process spawned (or a remote worker joined); nothing loaded yet
    LOADING = "loading"
    WARMING = "warming"  # loaded; running the warm-up generation
    READY = "ready"
    DRAINING = "draining"  # finishing what it holds; takes nothing new
    RESTARTING = "restarting"  # its process died; a new one starts after a backoff
    FAILED = "failed"  # gave up after too many failed starts in a row
    LOST = "lost"  # a remote worker that stopped sending frames
    STOPPED = "stopped"  # gone for good (gateway shutdown, or removed by a reload)

    @property
    def category(self) -> str:
        """serving, loading, draining, idle or down: what the status page and probes group by."""
        return _CATEGORY[self]


S = WorkerState
_LIVE = frozenset({S.STARTING, S.LOADING, S.WARMING, S.READY})

TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    # A standby worker (cluster mode) that goes silent is lost, like any remote worker.
    S.UNLOADED: frozenset({S.STARTING, S.STOPPED, S.LOST}),
    # A standby worker starts without loading: starting -> unloaded.
    S.STARTING: frozenset({S.LOADING, S.DRAINING, S.RESTARTING, S.FAILED, S.STOPPED, S.LOST, S.UNLOADED}),
    S.LOADING: frozenset({S.WARMING, S.STARTING, S.DRAINING, S.RESTARTING, S.FAILED, S.STOPPED, S.LOST}),
    S.WARMING: frozenset({S.READY, S.STARTING, S.DRAINING, S.RESTARTING, S.FAILED, S.STOPPED, S.LOST}),
    # A remote worker whose process restarted says Hello again: ready -> starting.
    S.READY: frozenset({S.DRAINING, S.STARTING, S.RESTARTING, S.STOPPED, S.LOST}),
    S.DRAINING: frozenset({S.STOPPED, S.UNLOADED, S.LOST}),
    S.RESTARTING: frozenset({S.STARTING, S.FAILED, S.STOPPED, S.UNLOADED}),
    S.FAILED: frozenset({S.STARTING, S.STOPPED, S.UNLOADED}),
    S.LOST: frozenset({S.READY, S.LOADING, S.STARTING, S.STOPPED, S.UNLOADED}),
    S.STOPPED: frozenset(),
}

_CATEGORY = {
    S.READY: "serving",
    S.STARTING: "loading",
    S.LOADING: "loading",
    S.WARMING: "loading",
    S.RESTARTING: "loading",
    S.DRAINING: "draining",
    S.UNLOADED: "idle",
    S.FAILED: "down",
    S.LOST: "down",
    S.STOPPED: "down",
}

# States in which a replica may still take a request: a model whose replicas are all outside them
# cannot serve, and a request for it is refused at once; one that failed to start on a replica
# moves only to a replica in them. (A draining replica is followed by what a reload or an unload
# decides, so requests wait for that.)
MAY_SERVE = frozenset({S.STARTING, S.LOADING, S.WARMING, S.READY, S.RESTARTING, S.UNLOADED, S.DRAINING})
# States in which a live process holds the model (so there is something to drain or kill).
HOLDS_PROCESS = _LIVE | {S.DRAINING}
# A model's state is its best replica's: the first of these that any replica is in.
MODEL_STATE_PRECEDENCE = (
    S.READY, S.WARMING, S.LOADING, S.STARTING, S.RESTARTING,
    S.DRAINING, S.LOST, S.UNLOADED, S.FAILED, S.STOPPED,
)  # fmt: skip


class InvalidTransition(RuntimeError):
    def __init__(self, old: WorkerState, new: WorkerState) -> None:
        super().__init__(f"invalid worker state transition {old.value} -> {new.value}")
        self.old = old
        self.new = new


def can_transition(old: WorkerState, new: WorkerState) -> bool:
    """Staying in a state is always allowed (a repeated Status); changes must be in the table."""
    return old is new or new in TRANSITIONS[old]


def check_transition(old: WorkerState, new: WorkerState) -> None:
    if not can_transition(old, new):
        raise InvalidTransition(old, new)


def model_state(replica_states: list[WorkerState]) -> WorkerState:
    present = set(replica_states)
    for state in MODEL_STATE_PRECEDENCE:
        if state in present:
            return state
    return S.STOPPED
