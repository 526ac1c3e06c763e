"""Tool calls in a chat stream: content deltas until a call opens, then OpenAI tool_calls deltas.

Runs in the gateway process, one `ToolCallStream` per streamed chat choice whose request has tools.
Owns what has been sent of the choice's text. Content passes through at once, except a tail that
could be the start of a tool-call marker (held until it is clear). Once a marker opens a tool-call
section, the rest is held and parsed when the choice finishes, so a call is sent only whole and
valid: one delta per call with its id, name and arguments. A named function's arguments are
streamed as they come (the output is those arguments, by constraint).
"""

from __future__ import annotations

from typing import Any

from gateway.tools.plan import ToolPlan


class ToolCallStream:
    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of text already sent as content (auto) or arguments (named)
        self.in_calls = plan.mode == "required"
        self.calls_sent = 0

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """Delta objects (the `delta` of chat chunks) for newly generated text."""
        self.text += delta
        if self.plan.mode == "named":
            out = []
            if self.calls_sent == 0:
                self.calls_sent = 1
                out.append(self._call_delta(0, self.plan.named or "", "", with_header=True))
            if delta:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
            self.sent = len(self.text)
            return out
        if self.in_calls:
            return []
        start = self._section_start()
        if start is not None:
            self.in_calls = True
            before = self.text[self.sent : start]
            # Whitespace that only led up to the calls is not content.
            return self._content(before if self.text[:start].strip() else "", start)
        return self._content(
            self.text[self.sent : len(self.text) - self._held()], len(self.text) - self._held()
        )

    def finish(self, cut: bool = False) -> tuple[list[dict[str, Any]], bool]:
        """The deltas still due when the choice ends, and whether it ended in tool calls; `cut`:
        max_tokens ended it (a required call then goes out with the arguments it has so far)."""
        if self.plan.mode == "named":
            if self.calls_sent == 0:  # no text came (cut before the arguments began): the call still
                self.calls_sent = 1
                return [self._call_delta(0, self.plan.named or "", self.text, with_header=True)], True
            return [], True
        parsed = self.plan.read_final(self.text, cut)
        if not parsed.calls:
            rest = self.text[self.sent :] if parsed.content is not None else ""
            return self._content(rest, len(self.text)), False
        deltas = [
            self._call_delta(index, call.name, call.arguments, with_header=True)
            for index, call in enumerate(parsed.calls)
        ]
        return deltas, True

    def _content(self, text: str, upto: int) -> list[dict[str, Any]]:
        self.sent = max(self.sent, upto)
        return [{"content": text}] if text else []

    def _call_delta(self, index: int, name: str, arguments: str, with_header: bool) -> dict[str, Any]:
        call: dict[str, Any] = {"index": index, "function": {"name": name, "arguments": arguments}}
        if with_header:
            call = {"index": index, "id": self.plan.call_id(), "type": "function", **call}
        return {"tool_calls": [call]}

    def _section_start(self) -> int | None:
        parser = self.plan.parser
        if parser is None:
            return None
        found = [i for i in (self.text.find(m) for m in parser.markers) if i >= 0]
        if self.sent == 0 or not self.text[: self.sent].strip():
            stripped = self.text.lstrip()
            if any(stripped.startswith(m) for m in parser.start_markers):
                found.append(len(self.text) - len(stripped))
        return min(found) if found else None

    def _held(self) -> int:
        """Characters at the end that may still grow into a marker: not sent yet."""
        parser = self.plan.parser
        if parser is None:
            return 0
        if not self.text[: self.sent].strip():
            stripped = self.text.lstrip()
            if any(m.startswith(stripped) for m in parser.start_markers):
                return len(self.text) - self.sent  # the output may still open with a call
        longest = 0
        for marker in parser.markers:
            for n in range(min(len(marker) - 1, len(self.text)), longest, -1):
                if self.text.endswith(marker[:n]):
                    longest = n
                    break
        return longest
