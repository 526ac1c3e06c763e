"""The Responses API's request schema, and its translation into a chat request.

Runs in the gateway process, at the API edge. Owns what POST /v1/responses accepts: `instructions`
becomes a system message (never carried over to a later response), `input` (a string, or message
items with text parts; reasoning items a client sends back are dropped, as reasoning templates drop
earlier reasoning) the new turn, after the stored conversation that `previous_response_id` names;
`max_output_tokens` and `text.format` become the chat's max_tokens and response_format. What this
text-only endpoint would otherwise drop or misread is a 400 naming it: `conversation` and
`background` (no conversation objects, no background runs), tools, reasoning settings, `include`,
`top_logprobs`, `text.verbosity`, a malformed `text`, a message role the API has no message items
for (`tool`), a stored `prompt`, any field the API does not name (a sampling setting of the chat
API sent here, for example), and a value of the wrong JSON type (never coerced). Errors name this
API's fields, never the chat request's (`in_responses_terms`).
"""

from __future__ import annotations

import copy
import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema

from gateway.errors import APIError, InvalidRequest
from gateway.http.schemas import ChatCompletionRequest, ChatMessage

# The chat request's fields, by the names this API gives them.
_CHAT_TO_RESPONSES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}
_NOT_KEPT = "{} is not supported: this gateway keeps stored responses (previous_response_id), not {}"
# Message items carry these roles only; a tool's result is a function_call_output item instead.
_ROLES = ("user", "assistant", "system", "developer")
# text.format's keys, by its type (OpenAI's ResponseFormatTextConfig).
_FORMAT_KEYS = {
    "text": frozenset({"type"}),
    "json_object": frozenset({"type"}),
    "json_schema": frozenset({"type", "name", "schema", "description", "strict"}),
}
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _null_is_false(value: object) -> object:
    return False if value is None else value


# A flag OpenAI marks nullable: null means what leaving it out means.
NullableFlag = Annotated[
    bool, BeforeValidator(_null_is_false), WithJsonSchema({"anyOf": [{"type": "boolean"}, {"type": "null"}]})
]


class ResponsesRequest(BaseModel):
    # strict: a value of the wrong JSON type ("store": "yes", "max_output_tokens": true) is a 400
    # naming the field, not a setting the client never chose; a whole number still fits a float.
    model_config = ConfigDict(extra="allow", strict=True)
    model: str = Field(..., min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, lt=2**31)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: NullableFlag = False
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
    # OpenAI's fields that cannot change this endpoint's text (it has no tools, no service tiers, no
    # prompt cache to steer): typed, then ignored. A field not declared here is a 400 naming it: a
    # sampling setting sent here (seed, stop, top_k ...) or a stored `prompt` would otherwise be
    # dropped without a word.
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None

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
            raise InvalidRequest("truncation must be disabled: input is never dropped", param="truncation")
        if self.text is not None:
            _refuse_malformed_text(self.text)
        for name in sorted(self.model_extra or {}):
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
                chat_message = ChatMessage(role=item["role"], content=item.get("content"))
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"][:1])
                if where == "role":
                    raise _wrong_role(index, item["role"]) from None
                message = first["msg"].removeprefix("Value error, ")
                raise InvalidRequest(f"input[{index}].{where}: {message}", param="input") from None
            if chat_message.role not in _ROLES:  # the chat API's tool and function messages
                raise _wrong_role(index, chat_message.role)
            try:
                chat_message.to_wire()  # refuses the parts it cannot read (images, files)
            except InvalidRequest as exc:
                where = f"input[{index}].content"
                raise InvalidRequest(f"{where}: {exc.message} (text only)", param=where) from None
            messages.append(chat_message)
        return messages

    def response_format(self) -> dict[str, Any] | None:
        """text.format in the chat API's response_format shape (json_schema fields sit one level up);
        `refuse_what_is_not_honoured` checked its shape."""
        fmt = (self.text or {}).get("format")
        if fmt is None or fmt["type"] == "text":
            return None
        if fmt["type"] == "json_schema":
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
            "text": {**(self.text or {}), "format": (self.text or {}).get("format") or {"type": "text"}},
            "metadata": self.metadata or {},
            "truncation": "disabled",
        }


def _wrong_role(index: int, role: object) -> InvalidRequest:
    message = (f"input[{index}].role: {role!r} is not one of {', '.join(_ROLES)} (a tool's result is "
               "a function_call_output item, not supported here)")  # fmt: skip
    return InvalidRequest(message, param=f"input[{index}].role")


def _refuse_malformed_text(text: dict[str, Any]) -> None:
    """A 400 naming the first key of `text` that OpenAI's API would refuse, or that this endpoint
    cannot honour (a verbosity other than medium); a malformed format is never run as another one."""
    for key in text:
        if key not in ("format", "verbosity"):
            raise InvalidRequest(f"text.{key} is not a parameter of text", param=f"text.{key}")
    if text.get("verbosity") not in (None, "medium"):
        raise InvalidRequest("text.verbosity is not supported", param="text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return
    kinds = ", ".join(_FORMAT_KEYS)
    if not isinstance(fmt, dict):
        message = f"text.format must be an object with a type ({kinds}), not {type(fmt).__name__}"
        raise InvalidRequest(message, param="text.format")
    kind = fmt.get("type")
    if not isinstance(kind, str) or kind not in _FORMAT_KEYS:
        raise InvalidRequest(f"text.format.type must be one of {kinds}", param="text.format.type")
    for key in fmt:
        if key not in _FORMAT_KEYS[kind]:
            message = f"text.format.{key} is not a parameter of a {kind} format"
            raise InvalidRequest(message, param=f"text.format.{key}")
    if kind != "json_schema":
        return
    name = fmt.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        message = "text.format.name is required: 1 to 64 letters, digits, underscores or dashes"
        raise InvalidRequest(message, param="text.format.name")
    if not isinstance(fmt.get("schema"), dict):
        raise InvalidRequest(
            "text.format.schema is required: a JSON schema object", param="text.format.schema"
        )
    if not isinstance(fmt.get("strict"), bool | None):
        raise InvalidRequest("text.format.strict must be a boolean", param="text.format.strict")
    if not isinstance(fmt.get("description"), str | None):
        raise InvalidRequest("text.format.description must be a string", param="text.format.description")


def in_responses_terms(error: APIError) -> APIError:
    """`error` naming this API's field where it names the chat request's (a worker's rejection of a
    prompt too long names `messages`; here that is `input`)."""
    chat_field = (error.param or "").split(".")[0]
    field = _CHAT_TO_RESPONSES.get(chat_field)
    if field is None:
        return error
    renamed = copy.copy(error)
    renamed.param = field
    # A message that opens with the chat field's name ("max_tokens must not exceed ...") names it too.
    if re.match(rf"{chat_field}[ :]", error.message):
        renamed.message = field + error.message[len(chat_field) :]
    return renamed
