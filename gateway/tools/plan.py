"""What a chat request asks of tools, and how its output becomes OpenAI tool calls.

Runs in the gateway process. Owns `ToolPlan`, built at the API edge from `tools`, `tool_choice`
(and the legacy `functions` / `function_call`), as vLLM and TabbyAPI read them:

| tool_choice            | tools in the prompt | output                                                   |
|------------------------|---------------------|----------------------------------------------------------|
| none (or no tools)     | no                  | text                                                     |
| auto (default)         | yes                 | read by the model's `tool_call_parser` (400 without one) |
| required               | yes                 | constrained to a JSON array of {name, parameters}        |
| {"function": {"name"}} | yes                 | constrained to that tool's parameters schema             |

The constraint is a JSON schema handed to the worker's constrained decoding, so even a model that
has never seen tools produces a valid call. `read` turns the final text into content and calls;
`read_cut` does it for a required or named call that max_tokens ended early (the calls, with the
arguments generated so far).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.errors import InvalidRequest
from gateway.tools.cut_calls import cut_required_calls
from gateway.tools.parsers import ParsedCall, ParsedOutput, ToolParser, parser_named
from wire.params import ToolSpec

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    mode: Mode
    tools: list[ToolSpec] = field(default_factory=list)  # rendered into the prompt
    named: str | None = None
    parallel: bool = True
    parser: ToolParser | None = None

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def constraint_schema(self) -> str | None:
        """JSON schema text the output must match, for required and named; None otherwise."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t.name == self.named)
            return json.dumps(tool.parameters or {"type": "object"}, separators=(",", ":"))
        if self.mode == "required":
            items = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [t.name]},
                        "parameters": t.parameters or {"type": "object"},
                    },
                    "required": ["name", "parameters"],
                }
                for t in self.tools
            ]
            schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                      "items": items[0] if len(items) == 1 else {"anyOf": items}}  # fmt: skip
            if not self.parallel:
                schema["maxItems"] = 1
            return json.dumps(schema, separators=(",", ":"))
        return None

    def check_output_constraint(
        self, json_constraint: bool, field: str, other_choices: str = "none, required or a named function"
    ) -> None:
        """Under tool_choice auto a JSON constraint (response_format, guided_json, ...) holds the
        whole output to one JSON value; unless the parser reads calls from bare JSON, the model could
        then never call a tool. InvalidRequest naming `field` then, rather than tools quietly
        dropped. A regex may write the parser's tags, so it stays the client's to shape. `other_choices`
        names the tool_choice values that may go with it, in the client's API."""
        if self.mode != "auto" or not json_constraint or self.parser is None or self.parser.reads_bare_json:
            return
        raise InvalidRequest(
            f"{field} cannot be combined with tools under tool_choice auto: its JSON output could never "
            f"hold a {self.parser.name} tool call; use tool_choice {other_choices}, or leave {field} out",
            param=field,
        )

    def read(self, text: str) -> ParsedOutput:
        """The final output as content and tool calls (none when it does not hold valid calls)."""
        if self.mode == "named":
            try:
                json.loads(text)
            except ValueError:
                return ParsedOutput(text, [])
            assert self.named is not None
            return ParsedOutput(None, [ParsedCall(self.named, text)])
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return ParsedOutput(text, [])
            if not isinstance(items, list) or not all(isinstance(i, dict) and "name" in i for i in items):
                return ParsedOutput(text, [])
            calls = [ParsedCall(str(i["name"]), json.dumps(i.get("parameters", {}), ensure_ascii=False))
                     for i in items]  # fmt: skip
            return ParsedOutput(None, calls)
        if self.mode == "auto" and self.parser is not None:
            parsed = self.parser.parse(text)
            if not self.parallel and len(parsed.calls) > 1:
                return ParsedOutput(parsed.content, parsed.calls[:1])
            return parsed
        return ParsedOutput(text, [])

    def read_cut(self, text: str) -> ParsedOutput:
        """The output of a required or named call that max_tokens cut short: the calls with the
        arguments generated so far (OpenAI answers a cut call so, with finish_reason length)."""
        if self.mode == "named":
            assert self.named is not None
            return ParsedOutput(None, [ParsedCall(self.named, text)])
        if self.mode == "required":
            # Cut before any call has a name: no call, and never the constrained JSON as content.
            return ParsedOutput(None, cut_required_calls(text, [t.name for t in self.tools]))
        return self.read(text)

    def read_final(self, text: str, cut: bool) -> ParsedOutput:
        """`read`, or `read_cut` when max_tokens ended a required or named call."""
        return self.read_cut(text) if cut and self.constrained else self.read(text)

    def call_id(self) -> str:
        return self.parser.new_call_id() if self.parser is not None else "call_" + secrets.token_hex(12)


def tool_specs(tools: list[dict[str, Any]]) -> list[ToolSpec]:
    specs = []
    for index, tool in enumerate(tools):
        function = tool["function"]
        kind = (function.get("parameters") or {}).get("type", "object")
        if kind != "object":
            # As OpenAI: arguments are a JSON object, so a schema of any other type can never match.
            raise InvalidRequest(
                f"tool '{function['name']}': parameters must be a JSON schema of type object, not {kind!r}",
                param=f"tools.{index}.function.parameters",
            )
        specs.append(
            ToolSpec(function["name"], function.get("description"), function.get("parameters") or {})
        )
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise InvalidRequest("tool names must be unique", param="tools")
    return specs


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel: bool | None,
    model_name: str,
    parser_name: str | None,
) -> ToolPlan:
    """The plan for one request; InvalidRequest (naming the field) for what cannot be honoured."""
    specs = tool_specs(tools or [])
    choice = tool_choice if tool_choice is not None else ("auto" if specs else "none")
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type", "function") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise InvalidRequest("tool_choice must name a function: {type: function, function: {name}}",
                                 param="tool_choice")  # fmt: skip
        if name not in {s.name for s in specs}:
            raise InvalidRequest(
                f"tool_choice names function '{name}', which is not in tools", param="tool_choice"
            )
        return ToolPlan("named", specs, name, bool(parallel if parallel is not None else True))
    if choice not in ("none", "auto", "required"):
        raise InvalidRequest(
            "tool_choice must be none, auto, required or a named function", param="tool_choice"
        )
    if choice == "none" or not specs:
        if choice in ("auto", "required") and not specs:
            raise InvalidRequest(f"tool_choice '{choice}' needs tools", param="tool_choice")
        return ToolPlan("none")
    if choice == "auto" and parser_name is None:
        raise InvalidRequest(
            f"model '{model_name}' has no tool_call_parser in the registry, so its tool calls cannot be "
            "read (tool_choice auto); use tool_choice required or a named function",
            param="tool_choice",
        )
    parser = parser_named(parser_name) if parser_name is not None else None
    mode: Mode = "required" if choice == "required" else "auto"
    return ToolPlan(mode, specs, None, parallel if parallel is not None else True, parser)
