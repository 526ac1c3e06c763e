"""The wedge watchdog's judgement (gateway.link.step_watch): held jobs and reported steps only."""

from __future__ import annotations

from gateway.link.step_watch import StepWatch
from wire.stats import EngineStats


def beat(watch: StepWatch, at: float, steps: int, active: int = 0, queued: int = 0) -> None:
    watch.on_heartbeat(EngineStats(active_jobs=active, queued_jobs=queued, steps=steps), at)


def test_idle_worker_is_never_stalled() -> None:
    watch = StepWatch(started_at=100.0)
    assert watch.stalled_for(500.0, None, None) is None
    beat(watch, 101.0, steps=7)
    assert watch.stalled_for(500.0, None, None) is None


def test_prefill_steps_in_heartbeats_count_as_progress() -> None:
    watch = StepWatch(started_at=0.0)
    beat(watch, 1.0, steps=10, active=1)
    for second in range(2, 30):  # a long prefill: no Step frame, the counter moves every heartbeat
        beat(watch, float(second), steps=10 + second * 100, active=1)
        assert watch.stalled_for(second + 0.75, None, 0.5) == 0.75
    beat(watch, 30.0, steps=2_910, active=1)  # the counter stopped: stalled since it last moved
    beat(watch, 31.0, steps=2_910, active=1)
    assert watch.stalled_for(32.5, None, 0.5) == 3.5


def test_queued_jobs_count_as_held() -> None:
    watch = StepWatch(started_at=0.0)
    beat(watch, 1.0, steps=5, queued=2)
    beat(watch, 2.0, steps=5, queued=2)
    assert watch.stalled_for(4.0, None, None) == 3.0


def test_a_job_the_worker_reports_finished_never_counts() -> None:
    watch = StepWatch(started_at=0.0)
    beat(watch, 1.0, steps=10, active=1)
    beat(watch, 2.0, steps=20)  # the job finished; the gateway may still hold its request
    assert watch.stalled_for(60.0, 1.5, 0.8) is None


def test_a_job_handed_after_the_last_heartbeat_counts_until_reported() -> None:
    watch = StepWatch(started_at=0.0)
    beat(watch, 1.0, steps=10)
    assert watch.stalled_for(4.0, None, 2.0) == 2.0  # handed at 2.0, never reported on
    beat(watch, 4.5, steps=10)  # the worker holds it back (its constraint compiles): not held
    assert watch.stalled_for(9.0, None, 2.0) is None
    assert watch.stalled_for(9.0, 8.5, 2.0) is None


def test_a_step_frame_is_progress_before_the_heartbeat_says_so() -> None:
    watch = StepWatch(started_at=0.0)
    beat(watch, 1.0, steps=10, active=1)
    assert watch.stalled_for(3.0, 2.5, None) == 0.5


def test_jobs_handed_to_an_earlier_process_do_not_count() -> None:
    watch = StepWatch(started_at=10.0)  # a restart under the same worker id
    assert watch.stalled_for(30.0, 9.0, 9.5) is None
