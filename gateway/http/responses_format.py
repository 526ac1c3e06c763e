"""The Responses API's JSON shapes: the response object and the SSE events of a streamed one.

Runs in the gateway process. Owns what the openai SDK's `responses.create` and `responses.stream`
parse: a `response` object with one assistant `message` item holding one `output_text` part (after
a `reasoning` item with the thinking, for a model whose reasoning parser split it off), and the
event sequence created, in_progress, then per item output_item.added, content_part.added,
output_text.delta (reasoning_text.delta)..., output_text.done (reasoning_text.done),
content_part.done, output_item.done, then completed (or incomplete when max_output_tokens cut the
text), each with its sequence_number. Pure functions of the request's settings and the choice's
output; no I/O.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.errors import APIError
from gateway.http.responses_schema import in_responses_terms
from gateway.http.serving_path import Formatter
from gateway.serving.outputs import ChoiceOutput, Delta, usage_totals
from gateway.serving.request_owner import RequestOwner
from wire.results import FinishReason


class ResponseBuilder(Formatter):
    """One response: its object, and its events when streamed. `reasoning` (the model's reasoning
    parser splits this request's output) puts a reasoning item with the thinking before the message."""

    def __init__(self, model: str, settings: dict[str, Any], reasoning: bool = False) -> None:
        self.id = "resp_" + uuid.uuid4().hex
        self.item_id = "msg_" + uuid.uuid4().hex
        self.reasoning_id = "rs_" + uuid.uuid4().hex
        self.model = model
        self.created_at = int(time.time())
        self.settings = settings  # instructions, temperature, top_p, max_output_tokens, text, metadata
        self.reasoning = reasoning
        # Called with the final response object before the client gets it (store: true).
        self.keep: Callable[[dict[str, Any], ChoiceOutput], Awaitable[None]] | None = None
        self._sequence = 0
        self._items: list[str] = []  # the kinds of the output items opened so far, in order
        self._open: str | None = None  # the kind of the item being streamed

    # ---- the serving path's calls ---------------------------------------------------------------

    def opening(self, owner: RequestOwner) -> bytes:
        return self.event("response.created", response=self.response("in_progress")) + self.event(
            "response.in_progress", response=self.response("in_progress")
        )

    def chunk(self, owner: RequestOwner, index: int, delta: Delta) -> bytes:
        output = owner.choices[0].output
        out = []
        if delta.reasoning:
            out += self._enter("reasoning", output)
            out.append(self.event("response.reasoning_text.delta", **self._where(), delta=delta.reasoning))
        if delta.text:
            out += self._enter("message", output)
            where = self._where()
            out.append(self.event("response.output_text.delta", **where, delta=delta.text, logprobs=[]))
        return b"".join(out)

    def finishing(self, owner: RequestOwner) -> Callable[[], Awaitable[None]] | None:
        keep = self.keep
        if keep is None:
            return None

        async def store() -> None:
            output = owner.choices[0].output
            await keep(self.response(self.final_status(output), output), output)

        return store

    def closing(self, owner: RequestOwner) -> bytes:
        output = owner.choices[0].output
        status = self.final_status(output)
        out = self._enter("message", output) if "message" not in self._items else []
        out += self._leave(output)
        out.append(self.event(f"response.{status}", response=self.response(status, output)))
        return b"".join(out)

    def stream_error(self, error: APIError) -> bytes:
        return self.error_event(in_responses_terms(error).body())

    def body(self, owner: RequestOwner) -> dict[str, Any]:
        output = owner.choices[0].output
        return self.response(self.final_status(output), output)

    # ---- objects -----------------------------------------------------------------------------

    def _part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _item(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [self._part(text)]
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def _reasoning_item(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        item = {"id": self.reasoning_id, "type": "reasoning", "summary": [], "content": content}
        return {**item, "status": status}

    def response(self, status: str, output: ChoiceOutput | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": [],
            "error": None,
            "incomplete_details": None,
            "parallel_tool_calls": False,
            "tool_choice": "none",
            "tools": [],
            "store": False,
            "previous_response_id": None,
            "usage": None,
            **self.settings,
        }
        if output is not None:
            item_status = "completed" if status == "completed" else "incomplete"
            if output.reasoning:
                body["output"].append(self._reasoning_item(output.reasoning, item_status))
            body["output"].append(self._item(output.text, item_status))
            if status == "incomplete":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            totals = usage_totals([output])
            body["usage"] = {
                "input_tokens": totals.prompt_tokens,
                "input_tokens_details": {"cached_tokens": totals.cached_tokens},
                "output_tokens": totals.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": totals.reasoning_tokens},
                "total_tokens": totals.total_tokens,
            }
        return body

    @staticmethod
    def final_status(output: ChoiceOutput) -> str:
        return "incomplete" if output.finish_reason is FinishReason.LENGTH else "completed"

    # ---- events ------------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def _where(self) -> dict[str, Any]:
        item_id = self.reasoning_id if self._open == "reasoning" else self.item_id
        return {"item_id": item_id, "output_index": len(self._items) - 1, "content_index": 0}

    def _enter(self, kind: str, output: ChoiceOutput) -> list[bytes]:
        """Events that open the `kind` item (closing the one before); none if it is open."""
        if self._open == kind:
            return []
        out = self._leave(output)
        self._items.append(kind)
        self._open = kind
        index = len(self._items) - 1
        if kind == "reasoning":
            item, part = self._reasoning_item(None, "in_progress"), {"type": "reasoning_text", "text": ""}
        else:
            item, part = self._item(None, "in_progress"), self._part("")
        out.append(self.event("response.output_item.added", output_index=index, item=item))
        out.append(self.event("response.content_part.added", **self._where(), part=part))
        return out

    def _leave(self, output: ChoiceOutput) -> list[bytes]:
        """The done events of the open item."""
        kind, where = self._open, self._where()
        if kind is None:
            return []
        self._open = None
        index = where["output_index"]
        finished = self.final_status(output) == "completed" or kind == "reasoning"
        status = "completed" if finished else "incomplete"
        if kind == "reasoning":
            text = output.reasoning
            part = {"type": "reasoning_text", "text": text}
            done = self.event("response.reasoning_text.done", **where, text=text)
            item = self._reasoning_item(text, status)
        else:
            text = output.text
            part = self._part(text)
            done = self.event("response.output_text.done", **where, text=text, logprobs=[])
            item = self._item(text, status)
        return [
            done,
            self.event("response.content_part.done", **where, part=part),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def error_event(self, error: dict[str, Any]) -> bytes:
        inner = error.get("error", {})
        return self.event(
            "error", code=inner.get("code"), message=inner.get("message"), param=inner.get("param")
        )
