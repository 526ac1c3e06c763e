"""Every common parameter through the official openai SDK (sync, async, streaming), with its effect.

One real gateway with one CPU worker. Greedy decoding is deterministic, so each parameter's effect
is checked against a greedy baseline of the same request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from tests.harness import GatewayProcess
from tests.integration.conftest import demo_entry, write_registry

PROMPT = "The weather today"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    config = write_registry(tmp_path_factory.mktemp("sdk") / "models.yaml", [demo_entry("m", demo_model_dir)])
    with GatewayProcess(config) as gw:
        yield gw


@pytest.fixture(scope="module")
def client(gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def text(client: openai.OpenAI, **kw: object) -> str:
    reply = client.completions.create(model="m", prompt=PROMPT, **{"max_tokens": 24, "temperature": 0, **kw})  # type: ignore[call-overload]
    return str(reply.choices[0].text)


def test_sampling_parameters_take_effect(client: openai.OpenAI) -> None:
    greedy = text(client)
    # Settings that leave only the top token are greedy, whatever the temperature.
    assert text(client, temperature=1.0, extra_body={"top_k": 1}, seed=1) == greedy
    assert text(client, temperature=1.0, top_p=0.000001, seed=2) == greedy
    assert text(client, temperature=1.0, extra_body={"min_p": 1.0}, seed=3) == greedy
    assert text(client, temperature=1.0, seed=4) != greedy
    assert text(client, temperature=1.0, extra_body={"typical_p": 0.5}, seed=5)  # accepted and runs
    assert text(client, frequency_penalty=2.0, max_tokens=48) != text(client, max_tokens=48)
    assert text(client, presence_penalty=2.0, max_tokens=48) != text(client, max_tokens=48)
    assert text(client, extra_body={"repetition_penalty": 2.0}, max_tokens=48) != text(client, max_tokens=48)


def test_seed_and_n(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=1.0, n=3, seed=11)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.text for c in reply.choices}) == 3  # choice i uses seed + i
    again = client.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=1.0, n=3, seed=11)
    assert [c.text for c in again.choices] == [c.text for c in reply.choices]
    assert reply.usage is not None and reply.usage.completion_tokens == 36


def test_stop_finish_reason_and_usage(client: openai.OpenAI, demo_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    whole = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 24
    assert whole.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    full = whole.choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    for stop_param in (stop, [stop, "never-appears"]):
        cut = client.completions.create(
            model="m", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop_param
        )
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == full[: full.index(stop)]


def test_logit_bias_min_tokens_and_ignore_eos(client: openai.OpenAI, demo_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    forced = tokenizer.encode(" the", add_special_tokens=False)[0]
    reply = client.completions.create(
        model="m", prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={str(forced): 100}
    )
    assert tokenizer.encode(reply.choices[0].text, add_special_tokens=False) == [forced] * 6
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ended = client.completions.create(
        model="m", prompt=PROMPT, max_tokens=20, temperature=0, logit_bias={str(eos): 100}
    )
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1  # type: ignore[union-attr]
    held = client.completions.create(
        model="m",
        prompt=PROMPT,
        max_tokens=20,
        temperature=0,
        logit_bias={str(eos): 100},
        extra_body={"min_tokens": 5},
    )
    assert held.usage.completion_tokens == 6  # type: ignore[union-attr]  # 5 forced, then the biased EOS
    ignored = client.completions.create(
        model="m",
        prompt=PROMPT,
        max_tokens=20,
        temperature=0,
        logit_bias={str(eos): 100},
        extra_body={"ignore_eos": True},
    )
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 20  # type: ignore[union-attr]


def test_prompt_forms_echo_and_user(client: openai.OpenAI, demo_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model="m", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text and by_ids.usage.prompt_tokens == len(ids)  # type: ignore[union-attr]
    batch = client.completions.create(model="m", prompt=[PROMPT, "Another"], max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == by_text.choices[0].text[
        : len(batch.choices[0].text)
    ]
    ids_batch = client.completions.create(model="m", prompt=[ids, ids], max_tokens=4, temperature=0)
    assert ids_batch.choices[0].text == ids_batch.choices[1].text
    echoed = client.completions.create(
        model="m", prompt=PROMPT, max_tokens=8, temperature=0, echo=True, user="u-1"
    )
    assert echoed.choices[0].text == PROMPT + by_text.choices[0].text


def test_usage_counts_each_prompt_of_a_list_once(client: openai.OpenAI, demo_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    # Two different prompts of the same length (3 tokens each): their usage is 6, not 3.
    first, second = tokenizer.encode(PROMPT)[:3], tokenizer.encode("Once upon a time")[:3]
    assert first != second and len(first) == len(second) == 3
    request = {"model": "m", "prompt": [first, second], "max_tokens": 2, "temperature": 0,
               "extra_body": {"ignore_eos": True}}  # fmt: skip
    usage = client.completions.create(**request).usage  # type: ignore[call-overload]
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (6, 4, 10)
    # n choices share their prompt: each prompt still counts once, each choice's tokens count.
    usage = client.completions.create(**request, n=3).usage  # type: ignore[call-overload]
    assert (usage.prompt_tokens, usage.completion_tokens) == (6, 12)
    stream = client.completions.create(  # type: ignore[call-overload]
        **request, n=2, stream=True, stream_options={"include_usage": True}
    )
    last = list(stream)[-1]
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (6, 8)


def test_logprobs(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=6, temperature=0,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6 == chat.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy picks the top one
    legacy = client.completions.create(model="m", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == 5  # type: ignore[arg-type]
    assert all(len(alts) == 2 for alts in lp.top_logprobs)  # type: ignore[union-attr]


def test_streaming_sync_and_async(client: openai.OpenAI, gateway: GatewayProcess) -> None:
    whole = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "stream"}], max_tokens=16, temperature=0
    )
    chunks = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "stream"}], max_tokens=16, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    parts = list(chunks)
    assert (
        "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
        == whole.choices[0].message.content
    )
    assert parts[-1].usage.completion_tokens == 16  # type: ignore[union-attr]

    async def run() -> str:
        async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as sdk:
            stream = await sdk.completions.create(
                model="m", prompt=PROMPT, max_tokens=24, temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in stream])

    assert asyncio.run(run()) == text(client)


def test_typed_exceptions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    assert client.models.retrieve("m").id == "m"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="m", prompt=PROMPT, temperature=5)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], top_logprobs=3)
