"""The OpenAI API through the official SDK and raw SSE: both models, chat and text, streamed or not."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.harness import GatewayProcess

MODELS = ["demo-small", "demo-medium"]


@pytest.fixture(scope="module")
def client(two_model_gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=two_model_gateway.url + "/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def test_models_list_both_demo_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert sorted(m.id for m in models.data) == sorted(MODELS)


@pytest.mark.parametrize("model", MODELS)
def test_chat_completion_not_streamed(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello"}], max_tokens=12, temperature=0
    )
    assert reply.object == "chat.completion" and reply.model == model
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.prompt_tokens > 0
    assert 0 < reply.usage.completion_tokens <= 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


@pytest.mark.parametrize("model", MODELS)
def test_chat_completion_streamed_matches_not_streamed(client: openai.OpenAI, model: str) -> None:
    request = dict(
        model=model, messages=[{"role": "user", "content": "Tell a story"}], max_tokens=16, temperature=0
    )
    whole = client.chat.completions.create(**request)  # type: ignore[call-overload]
    chunks = list(
        client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize("model", MODELS)
def test_text_completion_streamed_and_not(client: openai.OpenAI, model: str) -> None:
    whole = client.completions.create(model=model, prompt="Once upon a time", max_tokens=10, temperature=0)
    assert whole.object == "text_completion"
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 10  # type: ignore[union-attr]
    streamed = list(
        client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_alias_routes_to_model(client: openai.OpenAI) -> None:
    by_alias = client.completions.create(model="small", prompt="abc", max_tokens=5, temperature=0)
    by_name = client.completions.create(model="demo-small", prompt="abc", max_tokens=5, temperature=0)
    assert by_alias.choices[0].text == by_name.choices[0].text


def test_raw_sse_framing(two_model_gateway: GatewayProcess) -> None:
    body = {
        "model": "demo-small",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream(
        "POST", two_model_gateway.url + "/v1/chat/completions", json=body, timeout=30
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert len({p["id"] for p in payloads}) == 1
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        reply = client.completions.create(
            model="demo-medium", prompt="x", max_tokens=12, temperature=1.0, seed=seed
        )
        return reply.choices[0].text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
