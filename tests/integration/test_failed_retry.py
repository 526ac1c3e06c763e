"""A failed worker is not failed for good: after `server.retry_failed_after_s` a startup model's
worker starts again and an on-demand model's waits, unloaded, for its next request. A worker with
no process shows no pid.

Runs one real gateway with real CPU workers; the failed starts are real: each worker process is
SIGKILLed while it starts, `restart_limit` times in a row.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import GatewayProcess, pid_alive
from tests.integration.conftest import demo_entry, write_registry

RESTART_LIMIT = 3
RETRY_AFTER_S = 2.0
STARTING = ("starting", "loading", "warming")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    config = write_registry(
        tmp_path_factory.mktemp("retry") / "models.yaml",
        [demo_entry("m", demo_model_dir), demo_entry("od", demo_model_dir, load="on_demand")],
        restart_backoff_s=0.1,
        restart_limit=RESTART_LIMIT,
        retry_failed_after_s=RETRY_AFTER_S,
    )
    with GatewayProcess(config, wait_ready=False) as gw:
        gw.wait_until_live()
        yield gw


def worker(gw: GatewayProcess, model: str) -> dict[str, Any]:
    return next(w for w in gw.workers() if w["model"] == model)


def kill_every_start(gw: GatewayProcess, model: str) -> list[int]:
    """SIGKILL each process of the model while it starts, until the worker is failed."""
    killed: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = worker(gw, model)
        if now["state"] == "failed":
            return killed
        assert now["state"] != "ready", f"a start got through: {now}"
        if now["state"] in STARTING and now["pid"] and now["pid"] not in killed:
            os.kill(now["pid"], signal.SIGKILL)
            killed.append(now["pid"])
        time.sleep(0.02)
    raise AssertionError(f"never failed: {worker(gw, model)}")


def wait_for(gw: GatewayProcess, model: str, states: tuple[str, ...], timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = worker(gw, model)
        if now["state"] in states:
            return now
        time.sleep(0.05)
    raise AssertionError(f"{model} never reached {states}: {worker(gw, model)}")


def test_failed_worker_shows_no_pid_and_is_tried_again(gateway: GatewayProcess) -> None:
    killed = kill_every_start(gateway, "m")
    failed_at = time.monotonic()
    assert len(killed) == RESTART_LIMIT
    failed = worker(gateway, "m")
    assert failed["pid"] is None, failed  # its last process is dead: no pid to show
    assert f"{RESTART_LIMIT} failed starts" in failed["detail"]
    assert not any(pid_alive(pid) for pid in killed)
    assert httpx.get(gateway.url + "/health/ready/m", timeout=5).status_code == 503

    # Nothing happens before the retry is due; then the worker starts again, by itself.
    starting = wait_for(gateway, "m", STARTING, timeout=RETRY_AFTER_S + 30)
    assert time.monotonic() - failed_at > RETRY_AFTER_S - 0.6  # the failure was seen up to a poll late
    ready = wait_for(gateway, "m", ("ready",))
    assert ready["pid"] not in killed and pid_alive(ready["pid"]), ready
    assert ready["restarts"] > failed["restarts"], (failed, ready)
    assert starting["pid"] is None or starting["pid"] == ready["pid"]
    assert "failed 2s ago; trying again" in gateway.log()
    reply = httpx.post(gateway.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3})
    assert reply.status_code == 200, reply.text


def test_failed_on_demand_worker_loads_again_at_its_next_request(gateway: GatewayProcess) -> None:
    assert worker(gateway, "od")["state"] == "unloaded"
    body = {"model": "od", "prompt": "hi", "max_tokens": 3}
    replies: list[httpx.Response] = []
    first = threading.Thread(
        target=lambda: replies.append(httpx.post(gateway.url + "/v1/completions", json=body, timeout=60))
    )
    first.start()  # it loads the model, and waits for the load
    killed = kill_every_start(gateway, "od")
    first.join(60)
    assert replies[0].status_code == 503, replies[0].text  # the load it waited for failed
    assert len(killed) == RESTART_LIMIT and worker(gateway, "od")["pid"] is None
    # After the retry interval it is unloaded again, not started: only a request loads it.
    unloaded = wait_for(gateway, "od", ("unloaded",), timeout=RETRY_AFTER_S + 30)
    assert unloaded["pid"] is None and "loads at its next request" in unloaded["detail"]
    time.sleep(1.0)
    assert worker(gateway, "od")["state"] == "unloaded"
    second = httpx.post(gateway.url + "/v1/completions", json=body, timeout=60)
    assert second.status_code == 200, second.text
    loaded = worker(gateway, "od")
    assert loaded["state"] == "ready" and loaded["pid"] not in killed and pid_alive(loaded["pid"])
