"""Parameters that would change the output and that nothing here honours are refused by name; null
is the default where OpenAI marks a field nullable; free-form JSON is checked at the edge.

Runs in the pytest process, on the request schema alone (the HTTP layer renders the same error as a
400 in OpenAI's shape).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.errors import InvalidRequest
from gateway.http.schemas import ChatCompletionRequest, CompletionRequest
from wire.codec import MAX_PLAIN_DEPTH

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("reasoning_effort", "low"),
        ("verbosity", "high"),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("prediction", {"type": "content", "content": "x"}),
        ("web_search_options", {}),
        ("modalities", ["text", "audio"]),
    ],
)
def test_an_output_changing_parameter_nothing_honours_is_a_400_naming_it(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as refused:
        ChatCompletionRequest.model_validate({**BASE, field: value})
    assert refused.value.param == field and refused.value.status == 400


def test_text_modalities_and_unknown_vendor_fields_pass() -> None:
    request = ChatCompletionRequest.model_validate({**BASE, "modalities": ["text"], "x_vendor_flag": 1})
    assert request.model == "m"


# vLLM's extensions that nothing here honours, each with a value that would change the output.
VLLM_REFUSED = [
    ("use_beam_search", True),
    ("length_penalty", 0.8),
    ("skip_special_tokens", False),
    ("spaces_between_special_tokens", False),
    ("logits_processors", ["module.Processor"]),
    ("guided_decoding_backend", "xgrammar"),
    ("guided_whitespace_pattern", r"[\n ]*"),
    ("structural_tag", "{}"),
    ("return_tokens_as_token_ids", True),
    ("return_token_ids", True),
    ("repetition_detection", {"max_pattern_size": 4}),
    ("vllm_xargs", {"k": 1}),
    ("priority", 5),
]

# The values of those that change nothing (beside null).
HARMLESS = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "logits_processors": [],
    "guided_decoding_backend": "auto",
    "return_tokens_as_token_ids": False,
    "return_token_ids": False,
    "vllm_xargs": {},
    "priority": 0,
}


@pytest.mark.parametrize("request_class", [ChatCompletionRequest, CompletionRequest])
@pytest.mark.parametrize(("field", "value"), VLLM_REFUSED)
def test_a_vllm_extension_nothing_honours_is_a_400_unless_it_changes_nothing(
    request_class: type[ChatCompletionRequest | CompletionRequest], field: str, value: Any
) -> None:
    base = BASE if request_class is ChatCompletionRequest else TEXT
    with pytest.raises(InvalidRequest) as refused:
        request_class.model_validate({**base, field: value})
    assert refused.value.param == field
    request_class.model_validate({**base, field: None})
    if field in HARMLESS:
        request_class.model_validate({**base, field: HARMLESS[field]})


def test_add_special_tokens_is_refused_where_it_differs_from_what_each_surface_does() -> None:
    # A chat prompt's special tokens come from the template; a text prompt gets the tokenizer's.
    ChatCompletionRequest.model_validate({**BASE, "add_special_tokens": False})
    CompletionRequest.model_validate({**TEXT, "add_special_tokens": True})
    for request_class, base, value in ((ChatCompletionRequest, BASE, True), (CompletionRequest, TEXT, False)):
        with pytest.raises(InvalidRequest) as refused:
            request_class.model_validate({**base, "add_special_tokens": value})
        assert refused.value.param == "add_special_tokens"
    for field, value in (("documents", [{"title": "t", "text": "x"}]), ("include_reasoning", False)):
        with pytest.raises(InvalidRequest) as chat_only:
            ChatCompletionRequest.model_validate({**BASE, field: value})
        assert chat_only.value.param == field
    with pytest.raises(InvalidRequest):
        CompletionRequest.model_validate({**TEXT, "prompt_embeds": "AAAA"})


def test_null_is_the_default_where_openai_marks_a_field_nullable() -> None:
    fields = ("n", "stream", "logprobs", "ignore_eos", "min_tokens", "add_generation_prompt",
              "continue_final_message", "echo", "include_stop_str_in_output")  # fmt: skip
    chat = ChatCompletionRequest.model_validate({**BASE, **dict.fromkeys(fields)})
    assert (chat.n, chat.stream, chat.logprobs, chat.echo) == (1, False, False, False)
    assert chat.add_generation_prompt is True and chat.min_tokens == 0
    text = CompletionRequest.model_validate({**TEXT, **dict.fromkeys(("n", "stream", "echo", "ignore_eos"))})
    assert (text.n, text.stream, text.echo, text.ignore_eos) == (1, False, False, False)
    with pytest.raises(ValidationError):  # a value still has to be valid
        ChatCompletionRequest.model_validate({**BASE, "n": 0})
    # The OpenAPI description says so, so that generated clients and the fuzzer may send null.
    n = ChatCompletionRequest.model_json_schema()["properties"]["n"]
    assert (
        n["anyOf"] == [{"type": "integer", "minimum": 1, "maximum": 8}, {"type": "null"}]
        and n["default"] == 1
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": {"type": "function", "function": "f"}}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": [1]}}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": 1}}}, "tool_choice"),
        ({"function_call": {"name": ["f"]}}, "function_call"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"x": math.nan}}}]},
         "tools.0.function.parameters"),
        ({"chat_template_kwargs": {"x": math.inf}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ],
)  # fmt: skip
def test_malformed_tool_choice_and_free_form_json_are_refused_by_the_schema(
    body: dict[str, Any], param: str
) -> None:
    with pytest.raises(ValidationError) as refused:
        ChatCompletionRequest.model_validate({**BASE, **body})
    assert ".".join(str(p) for p in refused.value.errors()[0]["loc"]) == param


def test_free_form_json_nests_as_deep_as_the_wire_allows() -> None:
    def nested(depth: int) -> dict[str, Any]:
        value: dict[str, Any] = {}
        for _ in range(depth):
            value = {"x": value}
        return value

    tool = {"type": "function", "function": {"name": "f", "parameters": nested(MAX_PLAIN_DEPTH)}}
    ChatCompletionRequest.model_validate({**BASE, "tools": [tool]})
    tool["function"]["parameters"] = nested(MAX_PLAIN_DEPTH + 1)  # type: ignore[index]
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**BASE, "tools": [tool]})
