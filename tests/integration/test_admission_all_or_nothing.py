"""A request's choices are admitted all together or not at all.

The attacks: three prompts x n=6 against 16 slots took all 16 and waited for the rest while every
other request waited behind them; two n=4 requests on 4 slots each took some and waited for the
others until both timed out. Now a request that could never fit is refused at once, naming the
field, and concurrent n > 1 requests cannot deadlock one another. A real gateway and CPU worker.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import GatewayProcess
from tests.integration.conftest import demo_entry, write_registry

SLOTS = 4


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    limits = {"max_concurrent_jobs": SLOTS, "max_queued_requests": 64, "request_timeout_s": 30}
    config = write_registry(
        tmp_path_factory.mktemp("admission") / "models.yaml",
        [demo_entry("m", demo_model_dir, limits=limits)],
    )
    with GatewayProcess(config) as gw:
        yield gw


def test_more_generations_than_slots_are_refused_naming_the_field(gateway: GatewayProcess) -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": SLOTS + 1}
    refused = httpx.post(gateway.url + "/v1/chat/completions", json=chat, timeout=10)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n", refused.text
    assert "max_concurrent_jobs" in refused.json()["error"]["message"]
    # The review's shape: three prompts x n=2 is six jobs against four slots.
    text = {"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 2, "n": 2}
    refused = httpx.post(gateway.url + "/v1/completions", json=text, timeout=10)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt", refused.text
    huge = {"model": "m", "prompt": ["x"] * 10_000, "max_tokens": 1}
    refused = httpx.post(gateway.url + "/v1/completions", json=huge, timeout=10)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt", refused.text
    fits = httpx.post(gateway.url + "/v1/completions", json={**text, "n": 1}, timeout=30)
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 3


def test_concurrent_multi_choice_requests_never_deadlock(gateway: GatewayProcess) -> None:
    """Rounds of n=3 and n=4 requests (any two need more than the 4 slots) with plain requests
    between them: every one completes, and no slot is held when they are done."""

    async def one(client: httpx.AsyncClient, n: int) -> tuple[int, int]:
        body = {"model": "m", "prompt": "Once", "max_tokens": 24, "ignore_eos": True, "n": n}
        response = await client.post(gateway.url + "/v1/completions", json=body, timeout=60)
        choices = len(response.json().get("choices", [])) if response.status_code == 200 else 0
        return response.status_code, choices

    async def burst() -> list[tuple[int, int]]:
        async with httpx.AsyncClient() as client:
            shapes = [4, 3, 1, 4, 3, 1, 4, 3, 2, 1, 3, 4]
            return await asyncio.gather(*(one(client, n) for n in shapes))

    results = asyncio.run(burst())
    assert [status for status, _ in results] == [200] * len(results), results
    assert [choices for _, choices in results] == [4, 3, 1, 4, 3, 1, 4, 3, 2, 1, 3, 4]
    # Each waited at most for the others ahead of it, never out to its 30 s deadline: a request
    # that reached it would have ended with a timeout status, not 200 (no wall-clock bound needed).
    workers: list[dict[str, Any]] = gateway.workers()
    assert workers[0]["in_flight"] == 0 and workers[0]["restarts"] == 0


def stream_times(gateway: GatewayProcess, n: int, max_tokens: int) -> tuple[float, float, int]:
    """Seconds until the response started (the request was admitted) and until it ended, and how
    many choices finished."""
    body = {"model": "m", "prompt": "Once", "max_tokens": max_tokens, "ignore_eos": True, "n": n,
            "stream": True}  # fmt: skip
    started = time.monotonic()
    finished = 0
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=60) as response:
        admitted = time.monotonic() - started
        assert response.status_code == 200
        for line in response.iter_lines():
            finished += line.count('"finish_reason":"length"')
    return admitted, time.monotonic() - started, finished


def test_one_of_two_requests_that_cannot_both_fit_runs_at_once(gateway: GatewayProcess) -> None:
    """Two n=3 requests on 4 slots: one is admitted at once with all its choices, the other waits
    holding nothing. Taking slots one choice at a time, each took two and neither started until the
    other's jobs had run to the end."""
    _, job_s, _ = stream_times(gateway, 1, 800)
    results: list[tuple[float, float, int]] = []
    runners = [
        threading.Thread(target=lambda: results.append(stream_times(gateway, 3, 800))) for _ in range(2)
    ]
    for runner in runners:
        runner.start()
    for runner in runners:
        runner.join(60)
    assert len(results) == 2 and all(choices == 3 for _, _, choices in results), results
    first, second = sorted(results)
    # Admitted at once, not after someone's jobs ended. Relative to an 800-token job timed in the
    # same run (seconds), so a loaded host slows both sides alike; half of it is a generous bound.
    assert first[0] < 0.5 * job_s, (first, job_s)
    assert second[0] >= first[0] and second[1] > first[1]
