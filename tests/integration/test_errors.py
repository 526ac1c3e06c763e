"""Bad input gets OpenAI-shaped errors with the right status, before any stream opens."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.harness import GatewayProcess


def post(gateway: GatewayProcess, path: str, body: object, **kwargs: object) -> httpx.Response:
    return httpx.post(gateway.url + path, json=body, timeout=30, **kwargs)  # type: ignore[arg-type]


def assert_error(response: httpx.Response, status: int, code: str | None, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert "Traceback" not in error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param


def test_unknown_model_is_404(two_model_gateway: GatewayProcess) -> None:
    body = {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}
    assert_error(post(two_model_gateway, "/v1/chat/completions", body), 404, "model_not_found", "model")


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", 3.5), ("top_p", 0), ("max_tokens", 0), ("n", 100), ("stop", ["x"] * 50), ("seed", -1)],
)
def test_invalid_parameter_is_400_naming_it(
    two_model_gateway: GatewayProcess, field: str, value: object
) -> None:
    body = {"model": "demo-small", "messages": [{"role": "user", "content": "x"}], field: value}
    assert_error(post(two_model_gateway, "/v1/chat/completions", body), 400, "invalid_request", field)


@pytest.mark.parametrize("role", ["user", "system", "tool"])
def test_a_message_without_content_is_400_unless_an_assistants(
    two_model_gateway: GatewayProcess, role: str
) -> None:
    body = {"model": "demo-small", "max_tokens": 2,
            "messages": [{"role": "user", "content": "x"}, {"role": role, "content": None}]}  # fmt: skip
    response = post(two_model_gateway, "/v1/chat/completions", body)
    assert_error(response, 400, "invalid_request", "messages.1.content")
    assert f"a {role} message needs content" in response.json()["error"]["message"]
    # Omitted is the same as null; an assistant's turn may be only its tool calls.
    del body["messages"][1]["content"]  # type: ignore[index]
    assert_error(
        post(two_model_gateway, "/v1/chat/completions", body), 400, "invalid_request", "messages.1.content"
    )
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    body["messages"] = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    assert post(two_model_gateway, "/v1/chat/completions", body).status_code == 200
    responses = post(two_model_gateway, "/v1/responses", {"model": "demo-small", "input": [{"role": role}]})
    assert_error(responses, 400, "invalid_request", "input")
    assert f"input[0].content: a {role} message needs content" in responses.json()["error"]["message"]


def test_missing_messages_and_bad_json(two_model_gateway: GatewayProcess) -> None:
    assert_error(
        post(two_model_gateway, "/v1/chat/completions", {"model": "demo-small"}), 400, None, "messages"
    )
    json_type = {"content-type": "application/json"}
    raw = httpx.post(
        two_model_gateway.url + "/v1/completions", content=b"{not json", headers=json_type, timeout=10
    )
    assert_error(raw, 400, "invalid_request")
    # Without a JSON content type the body is not even read: a browser's "simple" cross-origin POST
    # carries none, or text/plain.
    untyped = httpx.post(
        two_model_gateway.url + "/v1/completions", content=b'{"model": "demo-small"}', timeout=10
    )
    assert_error(untyped, 415, None)


@pytest.mark.parametrize("stream", [False, True])
def test_context_length_exceeded_before_stream(two_model_gateway: GatewayProcess, stream: bool) -> None:
    body = {"model": "demo-small", "prompt": "word " * 4000, "max_tokens": 5, "stream": stream}
    response = post(two_model_gateway, "/v1/completions", body)
    assert_error(response, 400, "context_length_exceeded")
    assert response.headers["content-type"].startswith("application/json")


def test_oversized_body_is_413(two_model_gateway: GatewayProcess) -> None:
    body = {"model": "demo-small", "prompt": "x" * (9 * 1024 * 1024)}
    assert_error(post(two_model_gateway, "/v1/completions", body), 413, None)


def test_unknown_route_is_openai_shaped_404(two_model_gateway: GatewayProcess) -> None:
    assert_error(httpx.get(two_model_gateway.url + "/v1/nothing", timeout=10), 404, None)


def test_sdk_raises_typed_exceptions(two_model_gateway: GatewayProcess) -> None:
    with openai.OpenAI(base_url=two_model_gateway.url + "/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="missing", prompt="x")
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="demo-small", prompt="word " * 4000, stream=True)
    assert info.value.code == "context_length_exceeded"


def test_unknown_fields_are_ignored(two_model_gateway: GatewayProcess) -> None:
    body = {"model": "demo-small", "prompt": "hi", "max_tokens": 2, "vendor_extension": {"x": 1}}
    response = post(two_model_gateway, "/v1/completions", body)
    assert response.status_code == 200, response.text


def post_raw(gateway: GatewayProcess, path: str, text: str) -> httpx.Response:
    """A body as written: httpx's `json=` refuses NaN, which Python's json (and so Quart) reads."""
    headers = {"content-type": "application/json"}
    return httpx.post(gateway.url + path, content=text.encode(), headers=headers, timeout=30)


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CHAT = {"model": "demo-small", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.mark.parametrize("function", ["get_weather", [1], 7, {"name": 7}])
def test_a_malformed_named_tool_choice_is_400(two_model_gateway: GatewayProcess, function: object) -> None:
    body = {**CHAT, "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": function}}
    assert_error(post(two_model_gateway, "/v1/chat/completions", body), 400, "invalid_request", "tool_choice")


def nested(depth: int, leaf: str = "1") -> str:
    return '{"x": ' * depth + leaf + "}" * depth


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (f'"tools": [{{"type": "function", "function": {{"name": "f", "parameters": {nested(34)}}}}}]',
         "tools.0.function.parameters"),
        ('"tools": [{"type": "function", "function": {"name": "f", "parameters": {"x": NaN}}}]',
         "tools.0.function.parameters"),
        ('"functions": [{"name": "f", "parameters": {"x": [Infinity]}}]', "functions.0.parameters"),
        ('"chat_template_kwargs": {"enable_thinking": NaN}', "chat_template_kwargs"),
        (f'"chat_template_kwargs": {{"deep": {nested(34)}}}', "chat_template_kwargs"),
    ],
)  # fmt: skip
def test_free_form_fields_too_deep_or_not_finite_are_400(
    two_model_gateway: GatewayProcess, fields: str, param: str
) -> None:
    text = (
        '{"model": "demo-small", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, '
        + fields
        + "}"
    )
    assert_error(post_raw(two_model_gateway, "/v1/chat/completions", text), 400, "invalid_request", param)


# vLLM's extensions that change the output and that nothing here honours, with a value that does.
VLLM_REFUSED = [
    ("use_beam_search", True),
    ("return_tokens_as_token_ids", True),
    ("length_penalty", 0.5),
    ("skip_special_tokens", False),
    ("logits_processors", ["my_module.Processor"]),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(("field", "value"), VLLM_REFUSED)
def test_vllm_extensions_that_would_change_the_output_are_400_naming_them(
    two_model_gateway: GatewayProcess, path: str, field: str, value: object
) -> None:
    base = (
        CHAT if path == "/v1/chat/completions" else {"model": "demo-small", "prompt": "Hi", "max_tokens": 4}
    )
    assert_error(post(two_model_gateway, path, {**base, field: value}), 400, "invalid_request", field)
    # null, or the value that changes nothing, is what leaving it out means.
    harmless = {"use_beam_search": False, "length_penalty": 1.0, "skip_special_tokens": True}
    assert post(two_model_gateway, path, {**base, field: harmless.get(field)}).status_code == 200


def test_error_params_name_the_field_the_client_sent(two_model_gateway: GatewayProcess) -> None:
    too_long = {"model": "demo-small", "prompt": "word " * 4000, "max_tokens": 5}
    assert_error(
        post(two_model_gateway, "/v1/completions", too_long), 400, "context_length_exceeded", "prompt"
    )
    chat_too_long = {**CHAT, "messages": [{"role": "user", "content": "word " * 4000}]}
    assert_error(
        post(two_model_gateway, "/v1/chat/completions", chat_too_long),
        400,
        "context_length_exceeded",
        "messages",
    )
    for field in ("guided_regex", "regex_pattern"):
        bad_regex = {**CHAT, field: "(unclosed"}
        assert_error(post(two_model_gateway, "/v1/chat/completions", bad_regex), 400, None, field)
    reserved = {**CHAT, "chat_template_kwargs": {"add_generation_prompt": False}}
    assert_error(post(two_model_gateway, "/v1/chat/completions", reserved), 400, None, "chat_template_kwargs")
    out_of_range = {"model": "demo-small", "prompt": [1, 2**30], "max_tokens": 2, "echo": True}
    assert_error(post(two_model_gateway, "/v1/completions", out_of_range), 400, None, "prompt")
