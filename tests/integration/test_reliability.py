"""Faults: worker crashes, engine exceptions, hangs, wedges, overload, deadlines, disconnect storms.

Runs real gateway and worker processes; faults come from tests/fault_engines.py, triggered by a
marker in the prompt, so a faulty worker and a healthy one run side by side.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.harness import GatewayProcess
from tests.integration.conftest import demo_entry, write_registry

FAULTY = "test:tests.fault_engines.FaultyEngine"
ENV = {"GATEWAY_ALLOW_TEST_ENGINES": "1", "FAULT_SLOW_STEP_S": "0.03"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    config = write_registry(
        tmp_path_factory.mktemp("rel") / "models.yaml",
        [
            demo_entry("healthy", demo_model_dir),
            demo_entry(
                "faulty",
                demo_model_dir,
                engine=FAULTY,
                max_batch_size=1,
                limits={"max_concurrent_jobs": 4, "max_queued_requests": 2, "wedge_timeout_s": 2},
            ),
        ],
        heartbeat_timeout_s=3,
        restart_backoff_s=0.2,
        sse_keepalive_s=0.3,
    )
    with GatewayProcess(config, env=ENV) as gw:
        yield gw


def worker(gw: GatewayProcess, model: str) -> dict[str, object]:
    return next(w for w in gw.workers() if w["model"] == model)


def wait_ready(gw: GatewayProcess, model: str, timeout: float = 60) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = worker(gw, model)
        if info["state"] == "ready":
            return info
        time.sleep(0.1)
    raise AssertionError(f"{model} not ready again: {worker(gw, model)}")


def sse_events(response: httpx.Response) -> Iterator[tuple[str | None, str]]:
    event: str | None = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line[len("event: ") :]
        elif line.startswith("data: "):
            yield event, line[len("data: ") :]
            event = None
        elif line.startswith(":"):
            yield "comment", line


def completion(model: str, prompt: str, **extra: object) -> dict[str, object]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
        **extra,
    }


@pytest.mark.parametrize("fault", ["segfault", "crash"])
def test_worker_death_mid_stream_ends_with_error_event(gateway: GatewayProcess, fault: str) -> None:
    wait_ready(gateway, "faulty")
    restarts_before = worker(gateway, "faulty")["restarts"]

    async def scenario() -> tuple[list[tuple[str | None, str]], float, str]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            healthy = asyncio.create_task(
                client.post("/v1/completions", json=completion("healthy", "fine", max_tokens=200))
            )
            events: list[tuple[str | None, str]] = []
            started = time.monotonic()
            body = completion("faulty", f"<<{fault}>> go", stream=True)
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                event: str | None = None
                async for line in response.aiter_lines():
                    if line.startswith("event: "):
                        event = line[7:]
                    elif line.startswith("data: "):
                        events.append((event, line[6:]))
                        event = None
            elapsed = time.monotonic() - started
            healthy_reply = await healthy
            return events, elapsed, healthy_reply.json()["choices"][0]["finish_reason"]

    events, elapsed, healthy_finish = asyncio.run(scenario())
    assert elapsed < 2.0 + 1.0  # the fault fires after 10 steps; the error must follow within 2 s
    assert events[-1] == (None, "[DONE]")
    kind, payload = events[-2]
    assert kind == "error"
    assert json.loads(payload)["error"]["code"] == "worker_failed"
    assert healthy_finish == "length"  # the other model never noticed
    info = wait_ready(gateway, "faulty")
    assert info["restarts"] == restarts_before + 1  # type: ignore[operator]
    # The cause stays visible after the restart: the engine's own error, or the signal.
    expected = "RuntimeError: injected engine fault" if fault == "crash" else "killed by signal 11"
    assert expected in str(info["last_error"]), info


def test_worker_death_before_stream_is_503(gateway: GatewayProcess) -> None:
    wait_ready(gateway, "faulty")
    started = time.monotonic()
    response = httpx.post(gateway.url + "/v1/completions", json=completion("faulty", "<<crash>>"), timeout=30)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "worker_failed"
    assert time.monotonic() - started < 3.0
    wait_ready(gateway, "faulty")


# A hung step also stops progress, so whichever of the two watchdogs fires first is right.
@pytest.mark.parametrize(("fault", "reason"), [("stall", "wedged"), ("hang", "(wedged|no heartbeat)")])
def test_hung_or_wedged_worker_is_killed_and_restarted(
    gateway: GatewayProcess, fault: str, reason: str
) -> None:
    wait_ready(gateway, "faulty")
    restarts = worker(gateway, "faulty")["restarts"]
    response = httpx.post(
        gateway.url + "/v1/completions", json=completion("faulty", f"<<{fault}>>"), timeout=30
    )
    assert response.status_code == 503
    assert re.search(reason, response.json()["error"]["message"])
    info = wait_ready(gateway, "faulty")
    assert info["restarts"] == restarts + 1  # type: ignore[operator]


def test_full_queue_is_refused_fast_and_accepted_requests_finish(gateway: GatewayProcess) -> None:
    wait_ready(gateway, "faulty")

    async def scenario() -> tuple[list[int], float, dict[str, str]]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            body = completion("faulty", "<<slow>> hold", max_tokens=40)
            holders = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(6)]
            await asyncio.sleep(0.5)  # 4 slots taken, 2 queued in the gateway
            started = time.monotonic()
            refused = await client.post("/v1/completions", json=completion("faulty", "one too many"))
            elapsed = time.monotonic() - started
            statuses = [r.status_code for r in await asyncio.gather(*holders)]
            assert refused.status_code == 429, refused.text
            return statuses, elapsed, dict(refused.headers)

    statuses, elapsed, headers = asyncio.run(scenario())
    assert elapsed < 0.1
    assert headers["retry-after"] == "1"
    assert statuses == [200] * 6


@pytest.mark.parametrize("stream", [False, True])
def test_deadline_cancels_the_job(gateway: GatewayProcess, stream: bool) -> None:
    wait_ready(gateway, "faulty")
    body = completion("faulty", "<<slow>> late", timeout=1.0, stream=stream)
    started = time.monotonic()
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=30) as response:
        if stream:
            assert response.status_code == 200
            events = list(sse_events(response))
            kind, payload = [e for e in events if e[0] != "comment"][-2]
            assert kind == "error" and json.loads(payload)["error"]["code"] == "request_timeout"
        else:
            response.read()
            assert response.status_code == 408
            assert response.json()["error"]["code"] == "request_timeout"
    assert time.monotonic() - started < 2.5
    deadline = time.monotonic() + 2
    while worker(gateway, "faulty")["active_jobs"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker(gateway, "faulty")["active_jobs"] == 0


def test_keepalive_comments_while_waiting_in_worker_queue(gateway: GatewayProcess) -> None:
    wait_ready(gateway, "faulty")

    async def scenario() -> list[tuple[str | None, str]]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            # max_batch_size is 1: the second request waits in the worker's queue behind the first.
            blocker = asyncio.create_task(
                client.post("/v1/completions", json=completion("faulty", "<<slow>> first", max_tokens=60))
            )
            await asyncio.sleep(0.3)
            seen: list[tuple[str | None, str]] = []
            body = completion("faulty", "second", max_tokens=5, stream=True)
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith(":"):
                        seen.append(("comment", line))
                    elif line.startswith("data: "):
                        seen.append((None, line[6:]))
            await blocker
            return seen

    seen = asyncio.run(scenario())
    first_data = next(i for i, (kind, _) in enumerate(seen) if kind is None)
    comments_before_tokens = [e for e in seen[: first_data + 2] if e[0] == "comment"]
    assert comments_before_tokens, seen[:5]
    assert seen[-1] == (None, "[DONE]")


def test_disconnect_storm_leaves_no_jobs(gateway: GatewayProcess) -> None:
    wait_ready(gateway, "faulty")

    async def one(client: httpx.AsyncClient, i: int) -> None:
        model = "healthy" if i % 2 else "faulty"
        body = completion(model, f"storm {i}", max_tokens=1500, stream=True)
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    return
                seen = 0
                async for _ in response.aiter_lines():
                    seen += 1
                    if seen > i % 7:
                        return  # leave at a different point each time: queued, prefill, decoding
        except httpx.HTTPError:
            pass

    async def storm() -> None:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(24)]
            await asyncio.sleep(0.05)
            # Some clients give up before they are even admitted.
            for task in tasks[::5]:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(storm())
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        workers = gateway.workers()
        if all(w["active_jobs"] == 0 and w["queued_jobs"] == 0 and w["in_flight"] == 0 for w in workers):
            break
        time.sleep(0.1)
    assert all(w["active_jobs"] == 0 and w["queued_jobs"] == 0 and w["in_flight"] == 0 for w in workers), (
        workers
    )
