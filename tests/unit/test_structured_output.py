"""Structured output on the transformers engine: JSON mode and JSON schemas by constrained decoding.

Runs in the pytest process, on CPU, against the random-weight demo model. That model knows nothing
about JSON, which makes it a hard test of the enforcer: every bit of structure in the output comes
from the mask, none from the model. It also never decides to close a free-form string, so schemas
here bound every string (maxLength, enum) and array (maxItems), and max_tokens leaves room for the
whitespace runs the enforcer allows between tokens (up to 12 at a time).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from model_worker.engines.base import RequestRejected
from model_worker.engines.registry import create_engine
from model_worker.engines.structured_output import JsonConstraint, build_parser
from model_worker.engines.transformers.engine import TransformersEngine
from wire.params import SamplingParams
from wire.results import JobOutput

PROMPT = "Describe the weather as JSON:"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer"},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "color", "count", "ok", "tags"],
    "additionalProperties": False,
}
# Greedy, and sampled with a few seeds: sampling reaches corners of the schema greedy never does.
DECODING = [(0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)]


@pytest.fixture(scope="module")
def engine(demo_model_dir: Path) -> Iterator[TransformersEngine]:
    engine: TransformersEngine = create_engine("transformers", str(demo_model_dir), 2048, {"threads": 2})
    engine.load(lambda detail, progress: None)
    yield engine
    engine.close()


def _run(engine: TransformersEngine, jobs: dict[str, SamplingParams]) -> dict[str, list[JobOutput]]:
    prompt_ids = engine.encode(PROMPT, True)
    for rid, params in jobs.items():
        engine.submit(rid, prompt_ids, params)
    outputs: dict[str, list[JobOutput]] = {rid: [] for rid in jobs}
    while engine.has_work():
        for output in engine.step():
            outputs[output.rid].append(output)
    return outputs


def _text(outputs: list[JobOutput]) -> str:
    return "".join(o.text for o in outputs)


def test_json_schema_output_validates(engine: TransformersEngine) -> None:
    jobs = {
        f"schema-{i}": SamplingParams(max_tokens=1024, temperature=t, seed=s, json_schema=json.dumps(SCHEMA))
        for i, (t, s) in enumerate(DECODING)
    }
    for rid, outputs in _run(engine, jobs).items():
        text = _text(outputs)
        assert outputs[-1].finish_reason == "stop", (rid, text)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_output_parses(engine: TransformersEngine) -> None:
    # JSON mode bounds nothing, and this model would write one endless string: a bias towards `"`
    # and `}` lets it close strings and the object. Which characters are legal is still the
    # enforcer's call alone (a bias cannot lift a masked token).
    quote, close = engine.encode('"', False)[-1], engine.encode("}", False)[-1]
    jobs = {
        f"object-{i}": SamplingParams(
            max_tokens=512, temperature=t, seed=s, json_object=True, logit_bias={quote: 20.0, close: 8.0}
        )
        for i, (t, s) in enumerate(DECODING)
    }
    for rid, outputs in _run(engine, jobs).items():
        text = _text(outputs)
        assert outputs[-1].finish_reason == "stop", (rid, text)
        assert isinstance(json.loads(text), dict)


def test_finished_json_stops_even_with_ignore_eos(engine: TransformersEngine) -> None:
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"]}
    params = SamplingParams(max_tokens=512, temperature=0.0, ignore_eos=True, json_schema=json.dumps(schema))
    outputs = _run(engine, {"ignore-eos": params})["ignore-eos"]
    assert outputs[-1].finish_reason == "stop"
    assert json.loads(_text(outputs))["color"] in ("red", "blue")
    assert outputs[-1].usage is not None and outputs[-1].usage.completion_tokens < 512


def test_cut_short_json_ends_with_length(engine: TransformersEngine) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0, json_schema=json.dumps(SCHEMA))
    assert _run(engine, {"short": params})["short"][-1].finish_reason == "length"


@pytest.mark.parametrize(
    "schema",
    [
        "{not json",
        "[1, 2]",
        json.dumps({"type": "frobnicate"}),
        json.dumps({"type": "object", "properties": 5}),
    ],
)
def test_schema_that_cannot_be_enforced_is_rejected(engine: TransformersEngine, schema: str) -> None:
    with pytest.raises(RequestRejected) as rejected:
        engine.submit("bad", engine.encode(PROMPT, True), SamplingParams(json_schema=schema))
    assert rejected.value.code == "invalid_response_format"
    assert rejected.value.param == "response_format"
    assert not engine.has_work()


def test_tokens_that_break_json_are_never_allowed(engine: TransformersEngine) -> None:
    """Inside a string: no raw tab or control character, no piece of a UTF-8 sequence, no empty token."""
    constraint = JsonConstraint(
        engine._json_tokenizer_data(), build_parser(SamplingParams(json_object=True)), "t"
    )
    prefix = engine.encode('{"key": "', False)
    for i in range(len(prefix)):
        assert prefix[i] in constraint.allowed(prefix[:i])
    for token in constraint.allowed(prefix):
        if token in engine._end_ids:
            continue
        text = engine.decode([token])
        assert text and "\ufffd" not in text and all(c >= " " for c in text), repr(text)
    # One state per prefix would grow quadratically with the output; only the newest is kept.
    assert len(constraint.enforcer.prefix_states) <= 2


def _allowed_after(schema: dict[str, Any], text: str) -> str:
    parser = build_parser(SamplingParams(json_schema=json.dumps(schema)))
    for character in text:
        parser = parser.add_character(character)
    return str(parser.get_allowed_characters())


def test_no_trailing_comma_before_closing_brace() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    assert "}" in _allowed_after(schema, "{")  # `{}` is fine
    assert "}" not in _allowed_after(schema, '{"a": 1,')
    assert "}" not in _allowed_after({"type": "object"}, '{"a": 1, ')  # JSON mode too


def test_leading_whitespace_in_a_string_counts_towards_max_length() -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}}
    assert _allowed_after(schema, '{"s": "  a') == '"'


def test_integers_take_no_fraction_or_exponent() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"}}}
    assert not set(".eE") & set(_allowed_after(schema, '{"n": 12'))
    assert not set(".eE") & set(_allowed_after(schema, '{"n": -0'))
    assert set(".e") <= set(_allowed_after(schema, '{"x": 12'))
