"""The wedge watchdog's evidence about one worker process: the jobs it holds and its last step.

Runs in the gateway process, on its asyncio loop. Owns `StepWatch`, which the supervisor keeps per
worker process and feeds from that process's heartbeats, and the judgement of whether the process
is wedged. Only what the worker reports counts: its step counter (every generator step, prefill
chunks included) and the jobs its engine holds (active and queued). A request that the gateway
still holds after its job finished (a client that stopped reading, say) never counts against the
worker; neither does one the gateway sent to a process that has since been replaced.

The worker reports once per heartbeat, so a live worker's last reported step can be up to one
heartbeat interval old: a worker is wedged once it has held jobs without a reported step for
`wedge_timeout_s` plus one heartbeat interval.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wire.stats import EngineStats


@dataclass
class StepWatch:
    started_at: float  # the process was spawned: nothing the gateway saw before counts
    steps: int | None = None  # the worker's step counter in its last heartbeat
    stepped_at: float = field(init=False)  # when a report last showed a step taken
    reported_at: float = field(init=False)  # when the last heartbeat came
    jobs_held: int = 0  # active + queued jobs of its engine, in its last heartbeat

    def __post_init__(self) -> None:
        self.stepped_at = self.reported_at = self.started_at

    def on_heartbeat(self, stats: EngineStats, now: float) -> None:
        if stats.steps != self.steps:
            self.steps, self.stepped_at = stats.steps, now
        self.jobs_held = stats.active_jobs + stats.queued_jobs
        self.reported_at = now

    def stalled_for(self, now: float, step_frame_at: float | None, job_sent_at: float | None) -> float | None:
        """Seconds the worker has held jobs without a step, or None while it holds none.

        `step_frame_at` is when its last Step frame arrived (a step too, seen before the heartbeat
        says so); `job_sent_at` when the gateway last handed this worker id a job. A job handed
        after the last heartbeat counts as held until the next heartbeat reports on it, so a process
        that wedges on its first step after idling is caught as well."""
        unreported = job_sent_at is not None and job_sent_at > max(self.reported_at, self.started_at)
        if not self.jobs_held and not unreported:
            return None
        last_step = max(self.stepped_at, step_frame_at or 0.0)
        if unreported:
            assert job_sent_at is not None
            last_step = max(last_step, job_sent_at)
        return now - last_step
