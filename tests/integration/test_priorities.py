"""Priority classes through a real gateway: under a full queue, X-Priority decides who goes next.

Runs in the pytest process against a gateway whose one CPU worker takes one job at a time. A long
request holds the slot; three more wait in the queue (low, normal, high, arriving in that order);
the order in which they start is the order they finish in, since only one runs at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.harness import GatewayProcess, wait_until
from tests.integration.conftest import demo_entry, write_registry


@pytest.fixture(scope="module")
def one_slot_gateway(
    tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path
) -> Iterator[GatewayProcess]:
    # The fault engine's <<slow>> marker keeps the first request running (0.05 s a step) while the
    # others queue, however fast or loaded the machine is.
    entry = demo_entry("demo-a", demo_model_dir, engine="test:tests.fault_engines.FaultyEngine")
    entry["limits"] = {"max_concurrent_jobs": 1, "max_queued_requests": 8, "priority_aging_s": 600}
    config = write_registry(tmp_path_factory.mktemp("priorities") / "models.yaml", [entry])
    with GatewayProcess(config, env={"GATEWAY_ALLOW_TEST_ENGINES": "1"}) as gateway:
        yield gateway


def queue_depth(gateway: GatewayProcess) -> float:
    for line in httpx.get(gateway.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith('gateway_queue_depth{model="demo-a"}'):
            return float(line.split()[-1])
    return 0.0


def wait_for_depth(gateway: GatewayProcess, depth: int, threads: list[threading.Thread]) -> None:
    def reached() -> bool:
        assert all(t.is_alive() for t in threads), "a queued request ended before its turn"
        return queue_depth(gateway) >= depth

    wait_until(reached, f"{depth} requests wait in the queue", context=gateway.log)


def test_higher_classes_leave_a_full_queue_first(one_slot_gateway: GatewayProcess) -> None:
    finished: list[str] = []
    statuses: dict[str, int] = {}

    def send(name: str, priority: str | None, max_tokens: int) -> None:
        headers = {"X-Priority": priority} if priority else {}
        prompt = "<<slow>> go" if priority is None else "go"
        body = {"model": "demo-a", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        reply = httpx.post(one_slot_gateway.url + "/v1/completions", json=body, headers=headers, timeout=120)
        statuses[name] = reply.status_code
        finished.append(name)

    holder = threading.Thread(target=send, args=("holder", None, 200))
    holder.start()
    threads = [holder]

    # The holder is running once the worker holds its slot.
    def holder_runs() -> bool:
        assert holder.is_alive(), "the first request ended early"
        return any(w["in_flight"] for w in one_slot_gateway.workers())

    wait_until(holder_runs, "the first request holds the only slot", context=one_slot_gateway.log)
    for depth, (name, priority) in enumerate([("low", "low"), ("normal", "normal"), ("high", "high")], 1):
        thread = threading.Thread(target=send, args=(name, priority, 4))
        thread.start()
        threads.append(thread)
        wait_for_depth(one_slot_gateway, depth, threads)
    for thread in threads:
        thread.join(timeout=120)
    assert statuses == {"holder": 200, "low": 200, "normal": 200, "high": 200}
    assert finished == ["holder", "high", "normal", "low"]
