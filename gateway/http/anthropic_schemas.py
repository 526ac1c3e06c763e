"""The Anthropic Messages API's request schema, and its translation into a chat request.

Runs in the gateway process, at the API edge. Owns what `POST /v1/messages` and
`/v1/messages/count_tokens` accept: `system` (a string or text blocks), `messages` whose content is
a string or blocks (`text`, `tool_use` from the assistant, `tool_result` from the user; earlier
`thinking` blocks are dropped, as reasoning models' templates drop earlier reasoning), `tools` with
an `input_schema`, `tool_choice` auto / any / tool / none, `stop_sequences`, `max_tokens`,
`temperature` / `top_p` / `top_k`, `metadata`, and `output_config.format` (a JSON schema). A
conversation that ends with an assistant turn is continued (Anthropic's prefill), unless that turn
is empty. The request becomes a `ChatCompletionRequest`, so sampling defaults, tool plans and
constraints are the chat route's own. Every other field, a value of the wrong JSON type, and every
block type that cannot be honoured, is a 400 naming it; so are Anthropic's own refusals of a
conversation (empty turns, a `tool_result` that answers no `tool_use` of the turn before, a
`tool_use` that the next turn does not answer), each naming the message.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.errors import InvalidRequest
from gateway.http.schemas import (
    MAX_MESSAGES,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    ToolCallItem,
)

# Accepted and without effect on the output: prompt-caching hints and routing hints.
_IGNORED_BLOCK_KEYS = frozenset({"cache_control"})
# The chat request's fields, by the names this API gives them (for validation errors).
_CHAT_TO_MESSAGES = {"response_format": "output_config", "tool_choice": "tool_choice", "tools": "tools"}
# Anthropic's wording for the conversations it refuses.
_EMPTY_TURN = "all messages must have non-empty content except for the optional final assistant message"
_STRAY_RESULT = (
    "unexpected `tool_use_id` found in `tool_result` blocks: {}. Each `tool_result` block must have a "
    "corresponding `tool_use` block in the previous message."
)
_UNANSWERED_CALL = (
    "`tool_use` ids were found without `tool_result` blocks immediately after: {}. Each `tool_use` "
    "block must have a corresponding `tool_result` block in the next message."
)


def _refuse(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(message, param=param)


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    """POST /v1/messages."""

    # Unknown fields are refused by name below. Strict: Anthropic refuses `"max_tokens": true` or
    # `"stream": "true"` rather than reading them as 1 and True (an int still fits a float field).
    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(..., min_length=1)
    messages: list[AnthropicMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int = Field(..., ge=1, lt=2**31)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, lt=2**31)
    metadata: dict[str, Any] | None = Field(None, description="Accepted; user_id is not used.")
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = Field(None, description="format (a JSON schema) only.")
    service_tier: Literal["auto", "standard_only"] | None = Field(None, description="Accepted; one tier.")
    cache_control: dict[str, Any] | None = Field(None, description="Accepted; prompt caching is automatic.")
    speed: Literal["standard"] | None = None
    user_profile_id: str | None = Field(None, description="Accepted; not used.")
    workspace_id: str | None = Field(None, description="Accepted; not used.")
    timeout: float | None = Field(None, gt=0, description="Per-request deadline in seconds (extension).")

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if key not in cls.model_fields:
                    raise _refuse(key, f"{key} is not supported")
        return data

    @field_validator("stop_sequences")
    @classmethod
    def _stop_caps(cls, stops: list[str] | None) -> list[str] | None:
        if stops is not None and len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences")
        if any(not s or len(s) > MAX_STOP_LENGTH for s in stops or []):
            raise ValueError(f"stop sequences must be 1 to {MAX_STOP_LENGTH} characters")
        return stops

    @field_validator("metadata")
    @classmethod
    def _metadata_keys(cls, metadata: dict[str, Any] | None) -> dict[str, Any] | None:
        unknown = set(metadata or {}) - {"user_id"}
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]} is not a metadata field (user_id only)")
        return metadata

    # ---- translation -------------------------------------------------------------------------

    def chat_messages(self) -> list[ChatMessage]:
        """The conversation as chat messages. An empty final assistant turn is left out (it asks
        for no prefill); any other empty turn is refused, as Anthropic does."""
        messages = []
        if self.system:
            system = self.system if isinstance(self.system, str) else _texts(self.system, "system")
            messages.append(ChatMessage(role="system", content=system))
        last = len(self.messages) - 1
        calls_before: list[str] = []  # the tool_use ids of the turn before, which results answer
        for index, message in enumerate(self.messages):
            where = f"messages[{index}].content"
            final_assistant = index == last and message.role == "assistant"
            if not message.content and not final_assistant:
                raise _refuse("messages", f"messages[{index}]: {_EMPTY_TURN}")
            if isinstance(message.content, str):
                turn = [ChatMessage(role=message.role, content=message.content)]
            elif message.role == "user":
                turn = _user_turn(message.content, where, set(calls_before))
            else:
                turn = [_assistant_turn(message.content, where)]
            # Anthropic refuses a call the next turn leaves unanswered anywhere in the history, not
            # only before a prefill: the template would render a call without its result.
            answered = {m.tool_call_id for m in turn if m.role == "tool"}
            unanswered = [call for call in calls_before if call not in answered]
            if unanswered:
                raise _refuse(
                    "messages", f"messages[{index - 1}]: " + _UNANSWERED_CALL.format(", ".join(unanswered))
                )
            calls_before = [c.id for c in turn[-1].tool_calls or [] if c.id]
            if final_assistant:
                prefill = turn[-1].content
                if turn[-1].tool_calls:  # a prefill cannot go on after a call: its result comes first
                    ids = ", ".join(c.id for c in turn[-1].tool_calls)
                    raise _refuse("messages", f"messages[{index}]: " + _UNANSWERED_CALL.format(ids))
                if not prefill:
                    continue  # nothing to continue: no prefill (thinking blocks alone are not rendered)
                if isinstance(prefill, str) and prefill != prefill.rstrip():
                    raise _refuse("messages", "final assistant content cannot end with trailing whitespace")
            messages.extend(turn)
        return messages

    def tool_definitions(self) -> tuple[list[dict[str, Any]] | None, Any, bool | None]:
        """(tools, tool_choice, parallel_tool_calls) in the chat API's form."""
        tools = None
        if self.tools is not None:
            tools = [_tool(tool, index) for index, tool in enumerate(self.tools)]
        choice = self.tool_choice
        if choice is None:
            return tools, None, None
        kind = choice.get("type")
        unknown = set(choice) - {"type", "name", "disable_parallel_tool_use"}
        if unknown:
            raise _refuse("tool_choice", f"tool_choice.{sorted(unknown)[0]} is not supported")
        disable_parallel = choice.get("disable_parallel_tool_use")
        if disable_parallel is not None and not isinstance(disable_parallel, bool):
            raise _refuse("tool_choice", "tool_choice.disable_parallel_tool_use must be a boolean")
        parallel = None if disable_parallel is None else not disable_parallel
        if kind == "tool":
            if not isinstance(choice.get("name"), str):
                raise _refuse("tool_choice", "tool_choice of type tool needs the tool's name")
            return tools, {"type": "function", "function": {"name": choice["name"]}}, parallel
        modes = {"auto": "auto", "any": "required", "none": "none"}
        mapped = modes.get(kind) if isinstance(kind, str) else None
        if mapped is None:
            raise _refuse("tool_choice", "tool_choice type must be auto, any, tool or none")
        return tools, mapped, parallel

    def response_format(self) -> dict[str, Any] | None:
        config = self.output_config or {}
        for key in config:
            if key != "format":
                raise _refuse("output_config", f"output_config.{key} is not supported")
        fmt = config.get("format")
        if fmt is None:
            return None
        if (
            not isinstance(fmt, dict)
            or fmt.get("type") != "json_schema"
            or not isinstance(fmt.get("schema"), dict)
        ):
            raise _refuse("output_config", "output_config.format must be {type: json_schema, schema: {...}}")
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}

    def as_chat(self, template_kwargs: dict[str, Any] | None = None) -> ChatCompletionRequest:
        """The chat request this one is; its validation errors name this request's fields."""
        messages = self.chat_messages()
        tools, tool_choice, parallel = self.tool_definitions()
        prefill = bool(messages) and messages[-1].role == "assistant"  # continue the assistant's turn
        try:
            return ChatCompletionRequest(
                model=self.model,
                messages=messages,
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                tools=tools,
                tool_choice=tool_choice,
                parallel_tool_calls=parallel,
                response_format=self.response_format(),
                add_generation_prompt=not prefill,
                continue_final_message=prefill,
                chat_template_kwargs=template_kwargs,
                timeout=self.timeout,
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            location = [str(p) for p in first["loc"]]
            field = _CHAT_TO_MESSAGES.get(
                location[0] if location else "", location[0] if location else "messages"
            )
            where = ".".join(location) or field
            raise _refuse(field, f"{where}: {first['msg'].removeprefix('Value error, ')}") from None


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: the prompt's fields of a Messages request."""

    max_tokens: int | None = Field(None, ge=1, lt=2**31)  # type: ignore[assignment]

    @model_validator(mode="before")
    @classmethod
    def _prompt_fields_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in (
                "stream",
                "stop_sequences",
                "temperature",
                "top_p",
                "top_k",
                "metadata",
                "service_tier",
            ):
                if key in data:
                    raise _refuse(key, f"{key} is not a field of count_tokens")
        return data


# ---- content blocks --------------------------------------------------------------------------


def _field(where: str) -> str:
    """The top-level field a location is in: messages[2].content[0] -> messages."""
    return where.split("[")[0].split(".")[0]


def _check_keys(block: dict[str, Any], allowed: set[str], where: str) -> None:
    for key in block:
        if key not in allowed and key not in _IGNORED_BLOCK_KEYS:
            raise _refuse(_field(where), f"{where}.{key} is not supported")


def _texts(blocks: list[dict[str, Any]], where: str, first: int = 0) -> str:
    """Text blocks joined; any other block type is refused (`first`: the first block's index)."""
    parts = []
    if not isinstance(blocks, list):
        raise _refuse(_field(where), f"{where} must be a string or a list of text blocks")
    for index, block in enumerate(blocks, start=first):
        at = f"{where}[{index}]"
        if not isinstance(block, dict):
            raise _refuse(_field(where), f"{at} must be a content block object")
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type")
            raise _refuse(_field(where), f"{at}: block type {kind!r} is not supported here")
        if block.get("citations"):
            raise _refuse(_field(where), f"{at}.citations is not supported")
        _check_keys(block, {"type", "text", "citations"}, at)
        parts.append(block["text"])
    return "\n".join(parts) if where == "system" else "".join(parts)


def _user_turn(blocks: list[dict[str, Any]], where: str, calls_before: set[str]) -> list[ChatMessage]:
    """Tool results become tool messages (they come first in a user turn); the text, one user message.
    Each result answers one of `calls_before`, the tool_use ids of the assistant turn before."""
    results, texts = [], []
    for index, block in enumerate(blocks):
        at = f"{where}[{index}]"
        kind = block.get("type")
        if kind == "tool_result":
            _check_keys(block, {"type", "tool_use_id", "content", "is_error"}, at)
            if not isinstance(block.get("tool_use_id"), str):
                raise _refuse("messages", f"{at}.tool_use_id is required")
            if block["tool_use_id"] not in calls_before:
                raise _refuse("messages", f"{at}: " + _STRAY_RESULT.format(block["tool_use_id"]))
            if not isinstance(block.get("is_error", False), bool):
                raise _refuse("messages", f"{at}.is_error must be a boolean")
            content = block.get("content", "")
            text = content if isinstance(content, str) else _texts(content, f"{at}.content")
            if block.get("is_error"):
                text = f"Error: {text}"  # the template has no field for it; the model must still know
            results.append(ChatMessage(role="tool", content=text, tool_call_id=block["tool_use_id"]))
        else:
            texts.append(_texts([block], where, index))
    messages = results
    if texts or not results:
        messages.append(ChatMessage(role="user", content="".join(texts)))
    return messages


def _assistant_turn(blocks: list[dict[str, Any]], where: str) -> ChatMessage:
    texts: list[str] = []
    calls: list[ToolCallItem] = []
    for index, block in enumerate(blocks):
        at = f"{where}[{index}]"
        kind = block.get("type")
        if kind == "tool_use":
            _check_keys(block, {"type", "id", "name", "input"}, at)
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input"), dict):
                raise _refuse("messages", f"{at}: a tool_use block needs a name and an input object")
            arguments = json.dumps(block["input"], ensure_ascii=False)
            calls.append(
                ToolCallItem(
                    id=str(block.get("id", "")),
                    function=FunctionCall(name=block["name"], arguments=arguments),
                )
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue  # earlier turns' reasoning is not rendered (reasoning templates drop it)
        else:
            texts.append(_texts([block], where, index))
    return ChatMessage(role="assistant", content="".join(texts), tool_calls=calls or None)


def _tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    """A custom tool in the chat API's function form; Anthropic's server tools are refused."""
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise _refuse("tools", f"tools[{index}]: tool type {kind!r} is not supported (custom tools only)")
    for key in tool:
        if key not in {"type", "name", "description", "input_schema", "cache_control", "strict"}:
            raise _refuse("tools", f"tools[{index}].{key} is not supported")
    if tool.get("strict"):
        raise _refuse("tools", f"tools[{index}].strict is not supported; tool_choice any or tool constrains "
                      "the input to the schema")  # fmt: skip
    if not isinstance(tool.get("input_schema"), dict):
        raise _refuse("tools", f"tools[{index}].input_schema must be a JSON schema object")
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}
