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
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import WAIT_TIMEOUT_S, GatewayProcess, pid_alive, wait_until
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

    def kill_until_failed() -> bool:
        now = worker(gw, model)
        if now["state"] == "failed":
            return True
        assert now["state"] != "ready", f"a start got through: {now}"
        if now["state"] in STARTING and now["pid"] and now["pid"] not in killed:
            os.kill(now["pid"], signal.SIGKILL)
            killed.append(now["pid"])
        return False

    # Polled often: each start must be caught (and killed) before it gets to ready.
    wait_until(kill_until_failed, f"{model} to fail", context=gw.events, poll_s=0.02)
    return killed


def wait_for(
    gw: GatewayProcess, model: str, states: tuple[str, ...], timeout: float = WAIT_TIMEOUT_S
) -> dict[str, Any]:
    def in_states() -> dict[str, Any] | None:
        now = worker(gw, model)
        return now if now["state"] in states else None

    return wait_until(in_states, f"{model} to be {' or '.join(states)}", timeout, context=gw.events)


def logged_at(gw: GatewayProcess, *texts: str) -> datetime:
    """When the gateway logged its last line containing each of `texts` (its clock, at the event)."""
    line = [line for line in gw.log().splitlines() if all(text in line for text in texts)][-1]
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")


def test_failed_worker_shows_no_pid_and_is_tried_again(gateway: GatewayProcess) -> None:
    killed = kill_every_start(gateway, "m")
    assert len(killed) == RESTART_LIMIT
    failed = worker(gateway, "m")
    assert failed["pid"] is None, failed  # its last process is dead: no pid to show
    assert f"{RESTART_LIMIT} failed starts" in failed["detail"]
    assert not any(pid_alive(pid) for pid in killed)
    assert httpx.get(gateway.url + "/health/ready/m", timeout=5).status_code == 503

    # Nothing happens before the retry is due; then the worker starts again, by itself.
    starting = wait_for(gateway, "m", STARTING, timeout=RETRY_AFTER_S + 30)
    # Timed by the gateway's log at the two events, not by when this test happened to look.
    failed_logged = logged_at(gateway, "worker m#0: ", " -> failed")
    waited = logged_at(gateway, "worker m#0 failed", "trying again") - failed_logged
    assert waited.total_seconds() >= RETRY_AFTER_S - 0.01, waited  # its clock logs milliseconds
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
    # Nothing may start it now. A thing that does not happen has no event to wait on: this
    # is a window to look in, not a wait for something.
    time.sleep(1.0)
    assert worker(gateway, "od")["state"] == "unloaded"
    second = httpx.post(gateway.url + "/v1/completions", json=body, timeout=60)
    assert second.status_code == 200, second.text
    loaded = worker(gateway, "od")
    assert loaded["state"] == "ready" and loaded["pid"] not in killed and pid_alive(loaded["pid"])
