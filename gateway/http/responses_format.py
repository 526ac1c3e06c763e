"""The Responses API's JSON shapes: the response object and the SSE events of a streamed one.

Runs in the gateway process. Owns what the openai SDK's `responses.create` and `responses.stream`
parse: a `response` object with one assistant `message` item holding one `output_text` part, and
the event sequence created, in_progress, output_item.added, content_part.added,
output_text.delta..., output_text.done, content_part.done, output_item.done, then completed (or
incomplete when max_output_tokens cut the text), each with its sequence_number. Pure functions of
the request's settings and the choice's output; no I/O.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from gateway.errors import APIError
from gateway.http.serving_path import Formatter
from gateway.serving.outputs import ChoiceOutput, Delta, usage_totals
from gateway.serving.request_owner import RequestOwner
from wire.results import FinishReason


class ResponseBuilder(Formatter):
    def __init__(self, model: str, settings: dict[str, Any]) -> None:
        self.id = "resp_" + uuid.uuid4().hex
        self.item_id = "msg_" + uuid.uuid4().hex
        self.model = model
        self.created_at = int(time.time())
        self.settings = settings  # instructions, temperature, top_p, max_output_tokens, text, metadata
        self._sequence = 0

    # ---- the serving path's calls ---------------------------------------------------------------

    def opening(self, owner: RequestOwner) -> bytes:
        return b"".join(self.opening_events())

    def chunk(self, owner: RequestOwner, index: int, delta: Delta) -> bytes:
        return self.delta_event(delta.text) if delta.text else b""

    def closing(self, owner: RequestOwner) -> bytes:
        return b"".join(self.closing_events(owner.choices[0].output))

    def stream_error(self, error: APIError) -> bytes:
        return self.error_event(error.body())

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
            body["output"] = [self._item(output.text, "completed" if status == "completed" else "incomplete")]
            if status == "incomplete":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            totals = usage_totals([output])
            body["usage"] = {
                "input_tokens": totals.prompt_tokens,
                "input_tokens_details": {"cached_tokens": totals.cached_tokens},
                "output_tokens": totals.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
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

    def opening_events(self) -> list[bytes]:
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return [
            self.event("response.created", response=self.response("in_progress")),
            self.event("response.in_progress", response=self.response("in_progress")),
            self.event("response.output_item.added", output_index=0, item=self._item(None, "in_progress")),
            self.event("response.content_part.added", **where, part=self._part("")),
        ]

    def delta_event(self, text: str) -> bytes:
        return self.event("response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0,
                          delta=text, logprobs=[])  # fmt: skip

    def closing_events(self, output: ChoiceOutput) -> list[bytes]:
        status = self.final_status(output)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        item_status = "completed" if status == "completed" else "incomplete"
        return [
            self.event("response.output_text.done", **where, text=output.text, logprobs=[]),
            self.event("response.content_part.done", **where, part=self._part(output.text)),
            self.event(
                "response.output_item.done", output_index=0, item=self._item(output.text, item_status)
            ),
            self.event(f"response.{status}", response=self.response(status, output)),
        ]

    def error_event(self, error: dict[str, Any]) -> bytes:
        inner = error.get("error", {})
        return self.event(
            "error", code=inner.get("code"), message=inner.get("message"), param=inner.get("param")
        )
