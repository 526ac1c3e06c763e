"""Valid JSON schemas that lm-format-enforcer misreads, enforced as written; the rest refused at once.

Runs in the pytest process; no model. Each schema is compiled as the worker compiles it, then a
valid instance is typed character by character (each must be allowed, and the end reachable) and
an invalid one must be stopped. Before the fix these failed mid-generation (a job that ended
"stop" on text that is not JSON), or let invalid values through (`True` for a boolean enum).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from model_worker.engines.base import RequestRejected
from model_worker.engines.structured_output import compile_parser
from wire.params import SamplingParams


def _types(schema: dict[str, Any], text: str) -> bool:
    """Whether the compiled schema lets `text` be written whole."""
    parser = compile_parser(SamplingParams(json_schema=json.dumps(schema)))
    for character in text:
        if character not in parser.get_allowed_characters():
            return False
        parser = parser.add_character(character)
    return bool(parser.can_end())


def _object(value_schema: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"a": value_schema}, "required": ["a"], **extra}


NEXT = {"anyOf": [{"$ref": "#"}, {"type": "null"}]}
NODE = {"type": "object", "properties": {"v": {"type": "integer"}, "next": NEXT}, "required": ["v", "next"]}
Y_DEFS = {"$defs": {"X": {"properties": {"y": {"type": "integer"}}}}}
A_DEFS = {"$defs": {"A": {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}}}
C_PART = {"properties": {"c": {"type": "integer"}}, "required": ["c"]}
XY = {"x": {"type": "integer"}, "y": {"type": "integer"}}
ENFORCED = [
    # (schema, valid instances, invalid instances)
    (_object({"enum": [1, "two", None, True]}), ['{"a":1}', '{"a":"two"}', '{"a":null}', '{"a":true}'],
     ['{"a":false}', '{"a":"tw"}', '{"a":2}']),
    (_object({"enum": [True, False]}), ['{"a":true}', '{"a":false}'], ['{"a":True}']),
    (_object({"const": 5}), ['{"a":5}'], ['{"a":6}', '{"a":"5"}']),
    (_object({"const": False}), ['{"a":false}'], ['{"a":true}']),
    (NODE, ['{"v":1,"next":{"v":2,"next":null}}'], ['{"v":1,"next":{"v":2}}']),
    (_object({"$ref": "#/$defs/X/properties/y"}, **Y_DEFS), ['{"a":1}'], ['{"a":"s"}']),
    (_object({}), ['{"a":1}', '{"a":[1,{"b":null}]}', '{"a":"s"}'], []),
    (_object(True), ['{"a":false}'], []),
    (_object({"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}), ['{"a":1}', '{"a":"s"}'],
     ['{"a":"sss"}', '{"a":true}']),
    (_object({"type": ["string", "null"], "maxLength": 2}), ['{"a":null}', '{"a":"xy"}'], ['{"a":"xyz"}']),
    (_object({"type": ["object", "null"], "properties": {"b": {"type": "integer"}}, "required": ["b"]}),
     ['{"a":{"b":1}}', '{"a":null}'], ['{"a":{}}']),
    ({"type": "object", "additionalProperties": False}, ["{}"], ['{"x":1}']),
    (_object({"type": "integer"}, required=["a", "z"]), ['{"a":1,"z":[true]}'], ['{"a":1}']),
    (_object({"allOf": [{"$ref": "#/$defs/A"}, C_PART]}, **A_DEFS), ['{"a":{"b":true,"c":1}}'],
     ['{"a":{"b":true}}']),
    # Required keys come in the schema's order, as OpenAI writes them (a cut tool call has its name).
    ({"type": "object", "properties": XY, "required": ["y", "x"]}, ['{"y":1,"x":2}'], ['{"x":2,"y":1}']),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "valid", "invalid"), ENFORCED)
def test_valid_schemas_are_enforced_as_written(
    schema: dict[str, Any], valid: list[str], invalid: list[str]
) -> None:
    for text in valid:
        assert _types(schema, text), text
    for text in invalid:
        assert not _types(schema, text), text


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        (_object({"type": "frob"}), "schema.properties.a.type"),
        (_object({"$ref": "#/$defs/missing"}), "points at nothing"),
        (_object({"$ref": "https://example.com/s.json"}), "only references inside the schema"),
        (_object({"prefixItems": [{"type": "integer"}]}), "prefixItems"),
        (_object({"not": {"type": "null"}}), "schema.properties.a.not"),
        (_object({"enum": [{"x": 1}]}), "objects and arrays"),
        (_object({"enum": ['say "hi"']}), "quotes"),
        (_object({"type": "string", "pattern": "^[a-z]+$", "maxLength": 5}), "pattern and a min/max length"),
        (_object({"allOf": [{"type": "string"}, {"type": "integer"}]}), "disagree on 'type'"),
        (_object(False), "must be a schema object"),
    ],
)
def test_what_cannot_be_enforced_is_refused_before_generation(schema: dict[str, Any], named: str) -> None:
    with pytest.raises(RequestRejected) as refused:
        compile_parser(SamplingParams(json_schema=json.dumps(schema)))
    assert refused.value.code == "invalid_response_format" and refused.value.param == "response_format"
    assert named in refused.value.message
