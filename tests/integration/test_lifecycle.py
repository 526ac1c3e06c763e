"""Processes: one worker per model, cancellation on disconnect, clean shutdown, no orphans."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import GatewayProcess, async_wait_until, pid_alive, settled_workers, wait_until
from tests.integration.conftest import demo_entry, write_registry


def active_jobs(gateway: GatewayProcess, model: str) -> int:
    return sum(w["active_jobs"] + w["queued_jobs"] for w in gateway.workers() if w["model"] == model)


def medium_worker(gateway: GatewayProcess) -> dict[str, Any]:
    return next(w for w in gateway.workers() if w["model"] == "demo-medium")


def idle_medium(gateway: GatewayProcess) -> dict[str, Any] | None:
    worker = medium_worker(gateway)
    return worker if worker["active_jobs"] + worker["queued_jobs"] == 0 else None


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
    gateway = two_model_gateway
    # Idle in a heartbeat newer than this line: the counters include every job before this one.
    (before,) = settled_workers(gateway, [medium_worker(gateway)["id"]])
    body = {
        "model": "demo-medium",
        "prompt": "Keep going",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": stream,
    }
    url = gateway.url + "/v1/completions"

    def job_running() -> bool:
        return active_jobs(gateway, "demo-medium") == 1

    if stream:
        with httpx.Client(timeout=30) as client, client.stream("POST", url, json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for _ in range(6):
                next(lines)
            wait_until(job_running, "the job to run", context=gateway.events)
    else:

        async def leave_while_it_runs() -> None:
            async with httpx.AsyncClient(timeout=30) as client:
                request = asyncio.create_task(client.post(url, json=body))
                await async_wait_until(job_running, "the job to run", context=gateway.events)
                request.cancel()  # the client goes away; its connection closes
                with pytest.raises(asyncio.CancelledError):
                    await request

        asyncio.run(leave_while_it_runs())
    # The connection is closed here; the job must be cancelled, not left to run its 2000 tokens:
    # the worker counts it so (event order instead of a one-second bound).

    def cancelled() -> dict[str, Any] | None:
        now = idle_medium(gateway)
        return now if now and now["stats"]["jobs_cancelled"] > before["stats"]["jobs_cancelled"] else None

    after = wait_until(cancelled, "the job to be cancelled", context=gateway.events)
    assert after["stats"]["jobs_finished"] == before["stats"]["jobs_finished"], after["stats"]
    assert all(w["in_flight"] == 0 for w in gateway.workers())


@pytest.mark.parametrize("stream", [True, False])
def test_client_gone_as_its_request_arrives_cancels_the_job(
    two_model_gateway: GatewayProcess, stream: bool
) -> None:
    """The request and the client's close reach the gateway together: the app reads the body and
    the disconnect in one go, so the cancel lands just as the body is complete (where Python 3.10
    and 3.11's wait_for, inside Quart's get_data, used to swallow it and the job ran to its end)."""
    gateway = two_model_gateway
    (before,) = settled_workers(gateway, [medium_worker(gateway)["id"]])
    request_id = f"gone-on-arrival-{stream}"
    body = json.dumps(
        {
            "model": "demo-medium",
            "prompt": "Keep going",
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"X-Request-ID: {request_id}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", gateway.port)) as client:
        client.sendall(head + body)  # and close at once: the FIN follows the body

    def access_line() -> str | None:
        return next((line for line in gateway.log().splitlines() if f"request_id={request_id}" in line
                     and " gateway.access: " in line), None)  # fmt: skip

    line = wait_until(access_line, "the request's access line", context=gateway.events)
    assert " 499 " in line, line
    (after,) = settled_workers(gateway, [before["id"]])
    assert after["stats"]["jobs_finished"] == before["stats"]["jobs_finished"], after["stats"]


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
    wait_until(lambda: not any(pid_alive(p) for p in pids), "every worker to exit")


def test_workers_exit_when_gateway_is_killed(tmp_path: Path, demo_model_dir: Path) -> None:
    gateway = _start_small_gateway(tmp_path, demo_model_dir)
    with gateway:
        pids = [w["pid"] for w in gateway.workers()]
        os.kill(gateway.pid, signal.SIGKILL)
        gateway.process.wait(10)  # type: ignore[union-attr]
        wait_until(lambda: not any(pid_alive(p) for p in pids), "every worker to exit with the gateway")
