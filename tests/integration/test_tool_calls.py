"""Tool calling through the official openai SDK and LangChain, unmodified, on a real CPU worker.

One gateway, two models on the same random-weight demo folder: `m` (its template renders tools,
registry tool_call_parser hermes) and `plain` (a registry template that cannot render tools).
Random weights never choose to call a tool on their own, so the tests use what makes the output a
call regardless: tool_choice required or a named function (constrained decoding to the tool's
schema), or, for the parser of tool_choice auto, a guided_regex that makes the model write a
Hermes <tool_call> block, which the parser must then read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from tests.harness import GatewayProcess
from tests.integration.conftest import demo_entry, write_registry

PLAIN_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    config = write_registry(
        tmp_path_factory.mktemp("tools") / "models.yaml",
        [
            demo_entry("m", demo_model_dir, tool_call_parser="hermes"),
            demo_entry("plain", demo_model_dir, chat_template=PLAIN_CHATML),
        ],
    )
    with GatewayProcess(config) as gw:
        yield gw


@pytest.fixture(scope="module")
def client(gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def test_required_tool_choice_gives_a_valid_call(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=80
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
    for call in calls:
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert args["city"] in ("Paris", "Rome")
        else:
            assert call.function.name == "get_time" and isinstance(args["utc"], bool)


def test_named_function_streamed_and_history_with_tool_results(client: openai.OpenAI) -> None:
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "user", "content": "And in Rome?"},
    ]  # fmt: skip
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(
        model="m",
        messages=history,
        tools=[WEATHER],
        tool_choice=named,
        temperature=0,
        max_tokens=60,
        stream=True,
    )
    name, arguments, finish, ids = "", "", None, set()
    for chunk in stream:
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            assert call.index == 0
            ids.add(call.id) if call.id else None
            name += call.function.name or "" if call.function else ""
            arguments += call.function.arguments or "" if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert name == "get_weather" and len(ids) == 1
    assert json.loads(arguments)["city"] in ("Paris", "Rome")
    assert finish == "stop"  # OpenAI ends a forced function call with stop


def test_tools_are_rendered_by_the_model_template(gateway: GatewayProcess, demo_model_dir: Path) -> None:
    import httpx

    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"}]  # fmt: skip
    got = httpx.post(
        gateway.url + "/v1/tokenize", json={"model": "m", "messages": messages, "tools": [WEATHER]}
    )
    assert got.status_code == 200, got.text
    template_view = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": {"city": "Rome"}}}
                                          for c in m["tool_calls"]]} if "tool_calls" in m else m
                     for m in messages]  # fmt: skip
    expected = AutoTokenizer.from_pretrained(demo_model_dir).apply_chat_template(
        template_view, tools=[WEATHER], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert got.json()["tokens"] == list(expected)
    assert "get_weather" in AutoTokenizer.from_pretrained(demo_model_dir).decode(got.json()["tokens"])


def test_auto_reads_calls_with_the_registry_parser(client: openai.OpenAI) -> None:
    # The regex makes the random model write a Hermes call; tool_choice auto must read it.
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'
    kwargs = dict(model="m", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=150)
    reply = client.chat.completions.create(**kwargs, extra_body={"guided_regex": call})  # type: ignore[call-overload]
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    streamed = client.chat.completions.create(**kwargs, stream=True, extra_body={"guided_regex": call})  # type: ignore[call-overload]
    chunks = list(streamed)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert content == "" and [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == json.loads(message.tool_calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Without tools the same text is plain content: nothing is parsed that was not asked for.
    text = client.chat.completions.create(
        model="m", messages=ASK, temperature=0, max_tokens=150, extra_body={"guided_regex": call}
    )
    assert text.choices[0].message.tool_calls is None and "<tool_call>" in (
        text.choices[0].message.content or ""
    )


def test_refusals_name_the_model_or_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="plain", messages=ASK, tools=[WEATHER], tool_choice="required")
    assert "'plain'" in info.value.message and "tools" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:  # no tool_call_parser in the registry
        client.chat.completions.create(model="plain", messages=ASK, tools=[WEATHER])
    assert info.value.body["param"] == "tool_choice"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="m",
            messages=ASK,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert "nope" in info.value.message
    # Under tool_choice auto a JSON output could never hold a hermes call: refused, not tools dropped.
    for extra, field in (({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"guided_json": {"type": "object"}}, "guided_json")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], extra_body=extra)
        assert info.value.body["param"] == field and "tool call" in info.value.message  # type: ignore[index]
    # tool_choice none: no tools in the prompt and no parsing, a plain answer.
    reply = client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=4
    )
    assert reply.choices[0].message.tool_calls is None


class GetWeather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Rome"] = Field(description="the city")


def test_langchain_bind_tools_and_structured_output(gateway: GatewayProcess) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=gateway.url + "/v1", api_key="unused", model="m", temperature=0,
                     max_tokens=80, max_retries=0)  # type: ignore[call-arg]  # fmt: skip
    message = llm.bind_tools([GetWeather], tool_choice="required").invoke("What is the weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "GetWeather"
    assert message.tool_calls[0]["args"]["city"] in ("Paris", "Rome")
    structured = llm.with_structured_output(GetWeather, method="function_calling").invoke("Weather in Rome?")
    assert isinstance(structured, GetWeather) and structured.city in ("Paris", "Rome")


def _compact(arguments: str) -> str:
    return json.dumps(json.loads(arguments), separators=(",", ":"))


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_required_or_named_call_cut_by_max_tokens_is_still_a_call(
    client: openai.OpenAI, tool_choice: object
) -> None:
    """As OpenAI answers: the unfinished call as tool_calls, with the arguments generated so far,
    and finish_reason length, streamed and not; never the call's text as content."""
    kwargs = dict(model="m", messages=ASK, tools=[WEATHER], tool_choice=tool_choice, temperature=0)
    whole = client.chat.completions.create(**kwargs, max_tokens=80)  # type: ignore[call-overload]
    complete = _compact(whole.choices[0].message.tool_calls[0].function.arguments)
    assert whole.usage is not None and whole.usage.completion_tokens > 4
    # Greedy, so the same tokens with fewer allowed: the first cut that ends inside the arguments.
    for cut_at in range(whole.usage.completion_tokens - 2, 0, -1):
        cut = client.chat.completions.create(**kwargs, max_tokens=cut_at)  # type: ignore[call-overload]
        choice = cut.choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id
        assert complete.startswith(call.function.arguments.replace(" ", ""))
        if call.function.arguments != complete:
            break
    assert call.function.arguments != complete
    streamed = list(client.chat.completions.create(**kwargs, max_tokens=cut_at, stream=True))  # type: ignore[call-overload]
    calls = [t for c in streamed for t in c.choices[0].delta.tool_calls or []]
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == ""
    assert [c.function.name for c in calls if c.function.name] == ["get_weather"]
    assert "".join(c.function.arguments or "" for c in calls) == call.function.arguments
    assert streamed[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_cut_before_its_name_never_returns_its_json_as_content(
    client: openai.OpenAI, stream: bool
) -> None:
    """The enforcer writes each call's name first; a cut that still ends before the name gives the
    one tool's call (or, among several tools, none), never the constrained JSON as text."""
    for tools, max_tokens in (([WEATHER], 3), ([WEATHER, TIME], 3), ([WEATHER], 1)):
        kwargs = dict(model="m", messages=ASK, tools=tools, tool_choice="required", temperature=0,
                      max_tokens=max_tokens)  # fmt: skip
        if stream:
            chunks = list(client.chat.completions.create(**kwargs, stream=True))  # type: ignore[call-overload]
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            names = [
                t.function.name for c in chunks for t in c.choices[0].delta.tool_calls or [] if t.function
            ]
            finish = chunks[-1].choices[0].finish_reason
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]  # type: ignore[call-overload]
            content = choice.message.content or ""
            names = [t.function.name for t in choice.message.tool_calls or []]
            finish = choice.finish_reason
        assert content == "" and finish == "length", (tools, max_tokens)
        assert set(names) <= {"get_weather"} if len(tools) == 1 else names == []
