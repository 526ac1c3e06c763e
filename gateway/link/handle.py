"""One model replica as the gateway sees it: its state, process, engine figures and routing load.

Runs in the gateway process, on its asyncio loop. Owns `WorkerHandle` and the one method that
changes a worker's state (`move_to`), which checks every change against wire.states' table.
The supervisor and remote membership drive handles; the router reads them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.config.models import ModelConfig
from gateway.link.step_watch import StepWatch
from wire import messages as wire
from wire.codec import as_dict
from wire.states import InvalidTransition, WorkerState, check_transition
from wire.stats import EngineInfo, EngineStats, WorkerLoad

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class WorkerHandle:
    id: str
    model: ModelConfig
    replica: int = 0
    gpus: list[int] = field(default_factory=list)
    state: WorkerState = WorkerState.STARTING
    state_since: float = field(default_factory=time.monotonic)
    detail: str = ""
    progress: float | None = None
    pid: int | None = None
    restarts: int = 0  # of this model replica since the gateway started: a reload's new worker carries it on
    consecutive_failures: int = 0
    last_error: str | None = None  # what last went wrong; kept after a restart, for operators
    death_cause: str | None = None  # why the current process is being killed or failed (Fatal, watchdogs)
    info: EngineInfo | None = None
    ready_message: wire.Ready | None = None
    stats: EngineStats = field(default_factory=EngineStats)
    load: WorkerLoad | None = None  # the requests it holds (embeddings too), as of its last heartbeat
    spawned_at: float = 0.0
    ready_at: float | None = None
    in_flight: int = 0
    tokens_per_s: float = 0.0
    rate_at: float = 0.0
    heartbeats: int = 0  # received so far: a count that grows says the stats are newer than a moment
    outstanding_tokens: int = 0  # prompt + max_tokens of its requests in flight: the routing load
    last_used: float = field(default_factory=time.monotonic)
    process: asyncio.subprocess.Process | None = None
    step_watch: StepWatch | None = None  # the wedge watchdog's evidence about a local process
    task: asyncio.Task[None] | None = None
    retiring: bool = False  # being unloaded or replaced: no restart when it exits
    remote: bool = False  # a worker on another host: joined over tcp, never spawned by us
    key_name: str | None = None  # a remote worker's CURVE key (its certificate's name)
    lost_since: float | None = None  # when a remote worker was last marked lost
    stale_rids: list[str] = field(default_factory=list)  # ended while it was lost: cancel on rejoin
    # Cluster mode: the standby period its model was (or will be) loaded from, named by the leader's
    # Load and Unload; and the state its last heartbeat reported (a standby worker back from lost).
    standby_epoch: int = 0
    reported: WorkerState | None = None

    @property
    def ready(self) -> bool:
        return self.state is WorkerState.READY

    @property
    def others_jobs(self) -> int:
        """Requests other gateways hold on this worker (generation jobs and embedding requests, each
        taking one of their slots as ours do), as of its last report (0 for our own workers)."""
        return self.load.others if self.load is not None else 0

    def slot_limit(self, configured: int) -> int:
        """How many jobs this gateway may have on the worker now: `max_concurrent_jobs`, or for a
        worker with a cap of its own (shared by several gateways) that cap less what the others hold.
        The figures are as of the worker's last report: a heartbeat, or, while several gateways
        share it, a report sent as soon as the jobs it holds change (model_worker.serve_loop); the
        worker refuses what would still exceed its cap."""
        load = self.load
        if load is None or load.max_jobs == 0:
            return configured
        return max(min(configured, load.max_jobs) - load.others, 0)

    def move_to(self, state: WorkerState, detail: str) -> bool:
        """Change state if the table allows it; a forbidden change is a bug, logged and refused."""
        try:
            check_transition(self.state, state)
        except InvalidTransition as exc:
            fields = self._log_fields()
            logger.error("worker %s: %s (%s); kept %s", self.id, exc, detail, self.state.value, extra=fields)
            return False
        if self.state is not state:
            fields = self._log_fields()
            old = self.state.value
            # No separator before an empty detail: the text format's context would follow two spaces.
            shown = f" {detail}" if detail else ""
            logger.info("worker %s: %s -> %s%s", self.id, old, state.value, shown, extra=fields)
            self.state_since = time.monotonic()
        self.state, self.detail = state, detail
        return True

    def on_heartbeat(self, stats: EngineStats, now: float, load: WorkerLoad | None = None) -> None:
        """The engine's figures; tokens/s between heartbeats, smoothed, for /admin/workers and the
        dashboard; the steps and jobs the wedge watchdog judges by; the load the router reads."""
        self.load = load
        if now > self.rate_at > 0:
            rate = max(stats.generated_tokens - self.stats.generated_tokens, 0) / (now - self.rate_at)
            self.tokens_per_s += (rate - self.tokens_per_s) * 0.5
        self.rate_at = now
        self.stats = stats
        self.heartbeats += 1
        if self.step_watch is not None:
            self.step_watch.on_heartbeat(stats, now)

    def _log_fields(self) -> dict[str, str]:
        return {"worker": self.id, "model": self.model.name}

    def process_gone(self) -> None:
        """Its process exited: what it last reported (jobs, cache, memory, load) describes nothing
        now, while the worker waits for its restart or stays failed."""
        self.pid = self.step_watch = None
        self.stats = EngineStats()
        self.load = None
        self.tokens_per_s = 0.0

    def forget_process(self) -> None:
        """Nothing of a previous process carries over to the next one."""
        self.info, self.ready_message, self.ready_at = None, None, None
        self.stats = EngineStats()
        self.load = None

    def describe(self) -> dict[str, Any]:
        now = time.monotonic()
        ready = self.ready_message
        return {
            "id": self.id,
            "model": self.model.name,
            "replica": self.replica,
            "state": self.state.value,
            "category": self.state.category,
            "detail": self.detail,
            "progress": self.progress,
            "pid": self.pid,
            "gpus": list(self.gpus),
            "active_jobs": self.stats.active_jobs,
            "queued_jobs": self.stats.queued_jobs,
            "in_flight": self.in_flight,
            "outstanding_tokens": self.outstanding_tokens,
            "tokens_per_s": round(self.tokens_per_s, 1),
            "restarts": self.restarts,
            "remote": self.remote,
            "key": self.key_name,
            "last_error": self.last_error,
            "uptime_s": round(now - self.ready_at, 1) if self.ready_at and self.ready else None,
            "info": as_dict(self.info) if self.info is not None else {},
            "load_s": ready.load_s if ready else None,
            "warmup_s": ready.warmup_s if ready else None,
            "chat_template": ready.chat_template if ready else None,
            "stats": as_dict(self.stats),
            "load": as_dict(self.load) if self.load is not None else None,
            "heartbeats": self.heartbeats,
        }
