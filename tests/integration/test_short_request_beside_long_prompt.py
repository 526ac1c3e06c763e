"""A short request does not wait for someone else's long prompt to be tokenized.

Runs in the pytest process against a real gateway with one real CPU worker (the transformers demo
model). A prompt of a million and a half characters takes the worker's tokenizer about a second
here (far longer than a short request's whole round trip, on any host: both slow down together),
after which the worker refuses it as longer than the context. A short request sent once the long
one's Generate has gone to the worker is read behind it; it must stream its first token before the
long one is answered. With one thread preparing prompts in arrival order, it waited for the whole
tokenization, and its first token always came after the long one's 400.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx

from tests.harness import REPO_ROOT, GatewayProcess, async_wait_until
from tests.integration.conftest import demo_entry, write_registry

LONG_PROMPT_CHARS = 1_500_000


def long_prompt() -> str:
    corpus = (REPO_ROOT / "gateway" / "demo" / "corpus.txt").read_text()
    return (corpus * (LONG_PROMPT_CHARS // len(corpus) + 1))[:LONG_PROMPT_CHARS]


async def first_token_at(client: httpx.AsyncClient) -> float:
    """A short streamed completion: when its first token arrived (it then reads to the end)."""
    body = {"model": "m", "prompt": "The history of", "max_tokens": 4, "ignore_eos": True, "stream": True}
    first: float | None = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                if any(choice.get("text") for choice in json.loads(line[6:]).get("choices", [])):
                    first = time.perf_counter()
    assert first is not None, "the short request streamed no token"
    return first


async def race(gateway: GatewayProcess) -> tuple[float, float, httpx.Response]:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as client:

        async def in_flight() -> int:
            workers = (await client.get("/admin/workers")).json()["workers"]
            return sum(worker["in_flight"] for worker in workers)

        async def idle() -> bool:
            return await in_flight() == 0

        await first_token_at(client)  # one short request first: nothing left to pay once, later
        # Its slot is given back just after its last byte: from then on, a slot taken is the long one's.
        await async_wait_until(idle, "the first short request's slot to be given back", poll_s=0.01)

        async def long_request() -> tuple[float, httpx.Response]:
            body = {"model": "m", "prompt": long_prompt(), "max_tokens": 1}
            response = await client.post("/v1/completions", json=body)
            return time.perf_counter(), response

        long_task = asyncio.create_task(long_request())

        async def long_one_sent() -> bool:
            # The gateway takes the worker's slot for the long request just before it sends its
            # Generate, and the frames to one worker go out in order: the short request's Generate
            # is read behind it.
            assert not long_task.done(), "the long prompt was answered before it was seen in flight"
            return await in_flight() > 0

        await async_wait_until(long_one_sent, "the long request's Generate to go out", poll_s=0.01)
        short_first_token = await first_token_at(client)
        long_answered, long_response = await long_task
    return short_first_token, long_answered, long_response


def test_a_short_request_streams_while_a_long_prompt_ahead_of_it_is_still_tokenized(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    config = write_registry(tmp_path / "models.yaml", [demo_entry("m", demo_model_dir)])
    with GatewayProcess(config) as gateway:
        short_first_token, long_answered, long_response = asyncio.run(race(gateway))
    assert long_response.status_code == 400, long_response.text
    assert long_response.json()["error"]["code"] == "context_length_exceeded"
    assert short_first_token < long_answered, (
        f"the short request's first token came {short_first_token - long_answered:.3f}s after the "
        "long prompt's answer: it waited for the long prompt to be tokenized"
    )
