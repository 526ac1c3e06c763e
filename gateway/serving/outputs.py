"""What each choice of a request has produced so far, and the usage totals of a request.

Runs in the gateway process. Owns `ChoiceOutput`, filled by the request owner as its consumer reads
each JobOutput (never per token in any other place), and read by the OpenAI formatter and the
metrics recorder. Pure data; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wire.params import ChatMessage, ChatOptions
from wire.results import FinishReason, JobOutput, TokenLogprob


@dataclass(frozen=True, slots=True)
class ChoiceInput:
    """One job's prompt: exactly one of the three is set (normalized at the API edge)."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    echo: str = ""  # completions with echo: the prompt text, put before the choice's text
    chat: ChatOptions | None = None  # with messages: tools and the template's switches
    prompt_index: int = 0  # which prompt of the request (a list of prompts): n choices share one

    def size_estimate(self) -> int:
        """Prompt tokens, roughly, before the worker has tokenized it (admission and routing)."""
        chars = len(self.prompt or "") + sum(len(m.content) for m in self.messages or [])
        return chars // 4 + len(self.prompt_token_ids or [])


@dataclass
class ChoiceOutput:
    index: int
    prompt_index: int = 0  # choices with the same prompt_index answer the same prompt
    prompt_tokens: int = 0
    text_parts: list[str] = field(default_factory=list)
    text_length: int = 0  # kept as we go: text offsets per chunk must not re-join the whole text
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # when asked for: one per prompt token

    def add(self, output: JobOutput) -> None:
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.text_parts.append(output.text)
        self.text_length += len(output.text)
        self.completion_tokens += len(output.token_ids)
        if output.logprobs:
            self.logprobs.extend(output.logprobs)
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason
            if output.usage is not None:
                self.prompt_tokens = output.usage.prompt_tokens
                self.completion_tokens = output.usage.completion_tokens
                self.cached_tokens = output.usage.cached_tokens

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


@dataclass(frozen=True, slots=True)
class UsageTotals:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

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
    )
