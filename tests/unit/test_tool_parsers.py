"""Tool-call parsers (one per registry `tool_call_parser`) and the streaming of their calls."""

from __future__ import annotations

import json

import pytest

from gateway.errors import InvalidRequest
from gateway.tools.parsers import PARSERS, ParsedCall
from gateway.tools.plan import plan_tools
from gateway.tools.stream import ToolCallStream

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}]  # fmt: skip
F = ParsedCall("f", '{"a": 1}')
G = ParsedCall("g", "{}")


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        ("hermes", 'Sure.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
                   '<tool_call>{"name": "g", "arguments": {}}</tool_call>', "Sure.", [F, G]),
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}', None, [F]),  # cut before the end tag
        ("hermes", "no call here", "no call here", []),
        ("hermes", "x <tool_call>{not json</tool_call>", "x <tool_call>{not json</tool_call>", []),
        ("qwen", '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', None, [F]),
        ("qwen", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
         None, [F]),
        ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; '
                        '{"name": "g", "parameters": {}}', None, [F, G]),
        ("llama3_json", ' {"name": "f", "parameters": {"a": 1}}', None, [F]),
        ("llama3_json", 'I think {"name": "f"}', 'I think {"name": "f"}', []),
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
         None, [F, G]),
        ("mistral", ' [{"name": "f", "arguments": {"a": 1}}]', None, [F]),  # [TOOL_CALLS] skipped as special
        ("mistral", 'ok[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}', "ok", [F, G]),
    ],
)  # fmt: skip
def test_parsers(parser: str, text: str, content: str | None, calls: list[ParsedCall]) -> None:
    parsed = PARSERS[parser].parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        (c.name, json.loads(c.arguments)) for c in calls
    ]


def test_mistral_ids_are_nine_alphanumerics() -> None:
    call_id = PARSERS["mistral"].new_call_id()
    assert len(call_id) == 9 and call_id.isalnum()


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_stream_holds_markers_and_sends_whole_calls(parser: str) -> None:
    texts = {
        "hermes": ["Hi ", "there <tool", '_call>{"name": "f", ', '"arguments": {"a": 1}}</tool_call>'],
        "llama3_json": [" ", '{"name": "f", ', '"parameters": {"a": 1}}'],
        "mistral": ["[TOOL", '_CALLS][{"name": "f", ', '"arguments": {"a": 1}}]'],
    }[parser]
    stream = ToolCallStream(plan_tools(TOOLS, "auto", None, "m", parser))
    deltas = [d for piece in texts for d in stream.feed(piece)]
    tail, called = stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    assert content == ("Hi there " if parser == "hermes" else "")
    assert called and [d["tool_calls"][0]["function"] for d in tail] == [
        {"name": "f", "arguments": '{"a": 1}'}
    ]
    assert tail[0]["tool_calls"][0]["id"]


def test_stream_without_calls_sends_all_text() -> None:
    stream = ToolCallStream(plan_tools(TOOLS, "auto", None, "m", "hermes"))
    sent = [d for piece in ["a <tool", "s are fun <"] for d in stream.feed(piece)]
    tail, called = stream.finish()
    assert not called and "".join(d["content"] for d in sent + tail) == "a <tools are fun <"


def test_plans() -> None:
    required = json.loads(plan_tools(TOOLS, "required", False, "m", None).constraint_schema() or "")
    assert required["minItems"] == 1 and required["maxItems"] == 1
    assert [i["properties"]["name"]["enum"] for i in required["items"]["anyOf"]] == [["f"], ["g"]]
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "g"}}, None, "m", None)
    assert named.mode == "named" and named.constraint_schema() == '{"type":"object"}'
    assert plan_tools(TOOLS, "none", None, "m", "hermes").tools == []
    with pytest.raises(InvalidRequest, match="tool_call_parser"):
        plan_tools(TOOLS, "auto", None, "m", None)
    with pytest.raises(InvalidRequest, match="needs tools"):
        plan_tools(None, "required", None, "m", "hermes")


def test_a_json_constraint_under_auto_is_refused_unless_json_may_hold_calls() -> None:
    """response_format (or guided_json, ...) with tools under tool_choice auto: a hermes or qwen call
    needs its tags, which JSON output never writes, so tools would be dropped without a word."""
    for parser in ("hermes", "qwen"):
        with pytest.raises(InvalidRequest, match=f"guided_json cannot be combined.*{parser}") as info:
            plan_tools(TOOLS, "auto", None, "m", parser).check_output_constraint(True, "guided_json")
        assert info.value.param == "guided_json"
    for parser in ("llama3_json", "mistral"):  # a call may be the JSON itself: {...} or [{...}]
        plan_tools(TOOLS, "auto", None, "m", parser).check_output_constraint(True, "response_format")
    plan_tools(TOOLS, "auto", None, "m", "hermes").check_output_constraint(False, "regex")  # may write tags
    for choice in ("none", "required", {"type": "function", "function": {"name": "f"}}):
        plan_tools(TOOLS, choice, None, "m", "hermes").check_output_constraint(True, "response_format")
