"""No cross-talk: 32 concurrent greedy streams over two models equal the same requests sent alone."""

from __future__ import annotations

import asyncio

import openai

from tests.harness import GatewayProcess


def test_32_concurrent_streams_match_solo_results(two_model_gateway: GatewayProcess) -> None:
    requests = [
        {
            "model": ("demo-small", "demo-medium")[i % 2],
            "messages": [{"role": "user", "content": f"Request number {i}: describe item {i * 7}."}],
            "max_tokens": 24 + i % 5,
            "temperature": 0,
        }
        for i in range(32)
    ]
    with openai.OpenAI(
        base_url=two_model_gateway.url + "/v1", api_key="unused", max_retries=0
    ) as sync_client:
        solo = [
            sync_client.chat.completions.create(**r).choices[0].message.content  # type: ignore[call-overload]
            for r in requests
        ]
    assert len(set(solo)) > 16  # distinct prompts give distinct texts, so a mix-up would show

    async def stream_one(client: openai.AsyncOpenAI, request: dict[str, object]) -> str:
        parts = []
        async for chunk in await client.chat.completions.create(**request, stream=True):  # type: ignore[call-overload]
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        return "".join(parts)

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=two_model_gateway.url + "/v1", api_key="unused", max_retries=0
        ) as client:
            return await asyncio.gather(*(stream_one(client, r) for r in requests))

    concurrent = asyncio.run(all_at_once())
    mismatches = [i for i, (a, b) in enumerate(zip(solo, concurrent, strict=True)) if a != b]
    assert not mismatches, f"requests {mismatches} differ under concurrency"
