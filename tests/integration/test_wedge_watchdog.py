"""The wedge watchdog kills only what is stuck: long chunked prefills and requests the gateway still
holds after their job finished never count against a worker.

Runs a real gateway with real CPU workers (no fault injection): a worker is judged by what it
reports in its heartbeats, its step counter (prefill chunks included) and the jobs its engine holds.
The wedged cases themselves (a stalled or hung generator) are in test_reliability.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import GatewayProcess, async_wait_until, wait_until
from tests.integration.conftest import demo_entry, write_registry

WEDGE_TIMEOUT_S = 1.0
HEARTBEAT_INTERVAL_S = 0.2
# The longest a live worker may go without a reported step: beyond this it would be killed.
STALL_LIMIT_S = WEDGE_TIMEOUT_S + HEARTBEAT_INTERVAL_S
PROMPT_TOKENS = 4000
PREFILLS = 5  # prompts prefilled side by side: no job outputs anything for seconds


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path, demo_model_dir_medium: Path
) -> Iterator[GatewayProcess]:
    limits = {"wedge_timeout_s": WEDGE_TIMEOUT_S, "max_concurrent_jobs": 8}
    config = write_registry(
        tmp_path_factory.mktemp("wedge") / "models.yaml",
        [
            demo_entry(
                "long",
                demo_model_dir_medium,
                max_seq_len=4096,
                max_chunk_size=16,
                max_batch_size=PREFILLS,
                limits=limits,
            ),
            demo_entry(
                "short",
                demo_model_dir,
                limits={**limits, "max_constraint_states": 8192, "max_constraint_compile_s": 60},
            ),
        ],
        heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
        write_stall_timeout_s=6.0,
    )
    with GatewayProcess(config) as gw:
        yield gw


def worker(gw: GatewayProcess, model: str) -> dict[str, Any]:
    return next(w for w in gw.workers() if w["model"] == model)


def test_long_chunked_prefill_is_not_wedged(gateway: GatewayProcess) -> None:
    before = worker(gateway, "long")
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 900) for _ in range(PROMPT_TOKENS)] for _ in range(PREFILLS)]

    async def prefill_all() -> tuple[list[httpx.Response], float]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as client:
            started = time.monotonic()
            bodies = [{"model": "long", "prompt": p, "max_tokens": 2, "ignore_eos": True} for p in prompts]
            replies = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
            return replies, time.monotonic() - started

    replies, elapsed = asyncio.run(prefill_all())
    assert [r.status_code for r in replies] == [200] * PREFILLS, [r.text for r in replies]
    assert all(r.json()["usage"]["prompt_tokens"] == PROMPT_TOKENS for r in replies)
    # 250 chunks of 16 tokens per prompt, all prompts in each step: no Step frame for this long.
    assert elapsed > 2 * STALL_LIMIT_S, f"prefill took {elapsed:.2f}s: too short to show anything"
    # Steps reach the gateway once per heartbeat: the last ones may come a heartbeat after the replies.

    def all_steps_reported() -> dict[str, Any] | None:
        after = worker(gateway, "long")
        return after if after["stats"]["steps"] - before["stats"]["steps"] >= PROMPT_TOKENS // 16 else None

    after = wait_until(all_steps_reported, "the prefill's steps in the heartbeats", context=gateway.events)
    assert after["pid"] == before["pid"] and after["restarts"] == before["restarts"], after
    assert "wedged" not in gateway.log()


def test_job_waiting_for_its_constraint_does_not_count(gateway: GatewayProcess) -> None:
    """The gateway has handed the job over and counts it in flight, but the worker holds it back
    while its constraint compiles in the compiler process: the engine holds nothing to step."""
    before = worker(gateway, "short")
    # The first constraint of a worker also starts its compiler process; this pattern then takes
    # seconds to compile (about 7,000 automaton states).
    pattern = "^[a-z]{1,7000}$"
    body = {
        "model": "short",
        "messages": [{"role": "user", "content": "a code"}],
        "max_tokens": 10,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "code", "schema": {"type": "object", "properties": {
                "code": {"type": "string", "pattern": pattern}}, "required": ["code"]}},
        },
    }  # fmt: skip

    async def scenario() -> tuple[httpx.Response, float, float]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as client:
            started = time.monotonic()
            reply = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            parked_s, parked_since = 0.0, None

            async def measure_until_replied() -> bool:  # how long the worker held the job back
                nonlocal parked_s, parked_since
                now = (await client.get("/admin/workers")).json()["workers"]
                short = next(w for w in now if w["model"] == "short")
                if short["in_flight"] == 1 and short["active_jobs"] + short["queued_jobs"] == 0:
                    parked_since = parked_since or time.monotonic()
                    parked_s = time.monotonic() - parked_since
                return reply.done()

            await async_wait_until(
                measure_until_replied, "the constrained reply", 120, context=gateway.events
            )
            return await reply, parked_s, time.monotonic() - started

    reply, parked_s, elapsed = asyncio.run(scenario())
    assert reply.status_code == 200, reply.text
    assert parked_s > 2 * STALL_LIMIT_S, f"held back for {parked_s:.2f}s of {elapsed:.2f}s: too short"
    after = worker(gateway, "short")
    assert after["pid"] == before["pid"] and after["restarts"] == before["restarts"], after
    assert "wedged" not in gateway.log()


def test_request_held_after_its_job_finished_does_not_count(gateway: GatewayProcess) -> None:
    before = worker(gateway, "short")
    body = json.dumps(
        {
            "model": "short",
            "messages": [{"role": "user", "content": "read slowly"}],
            "max_tokens": 2000,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 20,  # ~2.5 kB per chunk: megabytes, more than the socket buffers hold
            "stream": True,
        }
    ).encode()
    request = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills fast
    client.connect(("127.0.0.1", gateway.port))
    try:
        client.sendall(request)  # and never read
        # The engine finishes the job; the gateway still holds the request, its last chunks unsent,
        # until write_stall_timeout_s drops the client.
        held_since, held_s = None, 0.0

        def measure_until_dropped() -> bool:  # how long the request was held after its job ended
            nonlocal held_since, held_s
            now = worker(gateway, "short")
            if now["stats"]["jobs_finished"] > before["stats"]["jobs_finished"] and not now["active_jobs"]:
                held_since = held_since or time.monotonic()
                held_s = time.monotonic() - held_since
            return "client stopped reading" in gateway.log()

        wait_until(measure_until_dropped, "the client to be dropped", context=gateway.events)
    finally:
        client.close()
    assert held_s > 2 * STALL_LIMIT_S, f"held for {held_s:.2f}s after its job finished: too short"
    after = worker(gateway, "short")
    assert after["pid"] == before["pid"] and after["restarts"] == before["restarts"], after
    assert after["in_flight"] == 0 and "wedged" not in gateway.log()
    hello = {"model": "short", "prompt": "hi", "max_tokens": 3}
    assert httpx.post(gateway.url + "/v1/completions", json=hello).status_code == 200
