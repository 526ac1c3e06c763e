"""response_format over HTTP through the official SDK: json_schema and json_object, and bad formats.

Runs in the pytest process against a real gateway and a real CPU worker. The demo model has random
weights and knows nothing about JSON, so every bit of structure comes from the enforcer; it also
never closes a free-form string by itself, so the schema bounds every string (maxLength, enum) and
array (maxItems), and JSON mode gets a logit bias towards `"` and `}` (see the unit tests).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.harness import GatewayProcess
from tests.integration.conftest import demo_entry, write_registry

MODEL = "demo-small"
MESSAGES: list[Any] = [{"role": "user", "content": "Describe a fruit as JSON."}]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "fruit": {"type": "string", "maxLength": 10},
        "color": {"enum": ["red", "yellow", "green"]},
        "seeds": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["sweet", "sour"]}, "maxItems": 2},
    },
    "required": ["fruit", "color", "seeds", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "fruit", "schema": SCHEMA, "strict": True},
}
# Leaves room for the enforcer's whitespace runs between tokens (up to 12 at a time).
MAX_TOKENS = 1024


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    config = write_registry(
        tmp_path_factory.mktemp("gw") / "models.yaml", [demo_entry(MODEL, demo_model_dir)]
    )
    with GatewayProcess(config) as process:
        yield process


@pytest.fixture(scope="module")
def client(gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def test_chat_json_schema(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=7, n=2,
        response_format=JSON_SCHEMA_FORMAT,
    )  # fmt: skip
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_chat_json_schema_streamed(client: openai.OpenAI) -> None:
    chunks = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        response_format=JSON_SCHEMA_FORMAT,
    )  # fmt: skip
    pieces, finish = [], []
    for chunk in chunks:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish.append(choice.finish_reason)
    assert [f for f in finish if f] == ["stop"]
    jsonschema.validate(json.loads("".join(pieces)), SCHEMA)


def test_chat_json_object(client: openai.OpenAI, demo_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    quote, close = (tokenizer.encode(c, add_special_tokens=False)[-1] for c in ('"', "}"))
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=512, temperature=0,
        response_format={"type": "json_object"}, logit_bias={str(quote): 20, str(close): 8},
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


def test_text_completion_accepts_response_format(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL, prompt="Fruit as JSON:", max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"response_format": JSON_SCHEMA_FORMAT},
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].text), SCHEMA)


def test_text_format_is_plain_generation(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, response_format={"type": "text"}
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "yaml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "has space", "schema": SCHEMA}},
        {"type": "json_schema", "json_schema": {"name": "s", "schema": ["not", "an", "object"]}},
    ],
)
def test_malformed_response_format_is_rejected_by_the_gateway(
    client: openai.OpenAI, response_format: Any
) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, response_format=response_format
        )
    body: Any = error.value.body
    assert body["param"] == "response_format"


def test_schema_the_enforcer_cannot_use_is_rejected_by_the_worker(client: openai.OpenAI) -> None:
    bad: Any = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "frobnicate"}}}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, response_format=bad)
    body: Any = error.value.body
    assert body["code"] == "invalid_response_format" and body["param"] == "response_format"
    # The worker is unharmed: the next request is served.
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4).choices


# Valid schemas lm-format-enforcer alone misread: a mixed-type enum failed once generation reached
# it (the job ended "stop" on `{"a"`), booleans came out as `True`, a scalar oneOf was a dead end.
MISREAD: dict[str, Any] = {
    "type": "object",
    "properties": {
        "mixed": {"enum": [1, "two", None, True]},
        "flag": {"enum": [True, False]},
        "fixed": {"const": 3},
        "either": {"oneOf": [{"type": "boolean"}, {"enum": ["x", "y"]}]},
    },
    "required": ["mixed", "flag", "fixed", "either"],
    "additionalProperties": False,
}


def test_schemas_the_enforcer_misread_are_enforced(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=3, n=3,
        response_format={"type": "json_schema", "json_schema": {"name": "misread", "schema": MISREAD}},
    )  # fmt: skip
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), MISREAD)


_DEEP_TEXT = '{"type":"array","items":' * 2000 + "{}" + "}" * 2000


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("response_format", {"type": "json_schema", "json_schema": {"name": "n", "schema": {
            "type": "object", "properties": {"a": {"type": "frob"}}}}}, "frob"),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "n", "schema": {
            "type": "object", "properties": {"t": {"prefixItems": [{"type": "integer"}]}}}}}, "prefixItems"),
        ("guided_regex", "(?=a)a+", "lookarounds"),
        ("guided_json", _DEEP_TEXT, "deeper than"),
    ],
)  # fmt: skip
def test_constraints_that_cannot_be_enforced_are_400s_naming_the_field(
    client: openai.OpenAI, field: str, value: Any, says: str
) -> None:
    """Before: a nested unknown type or a prefixItems ended in broken JSON with a 200, a lookahead
    let any text through, and a schema given as deeply nested text was a 500."""
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, extra_body={field: value}
        )
    body: Any = error.value.body
    assert body["param"] == field and says in body["message"]
