"""The Responses request's edge rules, in process: text.format becomes the chat's response_format
only when well formed, values are never coerced across JSON types, null is a nullable flag's
default, and errors that name the chat request's fields are renamed to this API's."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gateway.errors import InvalidRequest
from gateway.http.responses_schema import ResponsesRequest, in_responses_terms


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "x", **fields})


@pytest.mark.parametrize(
    ("text", "response_format"),
    [
        (None, None),
        ({"format": None}, None),
        ({"format": {"type": "text"}}, None),
        ({"format": {"type": "json_object"}}, {"type": "json_object"}),
        ({"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}},
         {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}}),
    ],
)  # fmt: skip
def test_a_well_formed_format_becomes_the_chat_response_format(
    text: dict[str, Any] | None, response_format: dict[str, Any] | None
) -> None:
    data = request(text=text)
    data.refuse_what_is_not_honoured()
    assert data.response_format() == response_format


@pytest.mark.parametrize(
    ("text", "param"),
    [
        ({"format": "json_object"}, "text.format"),
        ({"format": ["json_object"]}, "text.format"),
        ({"format": {"type": None}}, "text.format.type"),
        ({"foo": 1, "format": {"type": "text"}}, "text.foo"),
        ({"format": {"type": "text", "name": "x"}}, "text.format.name"),
        ({"format": {"type": "json_schema", "name": "x"}}, "text.format.schema"),
        ({"format": {"type": "json_schema", "name": "a b", "schema": {}}}, "text.format.name"),
        ({"format": {"type": "json_schema", "name": "x", "schema": {}, "description": 1}},
         "text.format.description"),
        ({"verbosity": "low"}, "text.verbosity"),
    ],
)  # fmt: skip
def test_a_malformed_text_names_its_key(text: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        request(text=text).refuse_what_is_not_honoured()
    assert refused.value.param == param


def test_scalars_are_strict_but_whole_numbers_fit_floats_and_null_stream_is_false() -> None:
    for field, value in [("store", "yes"), ("max_output_tokens", True), ("temperature", True),
                         ("stream", 0), ("max_tool_calls", 1.0)]:  # fmt: skip
        with pytest.raises(ValidationError) as refused:
            request(**{field: value})
        assert refused.value.errors()[0]["loc"][0] == field
    data = request(temperature=1, top_p=1, stream=None, store=None)
    assert (data.temperature, data.top_p, data.stream, data.store) == (1.0, 1.0, False, None)


def test_chat_field_names_in_errors_become_this_apis() -> None:
    worker = InvalidRequest("too long", param="messages", code="context_length_exceeded")
    renamed = in_responses_terms(worker)
    assert renamed.body()["error"] == {"message": "too long", "type": "invalid_request_error",
                                       "param": "input", "code": "context_length_exceeded"}  # fmt: skip
    assert worker.param == "messages"  # the original is left as it was
    assert in_responses_terms(InvalidRequest("x", param="max_tokens")).param == "max_output_tokens"
    mine = InvalidRequest("x", param="input[0].role")
    assert in_responses_terms(mine) is mine
