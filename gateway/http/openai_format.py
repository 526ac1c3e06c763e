"""OpenAI response bodies and SSE chunks, for chat and legacy completions.

Runs in the gateway process. Owns the exact JSON shapes OpenAI clients parse: chunk objects,
final responses, usage and logprobs in both the chat and the completions flavour, tool calls
(read from the text by gateway.tools) and vLLM's prompt logprobs. Pure functions of the choices'
outputs (gateway.serving) and the Deltas made of the workers' outputs; no I/O.

A stream's chunks are byte for byte what `json.dumps(chunk, separators=(",", ":"),
ensure_ascii=False)` writes. Per chunk only the choice (and, with continuous usage, the usage) is
encoded; the envelope around it (id, object, created, model) is encoded once per request. JSON
without floats is written by msgspec, which escapes every string exactly as `json.dumps` does
(tests/unit/test_sse_bytes.py); logprobs, whose floats msgspec writes in another notation
(`1e-05` against `0.00001`), keep the stdlib encoder.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import msgspec

from gateway.errors import APIError
from gateway.http.serving_path import Formatter
from gateway.serving.outputs import ChoiceOutput, Delta, usage_totals
from gateway.tools.plan import ToolPlan
from gateway.tools.stream import ToolCallStream
from wire.results import FinishReason, TokenLogprob, TopLogprob

if TYPE_CHECKING:
    from gateway.serving.choice import Choice
    from gateway.serving.request_owner import RequestOwner

SSE_DONE = b"data: [DONE]\n\n"

# json.dumps(..., separators=(",", ":"), ensure_ascii=False), built once instead of per call.
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
# The same bytes for anything without floats (strings, ints, None, bools, lists, dicts).
_PLAIN_JSON = msgspec.json.Encoder()


def json_bytes(payload: Any) -> bytes:
    return _JSON.encode(payload).encode()


def plain_json_bytes(payload: Any) -> bytes:
    """`json_bytes` of a payload that holds no floats (their notation differs), faster."""
    return _PLAIN_JSON.encode(payload)


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json_bytes(payload) + b"\n\n"


def sse_error(body: dict[str, Any]) -> bytes:
    return b"event: error\n" + sse(body)


def usage_body(choices: list[ChoiceOutput], reasoning: bool = False) -> dict[str, Any]:
    totals = usage_totals(choices)
    body: dict[str, Any] = {
        "prompt_tokens": totals.prompt_tokens,
        "completion_tokens": totals.completion_tokens,
        "total_tokens": totals.total_tokens,
        "prompt_tokens_details": {"cached_tokens": totals.cached_tokens},
    }
    if reasoning:
        body["completion_tokens_details"] = {"reasoning_tokens": totals.reasoning_tokens}
    return body


# ---- logprobs -------------------------------------------------------------------------------


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """`bytes` are the token's own: its text's UTF-8, or, for a token that is part of a character
    (its text U+FFFD), the bytes the worker read from the vocabulary."""

    def token(entry: TokenLogprob | TopLogprob) -> dict[str, Any]:
        raw = entry.raw if entry.raw is not None else entry.token.encode()
        return {"token": entry.token, "logprob": entry.logprob, "bytes": list(raw)}

    return {"content": [{**token(e), "top_logprobs": [token(t) for t in e.top]} for e in entries]}


def completion_logprobs(
    entries: list[TokenLogprob],
    start_offset: int,
    prompt: list[TokenLogprob] | None = None,
    prompt_top: int = 0,
) -> dict[str, Any]:
    """The completions flavour; with echo, the prompt's entries come first (the first one null).
    Every token's `top_logprobs`, the prompt's as the generated ones, holds the token itself first,
    then the top alternatives (logprobs + 1 entries at most, as OpenAI says and vLLM does;
    logprobs 0: the token alone). `prompt_top` is the request's logprobs: the worker may have
    scored more alternatives per prompt token, for a larger `prompt_logprobs`."""
    offsets, position = [], 0
    for entry in prompt or []:
        offsets.append(position)
        position += len(entry.token)
    position = start_offset
    for entry in entries:
        offsets.append(position)
        position += len(entry.token)
    every = [*(prompt or []), *entries]
    return {
        "tokens": [e.token for e in every],
        "token_logprobs": [e.logprob for e in every],
        # vLLM's shape: null where there is no logprob (the prompt's first token).
        "top_logprobs": [
            *(None if e.logprob is None else _with_token(e, e.top[:prompt_top]) for e in prompt or []),
            *(_with_token(e, e.top) for e in entries),
        ],
        "text_offset": offsets,
    }


def _with_token(entry: TokenLogprob, alternatives: list[TopLogprob]) -> dict[str, float | None]:
    top: dict[str, float | None] = {entry.token: entry.logprob}
    top.update((t.token, t.logprob) for t in alternatives if t.token != entry.token)
    return top


def prompt_logprobs_body(entries: list[TokenLogprob]) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: per prompt token, {token id: {logprob, rank, decoded_token}} for the
    token and its top alternatives; null for the first token."""
    body: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry.logprob is None:
            body.append(None)
            continue
        ranked = {str(t.token_id): {"logprob": t.logprob, "rank": rank, "decoded_token": t.token}
                  for rank, t in enumerate(entry.top, start=1)}  # fmt: skip
        ranked.setdefault(
            str(entry.token_id), {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": entry.token}
        )
        body.append(ranked)
    return body


# ---- envelopes ------------------------------------------------------------------------------


class ResponseFormatter(Formatter):
    """Builds chunks and final bodies for one request; `chat` picks the flavour.

    `tools` reads tool calls from chat output; `echo_logprobs` (the request's logprobs, for
    completions with echo and logprobs) puts the prompt's logprobs before the completion's, with as
    many alternatives per token as the generated tokens get; `prompt_logprobs` adds vLLM's field;
    `with_usage` ends a stream with a usage chunk (stream_options.include_usage);
    `continuous_usage` puts the usage so far in every chunk (stream_options.continuous_usage_stats);
    `reasoning` (the model's reasoning parser splits this request's output) adds `reasoning_content`
    to messages and deltas, and the reasoning tokens to the usage. `legacy_functions` (the request
    sent `functions`) answers as that API does: one `function_call` and `finish_reason:
    function_call`, where the tools API has `tool_calls`, which a client of `functions` never reads.
    """

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        tools: ToolPlan | None = None,
        echo_logprobs: int | None = None,
        prompt_logprobs: bool = False,
        with_usage: bool = False,
        continuous_usage: bool = False,
        reasoning: bool = False,
        legacy_functions: bool = False,
    ) -> None:
        self.id = request_id
        self.model = model
        self.chat = chat
        self.tools = tools if tools is not None and tools.active else None
        self.echo_logprobs = echo_logprobs
        self.prompt_logprobs = prompt_logprobs
        self.with_usage = with_usage
        self.continuous_usage = continuous_usage
        self.reasoning = reasoning
        self.legacy_functions = legacy_functions
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._echoed: set[int] = set()  # choices whose echo went out with their first chunk
        self._tool_streams: dict[int, ToolCallStream] = {}
        # A chunk is `data: {"id":..,"object":..,"created":..,"model":..,"choices":[` + one choice +
        # `]` + the usage field, if any + `}`: everything but the choice and usage is fixed.
        head = {"id": self.id, "object": self.object + (".chunk" if chat else ""), "created": self.created,
                "model": self.model, "choices": []}  # fmt: skip
        self._chunk_head = b"data: " + json_bytes(head)[:-2]  # without the `]}` that closes it

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        obj = self.object + (".chunk" if chunk and self.chat else "")
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    # ---- the serving path's calls ---------------------------------------------------------------

    def opening(self, owner: RequestOwner) -> bytes:
        return b"".join(self.first_chunks([c.index for c in owner.choices], self.with_usage))

    def chunk(self, owner: RequestOwner, index: int, delta: Delta) -> bytes:
        # owner.outputs builds a list on every call; only continuous usage reads it.
        usage_now = owner.outputs if self.continuous_usage else None
        return self.delta_chunk(owner.choices[index], delta, self.with_usage, usage_now)

    def closing(self, owner: RequestOwner) -> bytes:
        return (self.usage_chunk(owner.outputs) if self.with_usage else b"") + SSE_DONE

    def stream_error(self, error: APIError) -> bytes:
        return sse_error(error.body()) + SSE_DONE

    def body(self, owner: RequestOwner) -> dict[str, Any]:
        return self.final_body(owner.choices)

    # ---- shapes ----------------------------------------------------------------------------------

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

    def delta_chunk(
        self, choice: Choice, output: Delta, with_usage: bool, usage_now: list[ChoiceOutput] | None = None
    ) -> bytes:
        """The SSE chunk(s) for one output of one choice; empty when there is nothing to send.
        `usage_now` (every choice's output so far) is reported in each chunk with continuous usage."""
        echo = ""
        if choice.input.echo and choice.index not in self._echoed:
            self._echoed.add(choice.index)
            echo = choice.input.echo
        prompt = output.prompt_logprobs if self.echo_logprobs is not None else None
        if not (output.text or output.reasoning or output.finish_reason or output.logprobs or echo or prompt):
            return b""
        state = choice.output
        logprobs = None
        if output.logprobs or prompt:
            if self.chat:
                logprobs = chat_logprobs(output.logprobs or [])
            else:
                start = len(choice.input.echo) + state.text_length - len(output.text)
                logprobs = completion_logprobs(output.logprobs or [], start, prompt, self.echo_logprobs or 0)
        finish = output.finish_reason.value if output.finish_reason else None
        if self.chat and self.tools is not None:
            return self._tool_chunks(choice, output, logprobs, finish, with_usage, usage_now)
        if self.chat:
            delta = {"reasoning_content": output.reasoning} if output.reasoning else {}
            if output.text:
                delta["content"] = output.text
            body: dict[str, Any] = {"index": choice.index, "delta": delta}
        else:
            body = {"index": choice.index, "text": echo + output.text}
            if self.prompt_logprobs and output.prompt_logprobs is not None:
                body["prompt_logprobs"] = prompt_logprobs_body(output.prompt_logprobs)
        body["logprobs"] = logprobs
        body["finish_reason"] = finish
        return self._chunk(body, with_usage, usage_now)

    def _chunk(self, body: dict[str, Any], with_usage: bool, usage_now: list[ChoiceOutput] | None) -> bytes:
        """The SSE chunk of one choice's body: what `sse(envelope)` writes, with the envelope's
        fixed part encoded once. Logprobs hold floats; nothing else in a choice body does."""
        floats = body["logprobs"] is not None or "prompt_logprobs" in body
        encoded = json_bytes(body) if floats else plain_json_bytes(body)
        if self.continuous_usage and usage_now is not None:
            tail = b'],"usage":' + plain_json_bytes(usage_body(usage_now, self.reasoning)) + b"}\n\n"
        elif with_usage:
            tail = b'],"usage":null}\n\n'
        else:
            tail = b"]}\n\n"
        return self._chunk_head + encoded + tail

    def _tool_chunks(
        self,
        choice: Choice,
        output: Delta,
        logprobs: dict[str, Any] | None,
        finish: str | None,
        with_usage: bool,
        usage_now: list[ChoiceOutput] | None,
    ) -> bytes:
        assert self.tools is not None
        stream = self._tool_streams.setdefault(choice.index, ToolCallStream(self.tools))
        # Only text opens a call: a named call's header must not come before the thinking is over.
        deltas = stream.feed(output.text) if output.text else []
        if output.reasoning:  # the thinking comes first; tool calls are read from the answer only
            deltas.insert(0, {"reasoning_content": output.reasoning})
        if output.finish_reason is not None:
            tail, called = stream.finish(cut=output.finish_reason is FinishReason.LENGTH)
            deltas += tail
            finish = self._finish_reason(output.finish_reason, called)
        if not deltas:
            if finish is None and logprobs is None:
                return b""  # text held back (a marker may be starting): nothing to say yet
            deltas = [{}]
        if self.legacy_functions:
            deltas = [_as_function_call(delta) for delta in deltas]
        chunks = []
        for position, delta in enumerate(deltas):
            last = position == len(deltas) - 1
            body = {"index": choice.index, "delta": delta, "logprobs": logprobs if position == 0 else None,
                    "finish_reason": finish if last else None}  # fmt: skip
            chunks.append(self._chunk(body, with_usage, usage_now))
        return b"".join(chunks)

    def _finish_reason(self, reason: FinishReason | None, called: bool) -> str | None:
        # OpenAI ends a forced (named) call with "stop", and calls the model chose with "tool_calls".
        if called and reason is FinishReason.STOP and self.tools is not None and self.tools.mode != "named":
            return "function_call" if self.legacy_functions else "tool_calls"
        return reason.value if reason else None

    def usage_chunk(self, outputs: list[ChoiceOutput]) -> bytes:
        body = self._envelope([], chunk=True)
        body["usage"] = usage_body(outputs, self.reasoning)
        return sse(body)

    def final_body(self, choices: list[Choice]) -> dict[str, Any]:
        bodies = []
        for choice in choices:
            state = choice.output
            finish = state.finish_reason.value if state.finish_reason else None
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": state.text}
                if self.reasoning:
                    message["reasoning_content"] = state.reasoning or None
                if self.tools is not None:
                    parsed = self.tools.read_final(state.text, cut=state.finish_reason is FinishReason.LENGTH)
                    message["content"] = parsed.content
                    if parsed.calls and self.legacy_functions:
                        call = parsed.calls[0]  # the legacy API makes one call at most
                        message["function_call"] = {"name": call.name, "arguments": call.arguments}
                    elif parsed.calls:
                        message["tool_calls"] = [
                            {"id": self.tools.call_id(), "type": "function",
                             "function": {"name": call.name, "arguments": call.arguments}}
                            for call in parsed.calls
                        ]  # fmt: skip
                    finish = self._finish_reason(state.finish_reason, bool(parsed.calls))
                body: dict[str, Any] = {
                    "index": choice.index,
                    "message": message,
                    "logprobs": chat_logprobs(state.logprobs) if state.logprobs else None,
                }
            else:
                echo = choice.input.echo
                prompt = state.prompt_logprobs if self.echo_logprobs is not None else None
                logprobs = None
                if state.logprobs or prompt:
                    logprobs = completion_logprobs(state.logprobs, len(echo), prompt, self.echo_logprobs or 0)
                body = {"index": choice.index, "text": echo + state.text, "logprobs": logprobs}
                if self.prompt_logprobs:
                    body["prompt_logprobs"] = prompt_logprobs_body(state.prompt_logprobs or [])
            body["finish_reason"] = finish
            bodies.append(body)
        envelope = self._envelope(bodies, chunk=False)
        if self.chat and self.prompt_logprobs:
            # vLLM puts a chat request's prompt logprobs beside the choices (they share the prompt).
            first = choices[0].output.prompt_logprobs if choices else None
            envelope["prompt_logprobs"] = prompt_logprobs_body(first or [])
        envelope["usage"] = usage_body([c.output for c in choices], self.reasoning)
        return envelope


def _as_function_call(delta: dict[str, Any]) -> dict[str, Any]:
    """A tool_calls delta as the legacy functions API streams it: the first call's name and
    arguments under `function_call` (that API makes one call at most)."""
    calls = delta.get("tool_calls")
    if calls is None:
        return delta
    legacy = {key: value for key, value in delta.items() if key != "tool_calls"}
    first = [call for call in calls if call.get("index") == 0]
    if first:
        legacy["function_call"] = dict(first[0]["function"])
    return legacy
