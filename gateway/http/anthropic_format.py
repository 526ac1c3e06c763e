"""The Anthropic Messages API's JSON shapes: the message, its event stream, and its errors.

Runs in the gateway process. Owns what the `anthropic` SDK's `messages.create` and
`messages.stream` parse: a `message` whose content is thinking, text and tool_use blocks, with
`stop_reason` end_turn / max_tokens / stop_sequence / tool_use, `stop_sequence` and `usage`; and the
event stream message_start, ping, then per block content_block_start, content_block_delta
(thinking_delta, text_delta, input_json_delta)..., content_block_stop, then message_delta (the stop
reason and usage) and message_stop. Errors, on these routes, are `{"type": "error", "error":
{"type", "message"}}`. Tool calls are read from the answer by the request's ToolPlan, as in chat.
Pure functions of the request's outputs; no I/O.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import jiter

from gateway.errors import APIError
from gateway.http.serving_path import Formatter
from gateway.serving.outputs import ChoiceOutput, Delta
from gateway.serving.request_owner import RequestOwner
from gateway.tools.plan import ToolPlan
from gateway.tools.stream import ToolCallStream
from wire.results import FinishReason

# Anthropic's error types by HTTP status; other statuses are api_error.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def event(kind: str, payload: dict[str, Any]) -> bytes:
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n".encode()


def tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def usage_body(output: ChoiceOutput) -> dict[str, int]:
    # Anthropic counts cache reads apart: input_tokens are the prompt tokens that were not cached.
    return {
        "input_tokens": output.prompt_tokens - output.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": output.cached_tokens,
        "output_tokens": output.completion_tokens,
    }


class MessagesFormatter(Formatter):
    keepalive = event("ping", {"type": "ping"})

    def __init__(self, model: str, tools: ToolPlan, thinking_shown: bool = True) -> None:
        self.id = "msg_" + secrets.token_hex(12)
        self.thinking_shown = thinking_shown  # display: omitted sends thinking blocks without their text
        self.model = model
        self.tools = tools if tools.active else None
        self._stream = ToolCallStream(self.tools) if self.tools is not None else None
        self._blocks = 0  # content blocks started so far (the next one's index)
        self._open: str | None = None  # the kind of the block being streamed
        self._called = False  # a tool_use block was sent

    # ---- the message -------------------------------------------------------------------------

    def _message(
        self, content: list[dict[str, Any]], output: ChoiceOutput, stop_reason: str | None
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": output.stop_sequence if stop_reason == "stop_sequence" else None,
            "usage": usage_body(output),
        }

    def _stop_reason(self, output: ChoiceOutput, called: bool) -> str:
        if output.finish_reason is FinishReason.LENGTH:
            return "max_tokens"
        if output.stop_sequence is not None:
            return "stop_sequence"
        return "tool_use" if called else "end_turn"

    def body(self, owner: RequestOwner) -> dict[str, Any]:
        output = owner.choices[0].output
        content: list[dict[str, Any]] = []
        if output.reasoning:
            shown = output.reasoning if self.thinking_shown else ""
            content.append({"type": "thinking", "thinking": shown, "signature": ""})
        text, calls = output.text, []
        if self.tools is not None:
            parsed = self.tools.read_final(output.text, cut=output.finish_reason is FinishReason.LENGTH)
            text, calls = parsed.content or "", parsed.calls
        if text:  # an empty answer has no blocks (content: []), as Anthropic's and the stream's
            content.append({"type": "text", "text": text})
        for call in calls:
            content.append({"type": "tool_use", "id": tool_use_id(), "name": call.name,
                            "input": _input_object(call.arguments)})  # fmt: skip
        return self._message(content, output, self._stop_reason(output, bool(calls)))

    # ---- the event stream --------------------------------------------------------------------

    def opening(self, owner: RequestOwner) -> bytes:
        output = owner.choices[0].output
        start = self._message([], output, None)
        start["usage"]["output_tokens"] = 0
        return event("message_start", {"type": "message_start", "message": start}) + self.keepalive

    def chunk(self, owner: RequestOwner, index: int, delta: Delta) -> bytes:
        out: list[bytes] = []
        if delta.reasoning:
            out += self._into("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            if self.thinking_shown:
                out.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        pieces: list[dict[str, Any]] = [{"content": delta.text}] if delta.text else []
        if self._stream is not None:
            pieces = self._stream.feed(delta.text) if delta.text else []
            if delta.finish_reason is not None:
                pieces += self._stream.finish(cut=delta.finish_reason is FinishReason.LENGTH)[0]
        for piece in pieces:
            if piece.get("content"):
                out += self._into("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": piece["content"]}))
            for call in piece.get("tool_calls", []):
                function = call.get("function", {})
                if "id" in call:  # a new call: its own block
                    self._called = True
                    block = {
                        "type": "tool_use",
                        "id": tool_use_id(),
                        "name": function.get("name", ""),
                        "input": {},
                    }
                    out += self._into("tool_use", block)
                if function.get("arguments"):
                    out.append(
                        self._delta({"type": "input_json_delta", "partial_json": function["arguments"]})
                    )
        if delta.finish_reason is not None:
            out += self._close()
        return b"".join(out)

    def closing(self, owner: RequestOwner) -> bytes:
        output = owner.choices[0].output
        stop_reason = self._stop_reason(output, self._called)
        usage = usage_body(output)
        message_delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": output.stop_sequence},
            "usage": usage,
        }
        return event("message_delta", message_delta) + event("message_stop", {"type": "message_stop"})

    def stream_error(self, error: APIError) -> bytes:
        return event("error", anthropic_error_body(error.status, error.message))

    def _into(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        """Events that make `kind` the open block (closing another first); none if it already is.
        A tool_use block is always a new one."""
        if self._open == kind and kind != "tool_use":
            return []
        out = self._close()
        self._open = kind
        out.append(event("content_block_start", {"type": "content_block_start", "index": self._blocks,
                                                 "content_block": block}))  # fmt: skip
        return out

    def _delta(self, body: dict[str, Any]) -> bytes:
        return event(
            "content_block_delta", {"type": "content_block_delta", "index": self._blocks, "delta": body}
        )

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        out = []
        if self._open == "thinking":  # a thinking block ends with its signature (none here)
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        out.append(event("content_block_stop", {"type": "content_block_stop", "index": self._blocks}))
        self._open = None
        self._blocks += 1
        return out


def _input_object(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object a tool_use block carries; a call cut by max_tokens is read
    as far as it goes (its last string as cut), as the SDK reads a streamed one."""
    try:
        value = jiter.from_json(arguments.encode(), partial_mode="trailing-strings")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
