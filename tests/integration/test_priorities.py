"""Priority classes through a real gateway: under a full queue, X-Priority decides who goes next.

Runs in the pytest process against a gateway whose one CPU worker takes one job at a time. A long
request holds the slot; three more wait in the queue (low, normal, high, arriving in that order);
the order in which they start is the order they finish in, since only one runs at a time. Without
API keys (this gateway has none) a request may name any class, and one that names none is normal.
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


def finishing_order(gateway: GatewayProcess, queued: list[tuple[str, str | None]]) -> list[str]:
    """A long request takes the only slot; `queued` (name, X-Priority or None for no header) then
    wait in the queue in that order. Every one's status must be 200; the order they finished in."""
    finished: list[str] = []
    statuses: dict[str, int] = {}

    def send(name: str, priority: str | None, prompt: str, max_tokens: int) -> None:
        headers = {"X-Priority": priority} if priority else {}
        body = {"model": "demo-a", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        reply = httpx.post(gateway.url + "/v1/completions", json=body, headers=headers, timeout=120)
        statuses[name] = reply.status_code
        finished.append(name)

    holder = threading.Thread(target=send, args=("holder", None, "<<slow>> go", 200))
    holder.start()
    threads = [holder]

    # The holder is running once the worker holds its slot.
    def holder_runs() -> bool:
        assert holder.is_alive(), "the first request ended early"
        return any(w["in_flight"] for w in gateway.workers())

    wait_until(holder_runs, "the first request holds the only slot", context=gateway.log)
    for depth, (name, priority) in enumerate(queued, 1):
        thread = threading.Thread(target=send, args=(name, priority, "go", 4))
        thread.start()
        threads.append(thread)
        wait_for_depth(gateway, depth, threads)
    for thread in threads:
        thread.join(timeout=120)
    assert statuses == dict.fromkeys(["holder", *(name for name, _ in queued)], 200)
    assert finished[0] == "holder"
    return finished[1:]


def test_higher_classes_leave_a_full_queue_first(one_slot_gateway: GatewayProcess) -> None:
    queued = [("low", "low"), ("normal", "normal"), ("high", "high")]
    assert finishing_order(one_slot_gateway, queued) == ["high", "normal", "low"]


def test_without_keys_a_request_that_names_no_class_is_normal(one_slot_gateway: GatewayProcess) -> None:
    # Not high: a client that leaves the header out must not go before one that says normal.
    queued = [("said-normal", "normal"), ("said-nothing", None), ("said-high", "high")]
    assert finishing_order(one_slot_gateway, queued) == ["said-high", "said-normal", "said-nothing"]
