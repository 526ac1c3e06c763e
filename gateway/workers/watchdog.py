"""The local worker watchdog's judgement: whether a worker process must be killed now, and why.

Runs in the gateway process, on its asyncio loop, called by gateway.workers.supervisor's watch of
each local worker process. Owns the three rules; pure apart from reading what the link last saw:
- a worker not ready within `worker_start_timeout_s` (one draining, or winding down after a Fatal,
  is not starting up);
- no frame from it for `heartbeat_timeout_s` (hung or lost);
- jobs it holds with no step it reports for `wedge_timeout_s` plus one heartbeat interval (wedged;
  the evidence is gateway.link.step_watch's).
A cause the worker reported itself (its Fatal) is kept by the caller: it says why it stalled.
"""

from __future__ import annotations

from gateway.config.server_config import ServerConfig
from gateway.link.handle import WorkerHandle
from gateway.link.worker_link import WorkerLink
from wire.states import WorkerState

S = WorkerState


def death_cause(handle: WorkerHandle, link: WorkerLink, server: ServerConfig, now: float) -> str | None:
    """Why the worker behind `handle` must be killed now; None while it is fine."""
    if not handle.ready and handle.state not in (S.DRAINING, S.RESTARTING):
        if now - handle.spawned_at > server.worker_start_timeout_s:
            return (
                f"not ready within worker_start_timeout_s={server.worker_start_timeout_s:g}s; "
                "raise it in the registry's server section if loading is legitimately slow"
            )
        return None
    if now - link.last_seen.get(handle.id, now) > server.heartbeat_timeout_s:
        return f"no heartbeat for {server.heartbeat_timeout_s:g}s (hung or lost)"
    wedge_timeout_s = handle.model.limits.wedge_timeout_s
    # Steps are reported once per heartbeat: a live worker's last report may be that much older.
    stalled_limit_s = wedge_timeout_s + server.heartbeat_interval_s
    stalled_s = stalled_for(handle, link, now)
    if stalled_s is not None and stalled_s > stalled_limit_s:
        return (
            f"holds jobs but no generator step for {stalled_s:.1f}s "
            f"(wedge_timeout_s={wedge_timeout_s:g}; wedged)"
        )
    return None


def stalled_for(handle: WorkerHandle, link: WorkerLink, now: float) -> float | None:
    """Seconds the worker has held jobs without a step (None: it holds none, or has no process)."""
    if handle.step_watch is None:
        return None
    return handle.step_watch.stalled_for(
        now, link.last_step_frame.get(handle.id), link.last_job_sent.get(handle.id)
    )
