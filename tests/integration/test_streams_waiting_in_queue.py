"""A streamed request that waits in the gateway's queue longer than `write_stall_timeout_s` is not
taken for a client that stopped reading: no stream is open yet, so there is nothing to read.

Runs a real gateway with a real CPU worker; the fault engine's `<<slow>>` marker makes the request
that holds the model's only slot last long enough for the ones behind it to wait several stall
timeouts.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import GatewayProcess, async_wait_until
from tests.integration.conftest import demo_entry, write_registry

FAULTY = "test:tests.fault_engines.FaultyEngine"
SLOW_STEP_S = 0.05
STALL_S = 0.5
HOLDER_TOKENS = 60  # at least HOLDER_TOKENS * SLOW_STEP_S = 3 s: six stall timeouts
ENV = {"GATEWAY_ALLOW_TEST_ENGINES": "1", "FAULT_SLOW_STEP_S": str(SLOW_STEP_S)}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    config = write_registry(
        tmp_path_factory.mktemp("queued") / "models.yaml",
        [
            demo_entry(
                "m",
                demo_model_dir,
                engine=FAULTY,
                limits={"max_concurrent_jobs": 1, "max_queued_requests": 4},
            )
        ],
        write_stall_timeout_s=STALL_S,
        sse_keepalive_s=0.2,
    )
    with GatewayProcess(config, env=ENV) as gw:
        yield gw


async def read_stream(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[int, list[str]]:
    """The status and every SSE line of a streamed request (the body's text if it was refused)."""
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            return response.status_code, [(await response.aread()).decode(errors="replace")]
        return 200, [line async for line in response.aiter_lines() if line.startswith(("data:", "event:"))]


def test_streams_queued_past_the_stall_timeout_are_served(gateway: GatewayProcess) -> None:
    holder = {"model": "m", "prompt": "<<slow>> hold", "max_tokens": HOLDER_TOKENS, "ignore_eos": True}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    text = {"model": "m", "prompt": "hi", "max_tokens": 4}

    async def both_queued(client: httpx.AsyncClient) -> bool:
        reply = await client.get("/admin/workers")
        return bool(reply.json()["models"]["m"]["queue_depth"] == 2)

    async def scenario() -> tuple[list[tuple[int, list[str]]], float]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as client:
            request = client.build_request("POST", "/v1/completions", json={**holder, "stream": True})
            slot = await client.send(request, stream=True)
            try:
                assert slot.status_code == 200
                lines = slot.aiter_lines()
                while not (await anext(lines)).startswith("data: "):
                    pass  # the holder has the slot once its first token came
                waiting = [
                    asyncio.create_task(read_stream(client, "/v1/chat/completions", chat)),
                    asyncio.create_task(read_stream(client, "/v1/completions", text)),
                ]
                what = "both streams to wait in the queue"
                await async_wait_until(lambda: both_queued(client), what, context=gateway.events)
                queued_at = time.monotonic()
                async for _ in lines:  # the holder runs to its end; the others wait meanwhile
                    pass
            finally:
                await slot.aclose()
            results = await asyncio.gather(*waiting)
            return results, time.monotonic() - queued_at

    results, waited = asyncio.run(scenario())
    assert waited > 4 * STALL_S, f"the streams waited {waited:.2f}s: too short to show anything"
    for status, lines in results:
        assert status == 200, lines
        assert lines[-1] == "data: [DONE]", lines
        assert not any(line.startswith("event: error") for line in lines), lines
        last = json.loads(lines[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "length", lines
    assert "client stopped reading" not in gateway.log()
