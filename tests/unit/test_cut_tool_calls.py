"""Tool calls cut by max_tokens: a required call's array read as far as it goes, a named call's
arguments as they are, streamed and not."""

from __future__ import annotations

import json

import pytest

from gateway.errors import InvalidRequest
from gateway.tools.cut_calls import cut_required_calls
from gateway.tools.parsers import ParsedOutput
from gateway.tools.plan import plan_tools
from gateway.tools.stream import ToolCallStream

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
WHOLE = (
    '[{"name":"get_weather","parameters":{"city":"Paris","days":[1,2]}},{"name":"get_time","parameters":{}}]'
)


@pytest.mark.parametrize("cut", range(len(WHOLE) + 1))
def test_every_cut_of_a_required_array_gives_the_calls_so_far(cut: int) -> None:
    calls = cut_required_calls(WHOLE[:cut], ["get_weather", "get_time"])
    whole = json.loads(WHOLE)
    assert len(calls) <= len(whole)
    for call, item in zip(calls, whole, strict=False):
        assert call.name == item["name"]
        # The arguments are the start of the item's parameters, exactly as generated.
        assert json.dumps(item["parameters"], separators=(",", ":")).startswith(call.arguments)
    if cut == len(WHOLE):
        assert [c.arguments for c in calls] == ['{"city":"Paris","days":[1,2]}', "{}"]


def test_a_name_cut_short_counts_only_when_it_starts_one_tool() -> None:
    assert [c.name for c in cut_required_calls('[{"name":"get_w', ["get_weather", "get_time"])] == [
        "get_weather"
    ]
    assert cut_required_calls('[{"name":"get_', ["get_weather", "get_time"]) == []  # two tools start so
    assert cut_required_calls("not json", ["get_weather"]) == []


def test_plans_read_cut_calls_and_the_stream_sends_them_at_the_end() -> None:
    required = plan_tools(TOOLS, "required", None, "m", None)
    text = '[{"name":"get_weather","parameters":{"city":"Pa'
    parsed = required.read_final(text, cut=True)
    assert parsed.content is None and [(c.name, c.arguments) for c in parsed.calls] == [
        ("get_weather", '{"city":"Pa')
    ]
    assert required.read_final(text, cut=False).calls == []  # not cut: an invalid call is content
    stream = ToolCallStream(required)
    assert stream.feed(text) == []
    deltas, called = stream.finish(cut=True)
    assert called and deltas[0]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city":"Pa',
    }
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None, "m", None)
    assert [(c.name, c.arguments) for c in named.read_final('{"utc": tr', cut=True).calls] == [
        ("get_time", '{"utc": tr')
    ]


def test_a_required_call_cut_before_its_name_is_never_content() -> None:
    """With the enforcer writing `name` first, a cut can still end before the name's value: the one
    tool there is is the call; among several no call can be told, and the JSON is not content."""
    one = plan_tools(TOOLS[:1], "required", None, "m", None)
    for text in ('[{"nam', "[{", "["):
        parsed = one.read_final(text, cut=True)
        assert parsed.content is None
    assert [(c.name, c.arguments) for c in one.read_final('[{"nam', cut=True).calls] == [("get_weather", "")]
    two = plan_tools(TOOLS, "required", None, "m", None)
    assert two.read_final('[{"nam', cut=True) == ParsedOutput(None, [])
    stream = ToolCallStream(two)
    assert stream.feed('[{"nam') == []
    assert stream.finish(cut=True) == ([], False)


def test_tool_parameters_must_describe_an_object() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    with pytest.raises(InvalidRequest) as refused:
        plan_tools([TOOLS[0], tool], "required", None, "m", None)
    assert refused.value.param == "tools.1.function.parameters"
