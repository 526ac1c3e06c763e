"""The local worker watchdog's three rules (gateway.workers.watchdog): a start deadline while it
is not ready, a heartbeat timeout and a wedge timeout once it is, each with the cause it logs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from gateway.config.models import ModelConfig
from gateway.config.server_config import ServerConfig
from gateway.link.handle import WorkerHandle
from gateway.link.step_watch import StepWatch
from gateway.workers.watchdog import death_cause
from wire.states import WorkerState
from wire.stats import EngineStats

S = WorkerState
SERVER = ServerConfig(worker_start_timeout_s=60, heartbeat_timeout_s=10, heartbeat_interval_s=1)


def handle(state: WorkerState) -> WorkerHandle:
    model = ModelConfig.model_validate({"name": "m", "path": "/m", "limits": {"wedge_timeout_s": 5}})
    worker = WorkerHandle(id="m#0", model=model, state=state, spawned_at=100.0)
    worker.step_watch = StepWatch(started_at=100.0)
    return worker


def link(last_seen: float, job_sent: float | None = None) -> Any:
    return SimpleNamespace(last_seen={"m#0": last_seen}, last_step_frame={}, last_job_sent={"m#0": job_sent})


def test_a_worker_that_is_not_ready_answers_only_to_its_start_deadline() -> None:
    loading = handle(S.LOADING)
    assert death_cause(loading, link(last_seen=100.0), SERVER, 159.0) is None  # silent, but loading
    assert "not ready within worker_start_timeout_s=60s" in str(
        death_cause(loading, link(100.0), SERVER, 161.0)
    )
    # Draining is no start-up: the heartbeat rule applies.
    assert "no heartbeat for 10s" in str(death_cause(handle(S.DRAINING), link(100.0), SERVER, 161.0))


def test_a_ready_worker_is_lost_without_heartbeats_and_wedged_without_steps() -> None:
    ready = handle(S.READY)
    assert death_cause(ready, link(last_seen=150.0), SERVER, 159.0) is None
    assert "no heartbeat for 10s (hung or lost)" in str(death_cause(ready, link(148.0), SERVER, 159.0))
    assert ready.step_watch is not None
    ready.step_watch.on_heartbeat(EngineStats(active_jobs=1, steps=3), 150.0)
    ready.step_watch.on_heartbeat(EngineStats(active_jobs=1, steps=3), 155.0)
    assert death_cause(ready, link(last_seen=155.0), SERVER, 155.9) is None  # within 5 s + a heartbeat
    cause = death_cause(ready, link(last_seen=156.0), SERVER, 156.5)
    assert cause == "holds jobs but no generator step for 6.5s (wedge_timeout_s=5; wedged)"
