"""The Responses API's request schema, and its translation into a chat request.

Runs in the gateway process, at the API edge. Owns what POST /v1/responses accepts: `instructions`
becomes a system message (never carried over to a later response), `input` (a string, or message
items with text parts; reasoning items a client sends back are dropped, as reasoning templates drop
earlier reasoning) the new turn, after the stored conversation that `previous_response_id` names;
`max_output_tokens` and `text.format` become the chat's max_tokens and response_format. What this
text-only endpoint would otherwise drop is a 400 naming it: `conversation` and `background` (no
conversation objects, no background runs), tools, reasoning settings, `include`, `top_logprobs`,
`text.verbosity`, a stored `prompt`, and any field the API does not name (a sampling setting of the
chat API sent here, for example).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import InvalidRequest
from gateway.http.schemas import ChatCompletionRequest, ChatMessage

# The chat request's fields, by the names this API gives them.
_CHAT_TO_RESPONSES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}
_NOT_KEPT = "{} is not supported: this gateway keeps stored responses (previous_response_id), not {}"
# Fields of OpenAI's Responses API that cannot change this endpoint's text (it has no tools, no
# service tiers, no prompt cache to steer): accepted and ignored. Any other field the schema does
# not name is a 400 naming it: a sampling setting sent here (seed, stop, top_k ...) or a stored
# prompt (`prompt`) would otherwise be dropped without a word.
_IGNORED_FIELDS = frozenset({
    "service_tier", "stream_options", "prompt_cache_key", "prompt_cache_retention", "safety_identifier",
    "parallel_tool_calls", "max_tool_calls",
})  # fmt: skip


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(..., min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, lt=2**31)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = Field(None, description="Keep the response; left out: server.responses' default.")
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    truncation: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    timeout: float | None = Field(None, gt=0, description="Per-request deadline in seconds (extension).")
    thinking_token_budget: int | None = Field(
        None, ge=1, lt=2**31, description="Thinking tokens at most (vLLM's extension; a reasoning model)."
    )

    def refuse_what_is_not_honoured(self) -> None:
        if self.conversation is not None:
            message = _NOT_KEPT.format("conversation", "conversation objects")
            raise InvalidRequest(message, param="conversation")
        if self.background:
            raise InvalidRequest(_NOT_KEPT.format("background: true", "background runs"), param="background")
        if self.tools:
            raise InvalidRequest("tools are not supported on /v1/responses; use /v1/chat/completions",
                                 param="tools")  # fmt: skip
        if self.tool_choice not in (None, "none", "auto"):
            raise InvalidRequest(
                "tool_choice needs tools, which /v1/responses does not support", param="tool_choice"
            )
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise InvalidRequest("reasoning settings are not supported", param="reasoning")
        if self.include:
            raise InvalidRequest(f"include {self.include} is not supported", param="include")
        if self.top_logprobs:
            raise InvalidRequest("top_logprobs is not supported on /v1/responses", param="top_logprobs")
        if self.truncation not in (None, "disabled"):
            raise InvalidRequest("truncation must be disabled: prompts are never cut", param="truncation")
        verbosity = (self.text or {}).get("verbosity")
        if verbosity not in (None, "medium"):
            raise InvalidRequest("text.verbosity is not supported", param="text.verbosity")
        for name in sorted(set(self.model_extra or {}) - _IGNORED_FIELDS):
            if name == "prompt":
                raise InvalidRequest("prompt (a stored prompt template) is not supported", param="prompt")
            raise InvalidRequest(f"{name} is not supported on /v1/responses", param=name)

    def input_messages(self) -> list[ChatMessage]:
        """The new turn's messages (no instructions)."""
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        messages = []
        for index, item in enumerate(self.input):
            if item.get("type") == "reasoning":
                continue  # earlier reasoning a client sends back: templates drop it
            if item.get("type", "message") != "message" or "role" not in item:
                kind = item.get("type", "unknown")
                message = f"input[{index}]: item type {kind!r} is not supported (text messages only)"
                raise InvalidRequest(message, param="input")
            try:
                messages.append(ChatMessage(role=item["role"], content=item.get("content")))
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"][:1])
                message = first["msg"].removeprefix("Value error, ")
                raise InvalidRequest(f"input[{index}].{where}: {message}", param="input") from None
        return messages

    def response_format(self) -> dict[str, Any] | None:
        """text.format in the chat API's response_format shape (json_schema fields sit one level up)."""
        fmt = (self.text or {}).get("format")
        if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
            return None
        if fmt.get("type") == "json_schema":
            schema = {k: fmt.get(k) for k in ("name", "schema", "strict") if fmt.get(k) is not None}
            return {"type": "json_schema", "json_schema": schema}
        return {"type": fmt.get("type")}

    def as_chat(self, earlier: list[ChatMessage]) -> ChatCompletionRequest:
        """The chat request this one is, after the `earlier` conversation; its validation errors name
        this request's fields."""
        system = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        try:
            return ChatCompletionRequest(
                model=self.model,
                messages=[*system, *earlier, *self.input_messages()],
                max_tokens=self.max_output_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                response_format=self.response_format(),
                stream=self.stream,
                timeout=self.timeout,
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            field = _CHAT_TO_RESPONSES.get(str(first["loc"][0]) if first["loc"] else "", "input")
            raise InvalidRequest(
                f"{field}: {first['msg'].removeprefix('Value error, ')}", param=field
            ) from None

    def echoed_settings(self, stored: bool) -> dict[str, Any]:
        return {
            "store": stored,
            "previous_response_id": self.previous_response_id,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "text": self.text or {"format": {"type": "text"}},
            "metadata": self.metadata or {},
            "truncation": "disabled",
        }
