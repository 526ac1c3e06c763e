"""OpenAI response bodies and SSE chunks, for chat and legacy completions.

Runs in the gateway process. Owns the exact JSON shapes OpenAI clients parse: chunk objects,
final responses, usage and logprobs in both the chat and the completions flavour. Pure functions
of the outputs the workers sent; no I/O.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from model_worker.protocol import JobOutput

SSE_DONE = b"data: [DONE]\n\n"
SSE_KEEPALIVE = b": keepalive\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def sse_error(body: dict[str, Any]) -> bytes:
    return b"event: error\n" + sse(body)


@dataclass
class ChoiceState:
    """What one choice has produced so far (only what the response needs)."""

    index: int
    prompt_tokens: int
    text_parts: list[str] = field(default_factory=list)
    text_length: int = 0  # kept as we go: text offsets per chunk must not re-join the whole text
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[Any] = field(default_factory=list)

    def add(self, output: JobOutput) -> None:
        self.text_parts.append(output.text)
        self.text_length += len(output.text)
        self.completion_tokens += len(output.token_ids)
        if output.logprobs:
            self.logprobs.extend(output.logprobs)
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason
            usage = output.usage or {}
            self.prompt_tokens = int(usage.get("prompt_tokens", self.prompt_tokens))
            self.completion_tokens = int(usage.get("completion_tokens", self.completion_tokens))
            self.cached_tokens = int(usage.get("cached_tokens", 0))


def usage_body(choices: list[ChoiceState]) -> dict[str, Any]:
    # n > 1 on one prompt shares the prompt: OpenAI counts it once.
    prompt = max((c.prompt_tokens for c in choices), default=0)
    prompts = {c.prompt_tokens for c in choices}
    prompt_tokens = prompt if len(prompts) == 1 else sum(c.prompt_tokens for c in choices)
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": max((c.cached_tokens for c in choices), default=0)},
    }


# ---- logprobs -------------------------------------------------------------------------------
# Worker entries are [token_text, logprob, [[alt_text, alt_logprob], ...]].


def chat_logprobs(entries: list[Any]) -> dict[str, Any]:
    def token(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**token(text, lp), "top_logprobs": [token(t, alt) for t, alt in alts]}
            for text, lp, alts in entries
        ]
    }


def completion_logprobs(entries: list[Any], start_offset: int) -> dict[str, Any]:
    offsets, position = [], start_offset
    for text, _, _ in entries:
        offsets.append(position)
        position += len(text)
    return {
        "tokens": [e[0] for e in entries],
        "token_logprobs": [e[1] for e in entries],
        "top_logprobs": [{t: alt for t, alt in e[2]} for e in entries],
        "text_offset": offsets,
    }


# ---- envelopes ------------------------------------------------------------------------------


class ResponseFormatter:
    """Builds chunks and final bodies for one request; `chat` picks the flavour."""

    def __init__(self, request_id: str, model: str, chat: bool, echo_prefix: str = "") -> None:
        self.id = request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self.echo_prefix = echo_prefix
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        obj = self.object + (".chunk" if chunk and self.chat else "")
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def first_chunks(self, indices: list[int], with_usage: bool) -> list[bytes]:
        if not self.chat:
            return []
        out = []
        for index in indices:
            choice = {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            body = self._envelope([choice], chunk=True)
            if with_usage:
                body["usage"] = None
            out.append(sse(body))
        return out

    def delta_chunk(self, state: ChoiceState, output: JobOutput, with_usage: bool, echo: str = "") -> bytes:
        logprobs = None
        if output.logprobs:
            logprobs = (
                chat_logprobs(output.logprobs)
                if self.chat
                else completion_logprobs(output.logprobs, state.text_length - len(output.text))
            )
        if self.chat:
            delta = {"content": output.text} if output.text else {}
            choice: dict[str, Any] = {"index": state.index, "delta": delta}
        else:
            choice = {"index": state.index, "text": echo + output.text}
        choice["logprobs"] = logprobs
        choice["finish_reason"] = output.finish_reason
        body = self._envelope([choice], chunk=True)
        if with_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self, choices: list[ChoiceState]) -> bytes:
        body = self._envelope([], chunk=True)
        body["usage"] = usage_body(choices)
        return sse(body)

    def final_body(self, choices: list[ChoiceState], echoes: list[str]) -> dict[str, Any]:
        bodies = []
        for state in choices:
            text = "".join(state.text_parts)
            if self.chat:
                choice: dict[str, Any] = {
                    "index": state.index,
                    "message": {"role": "assistant", "content": text},
                }
                choice["logprobs"] = chat_logprobs(state.logprobs) if state.logprobs else None
            else:
                echo = echoes[state.index] if echoes else ""
                choice = {"index": state.index, "text": echo + text}
                choice["logprobs"] = (
                    completion_logprobs(state.logprobs, len(echo)) if state.logprobs else None
                )
            choice["finish_reason"] = state.finish_reason
            bodies.append(choice)
        body = self._envelope(bodies, chunk=False)
        body["usage"] = usage_body(choices)
        return body
