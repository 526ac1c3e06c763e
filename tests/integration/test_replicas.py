"""Replicas: least-outstanding-work routing, per-replica visibility, and moving unstarted requests."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import GatewayProcess, async_wait_until, wait_until
from tests.integration.conftest import demo_entry, write_registry


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    config = write_registry(
        tmp_path_factory.mktemp("replicas") / "models.yaml",
        [demo_entry("m", demo_model_dir, replicas=3)],
        restart_backoff_s=0.2,
    )
    with GatewayProcess(config) as gw:
        # /health/ready needs one ready replica per model; these tests need all three.
        wait_until(
            lambda: all(w["state"] == "ready" and w["stats"]["steps"] > 0 for w in gw.workers()),
            "all three replicas ready, each with a heartbeat's stats",
            context=gw.events,
        )
        yield gw


def replicas(gateway: GatewayProcess) -> list[dict[str, Any]]:
    return sorted((w for w in gateway.workers() if w["model"] == "m"), key=lambda w: int(w["replica"]))


async def send_all(gateway: GatewayProcess, count: int, max_tokens: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
        body = {"model": "m", "prompt": "spread", "max_tokens": max_tokens, "ignore_eos": True}
        return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(count)))


def test_each_replica_is_its_own_process_and_load_is_spread(gateway: GatewayProcess) -> None:
    workers = replicas(gateway)
    assert [w["id"] for w in workers] == ["m#0-r0", "m#0-r1", "m#0-r2"]
    assert len({w["pid"] for w in workers}) == 3 and all(w["state"] == "ready" for w in workers)
    before = [int(w["stats"]["generated_tokens"]) for w in workers]
    replies = asyncio.run(send_all(gateway, 12, 64))
    assert all(r.status_code == 200 for r in replies)

    def served() -> list[int] | None:
        after = [int(w["stats"]["generated_tokens"]) for w in replicas(gateway)]
        tokens = [a - b for a, b in zip(after, before, strict=True)]
        return tokens if sum(tokens) == 12 * 64 else None

    # Heartbeats carry the counters: wait until they have counted every token, then compare.
    tokens = wait_until(served, "the heartbeats to count all 12 x 64 tokens", context=gateway.events)
    assert tokens == [4 * 64] * 3, tokens  # equal requests: least outstanding work gives 4 each
    assert all(w["outstanding_tokens"] == 0 and w["in_flight"] == 0 for w in replicas(gateway))


def test_unstarted_requests_move_to_another_replica_when_theirs_dies(gateway: GatewayProcess) -> None:
    victim = replicas(gateway)[0]
    pid = int(victim["pid"])
    os.kill(pid, signal.SIGSTOP)  # frozen: it will never accept what is sent to it

    async def scenario() -> list[httpx.Response]:
        task = asyncio.create_task(send_all(gateway, 6, 16))
        await async_wait_until(
            lambda: replicas(gateway)[0]["in_flight"] > 0, "a request placed on the frozen replica"
        )
        os.kill(pid, signal.SIGKILL)
        return await task

    replies = asyncio.run(scenario())
    assert [r.status_code for r in replies] == [200] * 6, [r.text for r in replies if r.status_code != 200]

    def victim_ready() -> dict[str, Any] | None:
        now = replicas(gateway)[0]
        return now if now["state"] == "ready" else None

    restarted = wait_until(victim_ready, "the killed replica to be ready again", context=gateway.events)
    assert restarted["pid"] != pid and restarted["restarts"] == 1
