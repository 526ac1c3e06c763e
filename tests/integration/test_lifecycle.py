"""Processes: one worker per model, cancellation on disconnect, clean shutdown, no orphans."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.harness import GatewayProcess, pid_alive
from tests.integration.conftest import demo_entry, write_registry


def active_jobs(gateway: GatewayProcess, model: str) -> int:
    return sum(w["active_jobs"] + w["queued_jobs"] for w in gateway.workers() if w["model"] == model)


def wait_for(predicate, timeout: float) -> float:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.02)
    raise AssertionError(f"condition not met within {timeout}s")


def test_each_model_has_its_own_worker_process(two_model_gateway: GatewayProcess) -> None:
    workers = two_model_gateway.workers()
    assert sorted(w["model"] for w in workers) == ["demo-medium", "demo-small"]
    pids = {w["pid"] for w in workers}
    assert len(pids) == 2 and two_model_gateway.pid not in pids
    assert all(w["state"] == "ready" and pid_alive(w["pid"]) for w in workers)
    for worker in workers:
        assert set(worker) >= {
            "id",
            "model",
            "state",
            "pid",
            "gpus",
            "active_jobs",
            "queued_jobs",
            "restarts",
        }
        assert worker["info"]["engine"] == "transformers" and worker["info"]["max_seq_len"] == 2048
    ready = httpx.get(two_model_gateway.url + "/health/ready", timeout=5).json()
    assert ready["status"] == "ready" and set(ready["models"]) == {"demo-small", "demo-medium"}


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_job(two_model_gateway: GatewayProcess, stream: bool) -> None:
    body = {
        "model": "demo-medium",
        "prompt": "Keep going",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": stream,
    }
    with httpx.Client(timeout=30) as client:
        if stream:
            with client.stream("POST", two_model_gateway.url + "/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                for _ in range(6):
                    next(lines)
                wait_for(lambda: active_jobs(two_model_gateway, "demo-medium") == 1, 2)
        else:
            with pytest.raises(httpx.ReadTimeout):
                client.post(two_model_gateway.url + "/v1/completions", json=body, timeout=1.0)
    # The connection is closed here; the job must be gone within a second.
    elapsed = wait_for(lambda: active_jobs(two_model_gateway, "demo-medium") == 0, 1.0)
    assert elapsed < 1.0
    assert all(w["in_flight"] == 0 for w in two_model_gateway.workers())


def _start_small_gateway(tmp_path: Path, demo_model_dir: Path) -> GatewayProcess:
    config = write_registry(
        tmp_path / "models.yaml",
        [demo_entry("a", demo_model_dir), demo_entry("b", demo_model_dir)],
        shutdown_grace_s=2,
    )
    return GatewayProcess(config)


def test_sigterm_stops_gateway_and_all_workers(tmp_path: Path, demo_model_dir: Path) -> None:
    gateway = _start_small_gateway(tmp_path, demo_model_dir)
    with gateway:
        pids = [w["pid"] for w in gateway.workers()]
        assert len(pids) == 2
        code = gateway.stop(signal.SIGTERM)
    assert code == 0
    wait_for(lambda: not any(pid_alive(p) for p in pids), 5)


def test_workers_exit_when_gateway_is_killed(tmp_path: Path, demo_model_dir: Path) -> None:
    gateway = _start_small_gateway(tmp_path, demo_model_dir)
    with gateway:
        pids = [w["pid"] for w in gateway.workers()]
        os.kill(gateway.pid, signal.SIGKILL)
        gateway.process.wait(10)  # type: ignore[union-attr]
        wait_for(lambda: not any(pid_alive(p) for p in pids), 5)
