"""OpenAI response bodies and SSE chunks, for chat and legacy completions.

Runs in the gateway process. Owns the exact JSON shapes OpenAI clients parse: chunk objects,
final responses, usage and logprobs in both the chat and the completions flavour. Pure functions
of the choices' outputs (gateway.serving) and the typed JobOutputs the workers sent; no I/O.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from gateway.serving.outputs import ChoiceOutput, usage_totals
from wire.results import JobOutput, TokenLogprob

if TYPE_CHECKING:
    from gateway.serving.request_owner import Choice

SSE_DONE = b"data: [DONE]\n\n"
SSE_KEEPALIVE = b": keepalive\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def sse_error(body: dict[str, Any]) -> bytes:
    return b"event: error\n" + sse(body)


def usage_body(choices: list[ChoiceOutput]) -> dict[str, Any]:
    totals = usage_totals(choices)
    return {
        "prompt_tokens": totals.prompt_tokens,
        "completion_tokens": totals.completion_tokens,
        "total_tokens": totals.total_tokens,
        "prompt_tokens_details": {"cached_tokens": totals.cached_tokens},
    }


# ---- logprobs -------------------------------------------------------------------------------


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    def token(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**token(e.token, e.logprob), "top_logprobs": [token(t.token, t.logprob) for t in e.top]}
            for e in entries
        ]
    }


def completion_logprobs(entries: list[TokenLogprob], start_offset: int) -> dict[str, Any]:
    offsets, position = [], start_offset
    for entry in entries:
        offsets.append(position)
        position += len(entry.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


# ---- envelopes ------------------------------------------------------------------------------


class ResponseFormatter:
    """Builds chunks and final bodies for one request; `chat` picks the flavour."""

    def __init__(self, request_id: str, model: str, chat: bool) -> None:
        self.id = request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._echoed: set[int] = set()  # choices whose echo went out with their first chunk

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
            choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}  # fmt: skip
            body = self._envelope([choice], chunk=True)
            if with_usage:
                body["usage"] = None
            out.append(sse(body))
        return out

    def delta_chunk(self, choice: Choice, output: JobOutput, with_usage: bool) -> bytes:
        """The SSE chunk for one output of one choice; empty when there is nothing to send."""
        echo = ""
        if choice.input.echo and choice.index not in self._echoed:
            self._echoed.add(choice.index)
            echo = choice.input.echo
        if not (output.text or output.finish_reason or output.logprobs or echo):
            return b""
        state = choice.output
        logprobs = None
        if output.logprobs:
            if self.chat:
                logprobs = chat_logprobs(output.logprobs)
            else:
                start = len(choice.input.echo) + state.text_length - len(output.text)
                logprobs = completion_logprobs(output.logprobs, start)
        if self.chat:
            delta = {"content": output.text} if output.text else {}
            body: dict[str, Any] = {"index": choice.index, "delta": delta}
        else:
            body = {"index": choice.index, "text": echo + output.text}
        body["logprobs"] = logprobs
        body["finish_reason"] = output.finish_reason.value if output.finish_reason else None
        envelope = self._envelope([body], chunk=True)
        if with_usage:
            envelope["usage"] = None
        return sse(envelope)

    def usage_chunk(self, outputs: list[ChoiceOutput]) -> bytes:
        body = self._envelope([], chunk=True)
        body["usage"] = usage_body(outputs)
        return sse(body)

    def final_body(self, choices: list[Choice]) -> dict[str, Any]:
        bodies = []
        for choice in choices:
            state = choice.output
            if self.chat:
                body: dict[str, Any] = {
                    "index": choice.index,
                    "message": {"role": "assistant", "content": state.text},
                    "logprobs": chat_logprobs(state.logprobs) if state.logprobs else None,
                }
            else:
                echo = choice.input.echo
                logprobs = completion_logprobs(state.logprobs, len(echo)) if state.logprobs else None
                body = {"index": choice.index, "text": echo + state.text, "logprobs": logprobs}
            body["finish_reason"] = state.finish_reason.value if state.finish_reason else None
            bodies.append(body)
        envelope = self._envelope(bodies, chunk=False)
        envelope["usage"] = usage_body([c.output for c in choices])
        return envelope
