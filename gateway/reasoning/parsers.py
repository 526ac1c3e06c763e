"""Splitting a reasoning model's thinking from its answer, as the text streams in.

Runs in the gateway process; pure functions of text, one `ReasoningSplitter` per choice. Owns the
formats a registry entry's `reasoning_parser` names (vLLM's reasoning parsers of the same names):

- deepseek_r1 (DeepSeek R1 and its distills, QwQ): the chat template opens `<think>` in the prompt,
  so the output starts in thinking (a `<think>` the model writes anyway is dropped) until
  `</think>`; with no `</think>` at all, everything is thinking.
- qwen3 (Qwen3, Qwen3-Thinking): the same, except that with the template switch
  `enable_thinking: false` the template closes the (empty) thinking itself, so the whole output is
  the answer.

A tail that may still grow into a tag is held back until it is clear, so a tag is never split
across the two texts. The answer's leading whitespace (the blank line after `</think>`) is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    # What the gateway puts after the thinking so far when a budget ends it (the model's own way
    # of closing its thinking, which its template writes the same way).
    closing: str = "\n</think>\n\n"
    template_switch: str | None = None  # a chat_template_kwargs switch that turns thinking off

    def thinks(self, template_kwargs: dict[str, Any]) -> bool:
        """Whether this request's output starts in thinking."""
        return self.template_switch is None or template_kwargs.get(self.template_switch) is not False


_ALL = (ReasoningParser("deepseek_r1"), ReasoningParser("qwen3", template_switch="enable_thinking"))
PARSERS: dict[str, ReasoningParser] = {parser.name: parser for parser in _ALL}


def parser_named(name: str) -> ReasoningParser:
    return PARSERS[name]


class ReasoningSplitter:
    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.thinking = True  # still in the thinking part
        self._at_start = True  # a <think> the model writes itself may still come
        self._answer_started = False
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(thinking, answer) for newly generated text."""
        if not self.thinking:
            return "", self._answer(text)
        buffer = self._held + text
        self._held = ""
        if self._at_start:
            stripped = buffer.lstrip()
            if stripped.startswith(self.parser.start):
                buffer = stripped[len(self.parser.start) :]
                self._at_start = False
            elif self.parser.start.startswith(stripped):
                self._held = buffer  # may still become <think>
                return "", ""
            else:
                self._at_start = False
        end = buffer.find(self.parser.end)
        if end >= 0:
            self.thinking = False
            return buffer[:end], self._answer(buffer[end + len(self.parser.end) :])
        hold = _partial_suffix(buffer, self.parser.end)
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], ""

    def flush(self) -> tuple[str, str]:
        """What is held back, at the end of the output."""
        held, self._held = self._held, ""
        return (held, "") if self.thinking else ("", self._answer(held))

    def close(self) -> str:
        """The gateway ended the thinking (a budget): what was held is thinking; the answer follows."""
        held, self._held = self._held, ""
        self.thinking = self._at_start = False
        return held

    def _answer(self, text: str) -> str:
        if not self._answer_started:
            text = text.lstrip()
            self._answer_started = bool(text)
        return text


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is the start of `tag` (0 if none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
