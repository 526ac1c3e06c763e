"""Once SIGTERM's drain has begun no worker starts: one that dies is not restarted, and a load asked
for by hand spawns nothing, so the exit is never held back by a model loading only to be stopped.

Runs real gateways with real CPU workers; a slow stream on one model keeps the drain going while
the other model's worker is killed (SIGKILL) or asked to load.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import GatewayProcess, wait_until
from tests.integration.conftest import demo_entry, write_registry

FAULTY = "test:tests.fault_engines.FaultyEngine"
ENV = {"GATEWAY_ALLOW_TEST_ENGINES": "1", "FAULT_SLOW_STEP_S": "0.05"}
SLOW = {"model": "busy", "prompt": "<<slow>> go", "max_tokens": 2000, "ignore_eos": True, "stream": True}


def worker_of(gateway: GatewayProcess, model: str) -> dict[str, Any]:
    return next(w for w in gateway.workers() if w["model"] == model)


def spawns(gateway: GatewayProcess, model: str) -> int:
    return gateway.log().count(f"for model {model} (pid")


@pytest.fixture()
def draining(tmp_path: Path, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    """A gateway in its drain: a slow stream on `busy` holds it open for the whole (long) grace."""
    config = write_registry(
        tmp_path / "models.yaml",
        [
            demo_entry("busy", demo_model_dir, engine=FAULTY),
            demo_entry("other", demo_model_dir),
            demo_entry("later", demo_model_dir, load="on_demand"),
        ],
        shutdown_grace_s=60,
        restart_backoff_s=0.1,
    )
    with GatewayProcess(config, env=ENV) as gateway:
        with httpx.stream("POST", gateway.url + "/v1/completions", json=SLOW, timeout=120) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            gateway.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            wait_until(lambda: worker_of(gateway, "other")["state"] == "draining", "the drain to begin")
            yield gateway
            assert gateway.process.poll() is None, "the drain ended before the test was done"
            # The stream's client leaves: nothing is in flight, so the gateway exits now.
        assert gateway.process.wait(60) == 0  # type: ignore[union-attr]


def test_during_the_drain_no_worker_starts(draining: GatewayProcess) -> None:
    gateway = draining
    # Asked first: its spawn, if any, would run on the loop long before the death below is seen.
    httpx.post(gateway.url + "/admin/models/later/load", timeout=10)
    os.kill(worker_of(gateway, "other")["pid"], signal.SIGKILL)
    stopped = wait_until(
        lambda: (w := worker_of(gateway, "other"))["state"] == "stopped" and w,
        "the dead worker to be stopped",
        context=gateway.events,
    )
    assert "killed by signal 9" in stopped["detail"]
    assert spawns(gateway, "other") == 1
    later = worker_of(gateway, "later")
    assert later["state"] == "unloaded" and later["pid"] is None and spawns(gateway, "later") == 0
    # The cause is logged once, and no state change outside the table (GatewayProcess checks that too).
    assert gateway.log().count("worker other#0 stopped: killed by signal 9") == 1
    assert "invalid worker state transition" not in gateway.log()
