"""Tool calls cut short by max_tokens: what a required tool_choice's output holds so far.

Runs in the gateway process; a pure function of text. Under tool_choice `required` the output is
constrained to a compact JSON array of `{"name": ..., "parameters": {...}}`; when max_tokens ends
it early, OpenAI still answers with the calls, each with the arguments generated so far (JSON text
that may stop anywhere). This scanner walks the array as far as it goes and returns, per item,
the tool's name and the raw text of its `parameters` (a name cut short counts when it is the start
of exactly one tool's name; an item cut before its name counts only when there is one tool).
"""

from __future__ import annotations

from gateway.tools.parsers import ParsedCall

_SPACE = " \t\r\n"


def cut_required_calls(text: str, names: list[str]) -> list[ParsedCall]:
    at = _skip(text, 0, _SPACE)
    if at >= len(text) or text[at] != "[":
        return []
    at += 1
    calls: list[ParsedCall] = []
    while True:
        at = _skip(text, at, _SPACE + ",")
        if at >= len(text) or text[at] != "{":
            return calls
        name, arguments, end = _item(text, at + 1)
        tool = _tool_named(name, names)
        if tool is not None:
            calls.append(ParsedCall(tool, arguments))
        if end is None:  # the text ended inside this item
            return calls
        at = end


def _item(text: str, at: int) -> tuple[tuple[str, bool] | None, str, int | None]:
    """((name, complete) or None, the parameters' raw text, where the item ends or None if cut)."""
    name: tuple[str, bool] | None = None
    arguments = ""
    while True:
        at = _skip(text, at, _SPACE + ",")
        if at >= len(text):
            return name, arguments, None
        if text[at] == "}":
            return name, arguments, at + 1
        key_end = _value_end(text, at) if text[at] == '"' else None
        if key_end is None:
            return name, arguments, None
        key = text[at + 1 : key_end - 1]
        at = _skip(text, key_end, _SPACE)
        if at >= len(text) or text[at] != ":":
            return name, arguments, None
        start = _skip(text, at + 1, _SPACE)
        end = _value_end(text, start) if start < len(text) else None
        raw = text[start:end] if end is not None else text[start:]
        if key == "name" and raw.startswith('"'):
            name = (raw[1:-1], True) if end is not None else (raw[1:], False)
        elif key == "parameters":
            arguments = raw
        if end is None:
            return name, arguments, None
        at = end


def _tool_named(name: tuple[str, bool] | None, names: list[str]) -> str | None:
    if name is None:  # cut before its name: only one tool's item can it be
        return names[0] if len(names) == 1 else None
    text, complete = name
    if complete:
        return text if text in names else None
    starting = [n for n in names if n.startswith(text)]
    return starting[0] if len(starting) == 1 else None


def _skip(text: str, at: int, chars: str) -> int:
    while at < len(text) and text[at] in chars:
        at += 1
    return at


def _value_end(text: str, at: int) -> int | None:
    """Where the JSON value starting at `at` ends (the index after it); None if the text ends first."""
    opening = text[at]
    if opening == '"':
        at += 1
        while at < len(text):
            if text[at] == "\\":
                at += 2
                continue
            if text[at] == '"':
                return at + 1
            at += 1
        return None
    if opening in "{[":
        depth, at = 0, at
        while at < len(text):
            char = text[at]
            if char == '"':
                end = _value_end(text, at)
                if end is None:
                    return None
                at = end
                continue
            if char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return at + 1
            at += 1
        return None
    end = at
    while end < len(text) and text[end] not in ",}]" + _SPACE:
        end += 1
    return end if end < len(text) else None  # a number at the very end may still have been growing
