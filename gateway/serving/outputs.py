"""What each choice of a request has produced so far, and the usage totals of a request.

Runs in the gateway process. Owns `Delta`, one worker output as every API surface sees it (the
answer's text, the reasoning split from it, the token count and, on the last one, the choice's
usage), and `ChoiceOutput`, filled by the request owner as its consumer reads each Delta (never
per token in any other place), read by the formatters and the metrics recorder. Pure data; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wire.params import ChatMessage, ChatOptions
from wire.results import FinishReason, TokenLogprob


@dataclass(frozen=True, slots=True)
class ChoiceInput:
    """One job's prompt: exactly one of the three is set (normalized at the API edge)."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    echo: str = ""  # completions with echo: the prompt text, put before the choice's text
    chat: ChatOptions | None = None  # with messages: tools and the template's switches
    prompt_index: int = 0  # which prompt of the request (a list of prompts): n choices share one

    def size_estimate(self, keep: int | None = None) -> int:
        """Prompt tokens, roughly, before the worker has tokenized it (admission and routing); at
        most `keep` when the job keeps only the prompt's last tokens (truncate_prompt_tokens)."""
        chars = len(self.prompt or "") + sum(len(m.content) for m in self.messages or [])
        size = chars // 4 + len(self.prompt_token_ids or [])
        return size if keep is None else min(size, keep)


@dataclass(frozen=True, slots=True)
class FinalUsage:
    """A choice's token counts once it finished, over every job it took (a continuation after a
    reasoning budget is a second job), and the last job's engine-side timings (seconds)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0


@dataclass(slots=True)
class Delta:
    """One worker output of one choice, as the API surfaces format it. `text` is the answer only
    (reasoning, when the model's reasoning parser split it off, is in `reasoning`); `usage` comes
    with the `finish_reason`; `stop_sequence` names the stop string the gateway matched. Never
    changed once made; not frozen only because a frozen dataclass's __init__ costs a setattr call
    per field, and one Delta is made for every worker output."""

    text: str = ""
    reasoning: str = ""
    token_count: int = 0
    finish_reason: FinishReason | None = None
    usage: FinalUsage | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    stop_sequence: str | None = None


@dataclass
class ChoiceOutput:
    index: int
    prompt_index: int = 0  # choices with the same prompt_index answer the same prompt
    prompt_tokens: int = 0
    text_parts: list[str] = field(default_factory=list)
    text_length: int = 0  # kept as we go: text offsets per chunk must not re-join the whole text
    reasoning_parts: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_sequence: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # when asked for: one per prompt token

    def add(self, delta: Delta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.text:
            self.text_parts.append(delta.text)
            self.text_length += len(delta.text)
        if delta.reasoning:
            self.reasoning_parts.append(delta.reasoning)
        self.completion_tokens += delta.token_count
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_sequence = delta.stop_sequence
            if delta.usage is not None:
                self.prompt_tokens = delta.usage.prompt_tokens
                self.completion_tokens = delta.usage.completion_tokens
                self.cached_tokens = delta.usage.cached_tokens
                self.reasoning_tokens = delta.usage.reasoning_tokens

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)


@dataclass(frozen=True, slots=True)
class UsageTotals:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def usage_totals(choices: list[ChoiceOutput]) -> UsageTotals:
    """OpenAI counts each prompt once, however many choices (n) answer it; prompts add up."""
    prompt_tokens: dict[int, int] = {}
    cached_tokens: dict[int, int] = {}
    for choice in choices:
        # max: a choice whose job was not accepted yet (or never) has no count of its own.
        prompt = choice.prompt_index
        prompt_tokens[prompt] = max(prompt_tokens.get(prompt, 0), choice.prompt_tokens)
        cached_tokens[prompt] = max(cached_tokens.get(prompt, 0), choice.cached_tokens)
    return UsageTotals(
        prompt_tokens=sum(prompt_tokens.values()),
        completion_tokens=sum(c.completion_tokens for c in choices),
        cached_tokens=sum(cached_tokens.values()),
        reasoning_tokens=sum(c.reasoning_tokens for c in choices),
    )
