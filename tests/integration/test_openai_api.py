"""The OpenAI API through the official SDK and raw SSE: both models, chat and text, streamed or not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

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


def test_null_means_the_default_for_nullable_fields(client: openai.OpenAI) -> None:
    # The SDK sends null for a parameter passed as None; OpenAI reads it as the default.
    messages: Any = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model="demo-small", messages=messages, max_tokens=3, n=None, stream=None, logprobs=None,
        extra_body={"ignore_eos": None, "min_tokens": None, "add_generation_prompt": None, "echo": None},
    )  # fmt: skip
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None
    text = client.completions.create(model="demo-small", prompt="hi", max_tokens=3, n=None, stream=None,
                                     echo=None, logprobs=None)  # fmt: skip
    assert len(text.choices) == 1 and not text.choices[0].text.startswith("hi")


@pytest.mark.parametrize("stream", [False, True])
def test_zero_max_tokens_with_echo_returns_the_prompt(
    two_model_gateway: GatewayProcess, client: openai.OpenAI, stream: bool
) -> None:
    body = {"model": "demo-small", "prompt": "Once upon a time", "max_tokens": 0, "echo": True,
            "stream": stream, "stream_options": {"include_usage": True} if stream else None}  # fmt: skip
    response = httpx.post(two_model_gateway.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    if stream:
        events = [
            json.loads(e[len("data: ") :]) for e in response.text.split("\n\n") if e.startswith("data: {")
        ]
        text = "".join(c["choices"][0]["text"] for c in events if c["choices"])
        usage = events[-1]["usage"]
    else:
        text, usage = response.json()["choices"][0]["text"], response.json()["usage"]
    assert text == "Once upon a time"
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] > 0


@pytest.mark.parametrize("logprobs", [0, 1])
def test_completion_top_logprobs_hold_the_sampled_token(client: openai.OpenAI, logprobs: int) -> None:
    # Sampled at temperature 1 from a random model, a token is often not among the top 1.
    reply = client.completions.create(
        model="demo-small", prompt="x", max_tokens=12, temperature=1.0, seed=3, logprobs=logprobs
    )
    result = reply.choices[0].logprobs
    assert result is not None and result.tokens and result.top_logprobs and result.token_logprobs
    for token, logprob, top in zip(result.tokens, result.token_logprobs, result.top_logprobs, strict=True):
        assert top[token] == logprob
        assert len(top) <= logprobs + 1
    if logprobs == 0:
        assert all(len(top) == 1 for top in result.top_logprobs)


@pytest.mark.parametrize(("logprobs", "prompt_logprobs"), [(0, None), (1, None), (1, 3)])
def test_echoed_prompt_top_logprobs_hold_the_prompt_token(
    two_model_gateway: GatewayProcess, logprobs: int, prompt_logprobs: int | None
) -> None:
    # A random model rarely ranks each word of a sentence first: the prompt token is often outside
    # the top 1, and must be there anyway, as for sampled tokens (a larger prompt_logprobs, which
    # the worker scores with more alternatives, must not widen the echoed entries).
    body = {"model": "demo-small", "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 2,
            "temperature": 1.0, "seed": 3, "echo": True, "logprobs": logprobs}  # fmt: skip
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    reply = httpx.post(two_model_gateway.url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    result = reply.json()["choices"][0]["logprobs"]
    assert result["token_logprobs"][0] is None and result["top_logprobs"][0] is None
    entries = list(zip(result["tokens"], result["token_logprobs"], result["top_logprobs"], strict=True))[1:]
    assert len(entries) > 8  # the prompt's other tokens, then the two sampled ones
    for token, logprob, top in entries:
        assert top[token] == logprob and len(top) <= logprobs + 1
    if logprobs == 1:  # a token outside the top 1 comes with the top one: two entries
        assert any(len(top) == 2 for _, _, top in entries)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_give_the_bytes_of_a_token_that_is_part_of_a_character(
    two_model_gateway: GatewayProcess, stream: bool
) -> None:
    # The demo vocabulary (byte-level BPE) splits the emoji into pieces whose texts are all U+FFFD;
    # a bias makes the model answer with the first piece.
    emoji = "\U0001f60a"
    asked = {"model": "demo-small", "prompt": emoji, "add_special_tokens": False}
    tokenized = httpx.post(two_model_gateway.url + "/tokenize", json=asked)
    pieces = tokenized.json()["tokens"]
    assert len(pieces) > 1, tokenized.text
    body = {"model": "demo-small", "messages": [{"role": "user", "content": "Say it"}], "max_tokens": 1,
            "temperature": 0, "logit_bias": {str(pieces[0]): 100}, "logprobs": True, "top_logprobs": 2,
            "stream": stream}  # fmt: skip
    reply = httpx.post(two_model_gateway.url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    if stream:
        chunks = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
        content = [entry for chunk in chunks for choice in chunk["choices"]
                   for entry in (choice.get("logprobs") or {}).get("content") or []]  # fmt: skip
    else:
        content = reply.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 1, content
    token = content[0]
    assert token["token"] == "\ufffd"
    assert token["bytes"] and emoji.encode().startswith(bytes(token["bytes"])), token
    for alternative in token["top_logprobs"]:  # the bias came after them: the model's own top two
        if alternative["token"] != "\ufffd":
            assert bytes(alternative["bytes"]).decode() == alternative["token"], alternative
