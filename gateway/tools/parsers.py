"""Reading tool calls out of a model's text, one parser per output format (vLLM's tool parsers).

Runs in the gateway process; pure functions of text. Owns the formats a registry entry's
`tool_call_parser` names:

- hermes (Hermes 2/3, Qwen 2.5/3, the demo models): `<tool_call>{"name": N, "arguments": {...}}</tool_call>`
- qwen (Qwen 2.5/3, Qwen3-Coder): hermes, or inside the same tags
  `<function=N><parameter=P>value</parameter></function>`
- llama3_json (Llama 3.1-3.3): `{"name": N, "parameters": {...}}`, `;` between calls
- mistral (v3 and v11+ tokenizers): `[TOOL_CALLS][{"name": N, "arguments": {...}}]` or
  `[TOOL_CALLS]N[ARGS]{...}`

Engines decode without special tokens, so a marker that is a special token (`[TOOL_CALLS]`,
`<|python_tag|>`) may be missing from the text: the llama3_json and mistral parsers also read calls
that start the output without it. Text that does not parse is content, as in vLLM: a malformed call
is never half-returned.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as the API carries it


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str | None
    calls: list[ParsedCall]


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _call_from(obj: Any, arguments_key: str = "arguments") -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    return ParsedCall(obj["name"], _arguments(args))


def _json_values(text: str) -> list[Any] | None:
    """Consecutive JSON values separated by whitespace, `;` or `,`; None if anything else is there."""
    decoder, position = json.JSONDecoder(), 0
    values: list[Any] = []
    while True:
        while position < len(text) and text[position] in " \t\r\n;,":
            position += 1
        if position == len(text):
            return values
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            return None
        values.append(value)


def _content(text: str) -> str | None:
    return text if text.strip() else None


class ToolParser:
    """Base: `markers` open a tool-call section anywhere; `start_markers` only at the output's start."""

    name = ""
    markers: tuple[str, ...] = ()
    start_markers: tuple[str, ...] = ()

    def parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError

    @property
    def reads_bare_json(self) -> bool:
        """Whether an output that is one JSON value may hold calls (llama3_json's {...}, mistral's
        [{...}]); hermes and qwen calls need their tags, which JSON output never opens with."""
        return any(marker[0] in "{[" for marker in self.start_markers)

    def new_call_id(self) -> str:
        return "call_" + secrets.token_hex(12)


_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)

    def parse(self, text: str) -> ParsedOutput:
        start = text.find("<tool_call>")
        if start < 0:
            return ParsedOutput(text, [])
        calls = []
        for body in _TOOL_CALL.findall(text[start:]):
            call = self._parse_body(body.strip())
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
        return ParsedOutput(_content(text[:start]), calls)

    def _parse_body(self, body: str) -> ParsedCall | None:
        try:
            return _call_from(json.loads(body))
        except ValueError:
            return None


_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)(?:</parameter>|$)", re.DOTALL)


class QwenParser(HermesParser):
    """Hermes JSON bodies (Qwen 2.5/3), or Qwen3-Coder's XML functions inside the same tags."""

    name = "qwen"

    def _parse_body(self, body: str) -> ParsedCall | None:
        if body.startswith("{"):
            return super()._parse_body(body)
        match = _FUNCTION.match(body)
        if match is None:
            return None
        parameters: dict[str, Any] = {}
        for key, raw in _PARAMETER.findall(match.group(2)):
            value = raw.strip("\n")
            try:
                parameters[key] = json.loads(value)
            except ValueError:
                parameters[key] = value  # a bare string, as Qwen3-Coder writes them
        return ParsedCall(match.group(1), json.dumps(parameters, ensure_ascii=False))


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start_markers = ("<|python_tag|>", "{")

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return ParsedOutput(text, [])
        values = _json_values(body)
        calls = [_call_from(v, "parameters") for v in values or []]
        if not calls or any(c is None for c in calls):
            return ParsedOutput(text, [])
        return ParsedOutput(None, [c for c in calls if c is not None])


_MISTRAL_V11 = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[ARGS\])?\s*(\{)")
_ALPHANUMERIC = string.ascii_letters + string.digits


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    start_markers = ("[{",)

    def parse(self, text: str) -> ParsedOutput:
        marker = text.find("[TOOL_CALLS]")
        if marker >= 0:
            content, body = _content(text[:marker]), text[marker + len("[TOOL_CALLS]") :]
        elif text.lstrip().startswith("[{"):
            content, body = None, text
        else:
            return ParsedOutput(text, [])
        calls = self._array(body) if body.lstrip().startswith("[") else self._v11(body)
        return ParsedOutput(content, calls) if calls else ParsedOutput(text, [])

    @staticmethod
    def _array(body: str) -> list[ParsedCall]:
        values = _json_values(body)
        if not values or not isinstance(values[0], list):
            return []
        calls = [_call_from(v) for v in values[0]]
        return [] if any(c is None for c in calls) else [c for c in calls if c is not None]

    @staticmethod
    def _v11(body: str) -> list[ParsedCall]:
        """`NAME[ARGS]{...}` repeated, each after its own [TOOL_CALLS] (Mistral tokenizer v11+)."""
        calls, decoder = [], json.JSONDecoder()
        for part in body.split("[TOOL_CALLS]"):
            match = _MISTRAL_V11.match(part)
            if match is None:
                return []
            try:
                args, _ = decoder.raw_decode(part, match.start(2))
            except ValueError:
                return []
            calls.append(ParsedCall(match.group(1), _arguments(args)))
        return calls

    def new_call_id(self) -> str:
        # Mistral's templates accept only 9-character alphanumeric ids in the history.
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


PARSERS: dict[str, ToolParser] = {
    p.name: p for p in (HermesParser(), QwenParser(), Llama3JsonParser(), MistralParser())
}


def parser_named(name: str) -> ToolParser:
    return PARSERS[name]
