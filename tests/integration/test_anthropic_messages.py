"""Anthropic's Messages API through the official `anthropic` SDK, unmodified, on a real CPU worker.

One gateway with an API key (GATEWAY_API_KEYS), so the SDK's `x-api-key` header is what lets it
in; one model on the random-weight demo folder with the hermes tool-call parser, and the same
folder again under a plain ChatML template that never reads tools (as SmolLM2's). Random weights
never call a tool on their own, so the tool-use round trip forces the call the way Anthropic's
own API allows: tool_choice `tool` (a named tool) or `any`, which the gateway turns into
constrained decoding to the tool's input schema.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.harness import GatewayProcess
from tests.integration.conftest import demo_entry, write_registry

KEY = "anthropic-test-key-0123456789"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# This SDK no longer has sampling parameters (Anthropic's newest models take none); the gateway
# still honours them, and greedy decoding makes two requests comparable.
GREEDY = {"temperature": 0}
# ChatML that renders only role and content: tool calls in a history would vanish from the prompt.
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
TOOL_HISTORY = [
    *ASK,
    {"role": "assistant", "content": [CALL]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
]
EMPTY_CONTENT = "all messages must have non-empty content except for the optional final assistant message"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    config = write_registry(
        tmp_path_factory.mktemp("anthropic") / "models.yaml",
        [
            demo_entry("m", demo_model_dir, tool_call_parser="hermes"),
            demo_entry("plain", demo_model_dir, chat_template=PLAIN_TEMPLATE),
        ],  # fmt: skip
    )
    with GatewayProcess(config, env={"GATEWAY_API_KEYS": KEY, "GATEWAY_ADMIN_KEYS": ""}) as gw:
        yield gw


@pytest.fixture(scope="module")
def client(gateway: GatewayProcess) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=gateway.url, api_key=KEY, max_retries=0) as sdk:
        yield sdk


def test_create_with_a_system_prompt_and_usage(client: anthropic.Anthropic, gateway: GatewayProcess) -> None:
    reply = client.messages.create(
        model="m",
        max_tokens=12,
        system="Be brief.",
        messages=ASK,
        metadata={"user_id": "u1"},
        extra_body=GREEDY,
    )
    assert reply.type == "message" and reply.role == "assistant" and reply.model == "m"
    assert reply.id.startswith("msg_") and [b.type for b in reply.content] == ["text"]
    assert reply.stop_reason in ("max_tokens", "end_turn") and reply.stop_sequence is None
    assert 0 < reply.usage.output_tokens <= 12
    # The system prompt is in the prompt: the same count as the chat API's template gives.
    counted = client.messages.count_tokens(model="m", system="Be brief.", messages=ASK)
    chat = [{"role": "system", "content": "Be brief."}, *ASK]
    tokens = httpx.post(gateway.url + "/v1/tokenize", json={"model": "m", "messages": chat},
                        headers={"Authorization": f"Bearer {KEY}"}).json()["count"]  # fmt: skip
    assert (
        reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0)
        == counted.input_tokens
        == tokens
    )
    assert client.messages.count_tokens(model="m", messages=ASK).input_tokens < counted.input_tokens


def test_stream_gives_the_same_message_as_create(client: anthropic.Anthropic) -> None:
    kwargs = dict(model="m", max_tokens=16, messages=ASK, extra_body=GREEDY)
    whole = client.messages.create(**kwargs)  # type: ignore[call-overload]
    with client.messages.stream(**kwargs) as stream:  # type: ignore[arg-type]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_event_sequence_on_the_wire(gateway: GatewayProcess) -> None:
    body = {"model": "m", "max_tokens": 6, "messages": ASK, "stream": True}
    with httpx.stream(
        "POST", gateway.url + "/v1/messages", json=body, headers={"x-api-key": KEY}
    ) as response:
        assert response.status_code == 200
        events = [line[7:] for line in response.iter_lines() if line.startswith("event: ")]
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert set(events[3:-3]) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequences_name_the_one_that_matched(client: anthropic.Anthropic) -> None:
    free = client.messages.create(model="m", max_tokens=30, messages=ASK, extra_body=GREEDY)
    text = free.content[0].text  # type: ignore[union-attr]
    stop = text[8:11]
    assert len(text) > 12 and stop.strip()
    expected = text[: text.index(stop)]
    reply = client.messages.create(
        model="m", max_tokens=30, messages=ASK, extra_body=GREEDY, stop_sequences=["never-there", stop]
    )
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == expected  # type: ignore[union-attr]
    with client.messages.stream(
        model="m", max_tokens=30, messages=ASK, extra_body=GREEDY, stop_sequences=[stop]
    ) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == expected and final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    forced = client.messages.create(
        model="m", max_tokens=60, messages=ASK, tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY,
    )  # fmt: skip
    assert forced.stop_reason == "tool_use"
    (call,) = [b for b in forced.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input["city"] in ("Paris", "Rome")  # type: ignore[index]
    assert call.id.startswith("toolu_")
    called = {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in forced.content]}
    question = {"type": "text", "text": "And should I take an umbrella?"}
    history = [
        *ASK,
        called,
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}, question]},
    ]  # fmt: skip
    answer = client.messages.create(model="m", max_tokens=8, messages=history, tools=[WEATHER])  # type: ignore[arg-type,list-item]
    assert answer.content and answer.stop_reason in ("max_tokens", "end_turn", "tool_use")
    # The tool result reached the prompt: it has more tokens than the same history with an empty one
    # (a call must be answered by the next message, so the result cannot just be left out).
    with_result = client.messages.count_tokens(model="m", messages=history, tools=[WEATHER])  # type: ignore[arg-type,list-item]
    empty_result = {"type": "tool_result", "tool_use_id": call.id}
    empty = [*ASK, called, {"role": "user", "content": [empty_result, question]}]
    without = client.messages.count_tokens(model="m", messages=empty, tools=[WEATHER])  # type: ignore[arg-type,list-item]
    assert with_result.input_tokens > without.input_tokens
    # tool_choice any, streamed: the SDK assembles the tool_use block from input_json_delta events.
    with client.messages.stream(model="m", max_tokens=80, messages=ASK, tools=[WEATHER],  # type: ignore[list-item]
                                tool_choice={"type": "any"}, extra_body=GREEDY) as stream:  # fmt: skip
        final = stream.get_final_message()
    calls = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and calls and calls[0].name == "get_weather"
    assert calls[0].input["city"] in ("Paris", "Rome")  # type: ignore[index]


def test_a_tool_use_cut_by_max_tokens(client: anthropic.Anthropic) -> None:
    named = {"type": "tool", "name": "get_weather"}
    kwargs = dict(model="m", messages=ASK, tools=[WEATHER], tool_choice=named, extra_body=GREEDY)
    whole = client.messages.create(max_tokens=60, **kwargs)  # type: ignore[arg-type]
    cut = client.messages.create(max_tokens=whole.usage.output_tokens - 2, **kwargs)  # type: ignore[arg-type]
    assert cut.stop_reason == "max_tokens"
    (call,) = [b for b in cut.content if b.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input, dict)
    city = call.input.get("city", "")
    assert isinstance(city, str) and any(name.startswith(city) for name in ("Paris", "Rome"))
    with client.messages.stream(max_tokens=whole.usage.output_tokens - 2, **kwargs) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and [b.type for b in final.content] == ["tool_use"]
    assert final.content[0].input == call.input  # type: ignore[union-attr]


def test_prefill_continues_the_assistant_turn(client: anthropic.Anthropic, gateway: GatewayProcess) -> None:
    ask = [*ASK, {"role": "assistant", "content": "The weather is"}]
    reply = client.messages.create(model="m", max_tokens=4, messages=ask, extra_body=GREEDY)
    # The prompt ends inside the assistant's turn, as the chat API's continue_final_message renders it.
    continued = httpx.post(
        gateway.url + "/v1/tokenize",
        json={"model": "m", "messages": ask, "add_generation_prompt": False, "continue_final_message": True},
        headers={"x-api-key": KEY},
    ).json()["count"]
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == continued
    assert client.messages.count_tokens(model="m", messages=ask).input_tokens == continued


def test_errors_have_anthropics_shape_and_name_the_field(
    client: anthropic.Anthropic, gateway: GatewayProcess
) -> None:
    url, headers = gateway.url + "/v1/messages", {"x-api-key": KEY}
    missing = httpx.post(url, json={"model": "m", "messages": ASK}, headers=headers)
    assert missing.status_code == 400
    assert missing.json()["type"] == "error" and missing.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing.json()["error"]["message"]
    for extra, name in (({"top_logprobs": 2}, "top_logprobs"), ({"container": "c"}, "container"),
                        ({"thinking": {"type": "enabled", "budget_tokens": 8}}, "thinking"),
                        ({"output_config": {"effort": "high"}}, "output_config"),
                        # JSON output could never hold a hermes tool call: tools refused, not dropped.
                        ({"tools": [WEATHER], "output_config": {"format": {"type": "json_schema",
                          "schema": {"type": "object"}}}}, "output_config")):  # fmt: skip
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.create(model="m", max_tokens=4, messages=ASK, extra_body=extra)
        assert (
            name in refused.value.message and refused.value.body["error"]["type"] == "invalid_request_error"
        )  # type: ignore[index]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [image]}])  # type: ignore[list-item]
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="nope", max_tokens=4, messages=ASK)
    assert unknown.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with anthropic.Anthropic(base_url=gateway.url, api_key="wrong-key-0123456789", max_retries=0) as stranger:
        with pytest.raises(anthropic.AuthenticationError) as denied:
            stranger.messages.create(model="m", max_tokens=4, messages=ASK)
    assert denied.value.body["type"] == "error"  # type: ignore[index]
    # A bearer token works as well as x-api-key.
    bearer = httpx.post(url, json={"model": "m", "max_tokens": 2, "messages": ASK},
                        headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"


def _refusal(gateway: GatewayProcess, path: str, body: dict[str, object]) -> str:
    """The message of the 400 that `body` gets on `path`, checked to be in Anthropic's shape."""
    response = httpx.post(gateway.url + path, json=body, headers={"x-api-key": KEY})
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
    message: str = response.json()["error"]["message"]
    return message


def test_an_empty_final_assistant_message_is_no_prefill(client: anthropic.Anthropic) -> None:
    plain = client.messages.create(model="m", max_tokens=4, messages=ASK, extra_body=GREEDY)
    counted = client.messages.count_tokens(model="m", messages=ASK).input_tokens
    for empty in ("", []):
        ask = [*ASK, {"role": "assistant", "content": empty}]
        reply = client.messages.create(model="m", max_tokens=4, messages=ask, extra_body=GREEDY)  # type: ignore[arg-type]
        assert reply.content == plain.content and reply.stop_reason == plain.stop_reason
        assert client.messages.count_tokens(model="m", messages=ask).input_tokens == counted  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "messages",
    [[{"role": "user", "content": ""}], [{"role": "user", "content": []}],
     [*ASK, {"role": "assistant", "content": ""}, {"role": "user", "content": "Go on."}],
     [*ASK, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": []}]],
)  # fmt: skip
def test_empty_content_is_refused_but_on_the_final_assistant_message(
    gateway: GatewayProcess, messages: list[dict[str, object]]
) -> None:
    body = {"model": "m", "max_tokens": 4, "messages": messages}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert EMPTY_CONTENT in _refusal(gateway, path, body)


def test_a_prefill_neither_follows_a_call_nor_ends_in_whitespace(gateway: GatewayProcess) -> None:
    # Where the worker would say "continue_final_message needs ...", Anthropic's own refusals.
    body = {"model": "m", "max_tokens": 4, "messages": TOOL_HISTORY[:2]}
    assert "`tool_use` ids were found without `tool_result` blocks immediately after: toolu_1" in _refusal(
        gateway, "/v1/messages", body
    )
    body["messages"] = [*ASK, {"role": "assistant", "content": "The weather is "}]
    assert "final assistant content cannot end with trailing whitespace" in _refusal(
        gateway, "/v1/messages/count_tokens", body
    )


@pytest.mark.parametrize(
    "messages",
    [[{"role": "user", "content": TOOL_HISTORY[2]["content"]}],  # no assistant turn before it
     [*TOOL_HISTORY[:2], {"role": "user", "content": [
         {"type": "tool_result", "tool_use_id": "toolu_2", "content": "sunny"}]}],
     [*TOOL_HISTORY, {"role": "assistant", "content": "Sunny."}, TOOL_HISTORY[2]]],  # not the previous one
)  # fmt: skip
def test_a_tool_result_answers_a_tool_use_of_the_previous_message(
    gateway: GatewayProcess, messages: list[dict[str, object]]
) -> None:
    body = {"model": "m", "max_tokens": 4, "messages": messages}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        message = _refusal(gateway, path, body)
        assert "unexpected `tool_use_id` found in `tool_result` blocks: toolu_" in message
        assert "must have a corresponding `tool_use` block in the previous message" in message


def test_a_tool_use_left_unanswered_earlier_in_the_history_is_refused(gateway: GatewayProcess) -> None:
    # The call at messages[1] is answered by text, then the conversation goes on.
    history = [*TOOL_HISTORY[:2], {"role": "user", "content": "Never mind."},
               {"role": "assistant", "content": "OK."}, {"role": "user", "content": "Hi again"}]  # fmt: skip
    body = {"model": "m", "max_tokens": 4, "messages": history}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert _refusal(gateway, path, body).startswith(
            "messages[1]: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_1."
        )


def test_tool_blocks_need_a_template_that_renders_them(
    client: anthropic.Anthropic, gateway: GatewayProcess
) -> None:
    # The template that reads tools takes the history; the plain one would drop the call: a 400, on
    # the chat API as well.
    assert client.messages.count_tokens(model="m", messages=TOOL_HISTORY).input_tokens > 0  # type: ignore[arg-type]
    assert client.messages.count_tokens(model="plain", messages=ASK).input_tokens > 0
    for ask in (
        lambda: client.messages.create(model="plain", max_tokens=4, messages=TOOL_HISTORY),  # type: ignore[arg-type]
        lambda: client.messages.count_tokens(model="plain", messages=TOOL_HISTORY),  # type: ignore[arg-type]
        lambda: client.messages.count_tokens(  # the calls earlier in a longer history
            model="plain",
            messages=[*TOOL_HISTORY, {"role": "assistant", "content": "Sunny."}, *ASK],  # type: ignore[arg-type]
        ),
    ):
        with pytest.raises(anthropic.BadRequestError, match="cannot render the tool calls of messages.1"):
            ask()
    called = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
        ],
    }
    chat = {
        "model": "plain",
        "max_tokens": 2,
        "messages": [
            {"role": "user", "content": "Weather?"},
            called,
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
    }
    reply = httpx.post(
        gateway.url + "/v1/chat/completions", json=chat, headers={"x-api-key": KEY}, timeout=30
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages.1.tool_calls", reply.text


def test_an_empty_answer_has_no_content_blocks(client: anthropic.Anthropic) -> None:
    free = client.messages.create(model="m", max_tokens=8, messages=ASK, extra_body=GREEDY)
    stop = free.content[0].text[:2]  # type: ignore[union-attr]
    kwargs = dict(model="m", max_tokens=8, messages=ASK, extra_body=GREEDY, stop_sequences=[stop])
    whole = client.messages.create(**kwargs)  # type: ignore[call-overload]
    assert whole.stop_reason == "stop_sequence" and whole.content == []
    with client.messages.stream(**kwargs) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.content == []


STRAY_TYPES = [
    ("/v1/messages", {"max_tokens": True}, "max_tokens"),
    ("/v1/messages", {"max_tokens": 4.0}, "max_tokens"),
    ("/v1/messages", {"temperature": True}, "temperature"),
    ("/v1/messages", {"stream": "true"}, "stream"),
    ("/v1/messages", {"top_k": "2"}, "top_k"),
    ("/v1/messages/count_tokens", {"max_tokens": True}, "max_tokens"),
    ("/v1/messages", {"tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": 1}},
     "disable_parallel_tool_use"),
    ("/v1/messages", {"messages": [*TOOL_HISTORY[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny", "is_error": "false"}]}]},
     "is_error"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "extra", "field"), STRAY_TYPES)
def test_a_value_of_the_wrong_type_is_refused(
    gateway: GatewayProcess, path: str, extra: dict[str, object], field: str
) -> None:
    body = {"model": "m", "max_tokens": 4, "messages": ASK, **extra}
    assert field in _refusal(gateway, path, body)
