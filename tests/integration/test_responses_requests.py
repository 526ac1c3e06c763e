"""POST /v1/responses refuses what it would otherwise run wrongly: a 400 naming the field, in the
Responses API's own terms, never a quiet 200 or a 500.

One real gateway with one tiny CPU model and a SQLite response store (so a coerced `store` would
show as a stored response). Covered: a malformed `text` (format not an object, an unknown key, a
json_schema without its schema); errors that would name the chat API's `messages` (a non-text
content part, an input too long for the model, streamed or not); null for the nullable fields;
roles the Responses API has no message items for; and values of the wrong JSON type, which are
refused rather than coerced. Requests the openai SDK sends keep working.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.harness import GatewayProcess
from tests.integration.conftest import demo_entry, write_registry

KEY = "responses-requests-key-0123456789"
ENV = {"GATEWAY_API_KEYS": KEY, "GATEWAY_ADMIN_KEYS": ""}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    folder = tmp_path_factory.mktemp("responses-requests")
    config = write_registry(folder / "models.yaml", [demo_entry("m", demo_model_dir)],
                            responses={"path": "state/responses.sqlite3"})  # fmt: skip
    with GatewayProcess(config, env=ENV) as process:
        yield process


def create(gateway: GatewayProcess, **fields: Any) -> httpx.Response:
    body = {"model": "m", "input": "Give JSON", "max_output_tokens": 4, "temperature": 0, **fields}
    return httpx.post(gateway.url + "/v1/responses", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip


def assert_refused(reply: httpx.Response, param: str, code: str = "invalid_request") -> dict[str, Any]:
    assert reply.status_code == 400, reply.text
    assert reply.headers["content-type"].startswith("application/json")
    error: dict[str, Any] = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param), error
    return error


@pytest.mark.parametrize(
    ("text", "param"),
    [
        ({"format": "json_object"}, "text.format"),
        ({"format": {}}, "text.format.type"),
        ({"format": {"type": "xml"}}, "text.format.type"),
        ({"foo": 1}, "text.foo"),
        ({"format": {"type": "json_schema", "name": "x"}}, "text.format.schema"),
        ({"format": {"type": "json_schema", "schema": SCHEMA}}, "text.format.name"),
        ({"format": {"type": "json_schema", "name": "x", "schema": "{}"}}, "text.format.schema"),
        ({"format": {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": "yes"}},
         "text.format.strict"),
        ({"format": {"type": "json_object", "schema": SCHEMA}}, "text.format.schema"),
    ],
)  # fmt: skip
def test_a_malformed_text_is_400_naming_the_key(gateway: GatewayProcess, text: Any, param: str) -> None:
    assert_refused(create(gateway, text=text), param)


@pytest.mark.parametrize(
    "text",
    [
        {"format": {"type": "text"}},
        {"format": {"type": "json_object"}},
        {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}},
        {"verbosity": "medium"},
    ],
)
def test_a_well_formed_text_is_run_and_echoed(gateway: GatewayProcess, text: dict[str, Any]) -> None:
    reply = create(gateway, text=text)
    assert reply.status_code == 200, reply.text
    assert reply.json()["text"] == {"format": {"type": "text"}, **text}


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "input_image", "image_url": "https://example.com/a.png"}, "input[1].content"),
        ({"type": "input_file", "file_id": "file-1"}, "input[1].content"),
    ],
)
def test_a_content_part_it_cannot_read_names_input(
    gateway: GatewayProcess, part: dict[str, Any], param: str
) -> None:
    items = [{"role": "user", "content": "x"}, {"role": "user", "content": [part]}]
    error = assert_refused(create(gateway, input=items), param)
    assert part["type"] in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_an_input_too_long_for_the_model_names_input(gateway: GatewayProcess, stream: bool) -> None:
    error = assert_refused(
        create(gateway, input="word " * 4000, stream=stream), "input", "context_length_exceeded"
    )
    assert "maximum context length" in error["message"]


NULLABLE = ["stream", "store", "parallel_tool_calls", "background", "top_logprobs", "max_tool_calls",
            "truncation", "instructions", "service_tier"]  # fmt: skip


@pytest.mark.parametrize("field", NULLABLE)
def test_null_is_the_default_for_a_nullable_field(gateway: GatewayProcess, field: str) -> None:
    reply = create(gateway, **{field: None})
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("application/json")
    assert reply.json()["object"] == "response"


@pytest.mark.parametrize("role", ["tool", "function", "critic"])
def test_a_role_without_message_items_is_400_naming_it(gateway: GatewayProcess, role: str) -> None:
    items = [{"role": "user", "content": "x"}, {"role": role, "content": "y"}]
    error = assert_refused(create(gateway, input=items), "input[1].role")
    assert role in error["message"]
    typed = [{"type": "message", "role": role, "content": "y"}]
    assert_refused(create(gateway, input=typed), "input[0].role")


@pytest.mark.parametrize(
    ("field", "value"),
    [("store", "yes"), ("store", 1), ("stream", "false"), ("max_output_tokens", True),
     ("max_output_tokens", 4.0), ("temperature", True), ("temperature", "0"), ("top_p", "1"),
     ("instructions", 5), ("previous_response_id", 1), ("parallel_tool_calls", "yes"),
     ("max_tool_calls", "2"), ("timeout", True)],
)  # fmt: skip
def test_a_value_of_the_wrong_type_is_refused_not_coerced(
    gateway: GatewayProcess, field: str, value: Any
) -> None:
    assert_refused(create(gateway, **{field: value}), field)


def test_the_sdk_and_whole_numbers_for_numbers_still_work(gateway: GatewayProcess) -> None:
    assert create(gateway, temperature=1, top_p=1, timeout=30).status_code == 200
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0) as client:
        stored = client.responses.create(model="m", input=[{"role": "developer", "content": "Be brief."},
                                                           {"role": "user", "content": "Hi"}],
                                         store=True, max_output_tokens=3, temperature=0.5, top_p=0.9,
                                         text={"format": {"type": "json_schema", "name": "x",
                                                          "schema": SCHEMA}})  # fmt: skip
        assert stored.store is True and client.responses.retrieve(stored.id).id == stored.id
        with client.responses.stream(model="m", input="Hi", max_output_tokens=3,
                                     text={"format": {"type": "json_object"}}) as stream:  # fmt: skip
            events = list(stream)
        assert events[-1].type in ("response.completed", "response.incomplete")
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(
                model="m", input="x", text={"format": {"type": "json_schema", "name": "x"}}
            )  # type: ignore[typeddict-item]
        assert refused.value.body["param"] == "text.format.schema"  # type: ignore[index]
