"""POST /v1/responses: OpenAI's Responses API, stateless (store: false), text in and text out.

Runs in the gateway process. Owns the request schema and its translation into a chat request:
`instructions` becomes a system message, `input` (a string, or message items with text parts)
the conversation, `max_output_tokens` and `text.format` the chat's max_tokens and response_format.
Generation then runs on the one serving path (gateway.http.serving_path) as any chat completion;
gateway.http.responses_format writes the response object or its event stream. Nothing is stored:
a request that needs stored state (`previous_response_id`, `conversation`, `store: true`,
`background`) is a 400 saying so, and so is anything this text-only endpoint would otherwise drop
(tools, reasoning, logprobs).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from quart import Blueprint
from quart_schema import validate_request

from gateway.errors import InvalidRequest
from gateway.http.responses_format import ResponseBuilder
from gateway.http.schemas import ChatCompletionRequest, ChatMessage
from gateway.http.serving_path import Generation, serve_generation
from gateway.reasoning.plan import plan_reasoning
from gateway.serving.choice_text import TextPlan
from gateway.serving.outputs import ChoiceInput
from gateway.serving.router import ModelRoute
from wire.params import ChatOptions

blueprint = Blueprint("responses", __name__)

# The chat request's fields, by the names this API gives them.
_CHAT_TO_RESPONSES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}
_NEEDS_STATE = "this gateway does not store responses (store: false only), so {} cannot be used"


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(..., min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, lt=2**31)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = Field(None, description="Only false (or left out): nothing is stored.")
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
        for field, value in (("previous_response_id", self.previous_response_id),
                             ("conversation", self.conversation)):  # fmt: skip
            if value is not None:
                raise InvalidRequest(_NEEDS_STATE.format(field), param=field)
        if self.store:
            raise InvalidRequest(_NEEDS_STATE.format("store: true"), param="store")
        if self.background:
            raise InvalidRequest(_NEEDS_STATE.format("background: true"), param="background")
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

    def messages(self) -> list[ChatMessage]:
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        if isinstance(self.input, str):
            return [*messages, ChatMessage(role="user", content=self.input)]
        for index, item in enumerate(self.input):
            if item.get("type", "message") != "message" or "role" not in item:
                kind = item.get("type", "unknown")
                message = f"input[{index}]: item type {kind!r} is not supported (text messages only)"
                raise InvalidRequest(message, param="input")
            try:
                messages.append(ChatMessage(role=item["role"], content=item.get("content")))
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"][:1])
                raise InvalidRequest(f"input[{index}].{where}: {first['msg']}", param="input") from None
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

    def as_chat(self) -> ChatCompletionRequest:
        """The chat request this one is; its validation errors name this request's fields."""
        try:
            return ChatCompletionRequest(
                model=self.model,
                messages=self.messages(),
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

    def echoed_settings(self) -> dict[str, Any]:
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "text": self.text or {"format": {"type": "text"}},
            "metadata": self.metadata or {},
            "truncation": "disabled",
        }


@blueprint.post("/v1/responses")
@validate_request(ResponsesRequest)
async def responses(data: ResponsesRequest) -> Any:
    data.refuse_what_is_not_honoured()
    chat = data.as_chat()

    async def plan_for(route: ModelRoute, model: str) -> Generation:
        params = chat.sampling_params(route.config, None)
        params, reasoning = plan_reasoning(
            route.config, {}, data.thinking_token_budget, "thinking_token_budget", params
        )
        inputs = [ChoiceInput(messages=[m.to_wire() for m in chat.messages], chat=ChatOptions())]
        builder = ResponseBuilder(model, data.echoed_settings(), reasoning=reasoning is not None)
        return Generation(inputs, params, builder, TextPlan(reasoning=reasoning))

    return await serve_generation(data.model, plan_for, data.stream, data.timeout)
