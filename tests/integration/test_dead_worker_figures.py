"""A worker whose process died shows no jobs while it waits for its restart: what the dead process
last reported (jobs, tokens/s) is not shown, in /admin/workers or /metrics, as if it still held them.

Runs a real gateway with a real CPU worker, killed with SIGKILL mid-stream.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import GatewayProcess, wait_until
from tests.integration.conftest import demo_entry, write_registry

RESTART_BACKOFF_S = 3.0  # long enough for the test to see the worker waiting for its restart


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    config = write_registry(
        tmp_path_factory.mktemp("dead") / "models.yaml",
        [demo_entry("m", demo_model_dir)],
        restart_backoff_s=RESTART_BACKOFF_S,
    )
    with GatewayProcess(config) as gw:
        yield gw


def worker(gw: GatewayProcess) -> dict[str, Any]:
    return gw.workers()[0]


def active_jobs_metric(gw: GatewayProcess) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=5).text
    line = next(x for x in text.splitlines() if x.startswith('gateway_active_jobs{model="m"'))
    return float(line.rsplit(" ", 1)[1])


def test_a_dead_worker_shows_no_jobs_while_it_restarts(gateway: GatewayProcess) -> None:
    body = {"model": "m", "prompt": "go", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    lines: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=120) as response:
            lines.extend(line for line in response.iter_lines() if line)

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        busy = wait_until(lambda: (w := worker(gateway))["active_jobs"] > 0 and w, "a heartbeat with the job",
                          context=gateway.events)  # fmt: skip
        os.kill(busy["pid"], signal.SIGKILL)

        def restarting() -> tuple[dict[str, Any], float] | None:
            info = worker(gateway)
            # The metric is read while the worker still waits: the backoff outlasts a scrape.
            return (info, active_jobs_metric(gateway)) if info["state"] == "restarting" else None

        info, metric = wait_until(restarting, "the worker to wait for its restart", context=gateway.events)
    finally:
        reader.join(120)
    assert any(line.startswith("event: error") for line in lines), lines[-3:]
    assert info["pid"] is None, info
    assert (info["active_jobs"], info["queued_jobs"], info["tokens_per_s"]) == (0, 0, 0), info
    assert info["load"] is None, info
    assert metric == 0, metric
    wait_until(lambda: worker(gateway)["state"] == "ready", "the restarted worker", context=gateway.events)
    reply = httpx.post(gateway.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3})
    assert reply.status_code == 200, reply.text
