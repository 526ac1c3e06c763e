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
