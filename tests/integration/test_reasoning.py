"""Reasoning output through the openai and anthropic SDKs, on a real CPU worker whose template thinks.

The demo model folder is copied with a chat template that opens `<think>` after the assistant's
generation prompt, as DeepSeek R1's and Qwen3-Thinking's do (`enable_thinking: false` closes an
empty one instead, as Qwen3's does). Random weights never close their thinking on their own, which
is what makes the budget testable: the only way to an answer is the gateway closing the thinking
at the budget and the model continuing after `</think>`; with a required tool call, the answer is
then constrained to the tool's schema while the thinking was free text.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from gateway.demo.model import CHAT_TEMPLATE
from tests.harness import GatewayProcess
from tests.integration.conftest import demo_entry, write_registry

ASK = [{"role": "user", "content": "Is 7 a prime number?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
GREEDY = {"temperature": 0}
_GENERATION_PROMPT = (
    "{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
)
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    _GENERATION_PROMPT,
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}",
)


@pytest.fixture(scope="module")
def thinking_model_dir(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Path:
    assert _GENERATION_PROMPT in CHAT_TEMPLATE
    folder = tmp_path_factory.mktemp("models") / "demo-thinking"
    shutil.copytree(demo_model_dir, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = THINKING_TEMPLATE
    config_path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, thinking_model_dir: Path) -> Iterator[GatewayProcess]:
    config = write_registry(
        tmp_path_factory.mktemp("reasoning") / "models.yaml",
        [
            demo_entry("r1", thinking_model_dir, reasoning_parser="deepseek_r1", tool_call_parser="hermes"),
            demo_entry("q3", thinking_model_dir, reasoning_parser="qwen3"),
            demo_entry("plain", thinking_model_dir),
        ],
    )
    with GatewayProcess(config) as gw:
        yield gw


@pytest.fixture(scope="module")
def client(gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def test_thinking_is_split_from_the_answer_and_a_budget_closes_it(client: openai.OpenAI) -> None:
    # Without a budget the model thinks until max_tokens: everything is reasoning, no answer.
    unbounded = client.chat.completions.create(model="r1", messages=ASK, max_tokens=6, **GREEDY)  # type: ignore[arg-type]
    message = unbounded.choices[0].message
    thought = message.reasoning_content  # type: ignore[attr-defined]
    assert thought and not message.content and unbounded.choices[0].finish_reason == "length"
    assert unbounded.usage.completion_tokens_details.reasoning_tokens == 6  # type: ignore[union-attr]
    # With a budget of 6 the same six tokens are the thinking; then the gateway closes it and the
    # model answers after </think> until max_tokens.
    budgeted = client.chat.completions.create(
        model="r1", messages=ASK, max_tokens=20, extra_body={"thinking_token_budget": 6, **GREEDY}
    )
    message = budgeted.choices[0].message
    assert message.reasoning_content == thought  # type: ignore[attr-defined]
    assert message.content and "</think>" not in message.content
    usage = budgeted.usage
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens == 6  # type: ignore[union-attr]
    assert 6 < usage.completion_tokens <= 20
    assert (
        usage.prompt_tokens == unbounded.usage.prompt_tokens
    )  # the request's prompt, not the continuation's
    # Streamed: reasoning deltas first, then content; together the same message.
    chunks = list(
        client.chat.completions.create(
            model="r1",
            messages=ASK,
            max_tokens=20,
            stream=True,
            extra_body={"thinking_token_budget": 6, **GREEDY},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [getattr(d, "reasoning_content", None) for d in deltas]
    content = [d.content for d in deltas]
    last_reasoning = max(i for i, r in enumerate(reasoning) if r)
    assert not any(content[: last_reasoning + 1])  # no answer before the thinking is over
    assert "".join(r for r in reasoning if r) == thought
    assert "".join(c for c in content if c) == message.content


def test_a_required_tool_call_is_constrained_only_once_the_thinking_is_over(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="r1", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=60,  # type: ignore[list-item]
        extra_body={"thinking_token_budget": 5, **GREEDY},
    )  # fmt: skip
    message = reply.choices[0].message
    assert message.reasoning_content and "{" not in message.reasoning_content  # type: ignore[attr-defined]
    (call,) = message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in (
        "Paris",
        "Rome",
    )
    assert reply.choices[0].finish_reason == "tool_calls"


def test_qwen3_answers_without_thinking_when_the_template_switch_is_off(client: openai.OpenAI) -> None:
    off = client.chat.completions.create(
        model="q3",
        messages=ASK,
        max_tokens=6,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert off.choices[0].message.content and not getattr(off.choices[0].message, "reasoning_content", None)
    on = client.chat.completions.create(model="q3", messages=ASK, max_tokens=6)
    assert on.choices[0].message.reasoning_content and not on.choices[0].message.content  # type: ignore[attr-defined]


def test_a_budget_needs_a_reasoning_parser(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="plain", messages=ASK, max_tokens=4, extra_body={"thinking_token_budget": 2}
        )
    assert refused.value.body["param"] == "thinking_token_budget"  # type: ignore[index]
    plain = client.chat.completions.create(model="plain", messages=ASK, max_tokens=4)
    assert not hasattr(plain.choices[0].message, "reasoning_content")  # no parser: no field at all


def test_responses_api_gives_a_reasoning_item(client: openai.OpenAI) -> None:
    kwargs = dict(model="r1", input="Is 7 a prime number?", max_output_tokens=20, store=False,
                  extra_body={"thinking_token_budget": 6, **GREEDY})  # fmt: skip
    reply = client.responses.create(**kwargs)  # type: ignore[call-overload]
    assert [item.type for item in reply.output] == ["reasoning", "message"]
    thought = reply.output[0].content[0].text  # type: ignore[union-attr,index]
    assert thought and reply.output_text and reply.usage.output_tokens_details.reasoning_tokens == 6  # type: ignore[union-attr]
    with client.responses.stream(**kwargs) as stream:  # type: ignore[arg-type]
        events = list(stream)
    # max_output_tokens ends it (random weights never stop): response.incomplete carries the response.
    assert events[-1].type == "response.incomplete"
    final = events[-1].response  # type: ignore[union-attr]
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")  # type: ignore[union-attr]
    assert streamed == thought and final.output_text == reply.output_text


def test_messages_api_gives_thinking_blocks(gateway: GatewayProcess) -> None:
    with anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0) as sdk:
        budget = {"type": "enabled", "budget_tokens": 6}
        kwargs = dict(model="r1", max_tokens=20, messages=ASK, thinking=budget, extra_body=GREEDY)
        reply = sdk.messages.create(**kwargs)  # type: ignore[arg-type]
        assert [b.type for b in reply.content] == ["thinking", "text"]
        with sdk.messages.stream(**kwargs) as stream:  # type: ignore[arg-type]
            thinking = "".join(e.thinking for e in stream if e.type == "thinking")  # type: ignore[union-attr]
            final = stream.get_final_message()
        assert thinking == reply.content[0].thinking  # type: ignore[union-attr]
        assert [b.type for b in final.content] == ["thinking", "text"]
        assert final.content[1].text == reply.content[1].text  # type: ignore[union-attr]
        # A tool use after thinking: the thinking block, then the constrained call.
        tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}  # type: ignore[index]
        called = sdk.messages.create(
            model="r1", max_tokens=60, messages=ASK, tools=[tool], tool_choice={"type": "any"},  # type: ignore[list-item]
            thinking={"type": "enabled", "budget_tokens": 5}, extra_body=GREEDY,
        )  # fmt: skip
        assert [b.type for b in called.content] == [
            "thinking",
            "tool_use",
        ] and called.stop_reason == "tool_use"
        off = sdk.messages.create(model="q3", max_tokens=6, messages=ASK, thinking={"type": "disabled"})
        assert [b.type for b in off.content] == ["text"]
        with pytest.raises(anthropic.BadRequestError, match="reasoning_parser"):
            sdk.messages.create(model="plain", max_tokens=20, messages=ASK,
                                thinking={"type": "enabled", "budget_tokens": 6})  # fmt: skip
