"""POST /tokenize, /detokenize (and vLLM's /v1/ aliases) and GET /tokenizer_info, answered by the
model's own worker.

Runs in the gateway process. Owns the request/response schemas of these routes; the tokenizer and
the chat template live in the worker, which answers with a Tokens frame (tokenizer_info comes from
its Ready message). These take no generation slot, so they work while a model is saturated; they
go through the one serving path's exchange owner, so a drain or a reload sees them.
`model` may be left out when the gateway serves one model, as lm-eval's remote tokenizer does
(it speaks to one vLLM server, which serves one model).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from quart import Blueprint, jsonify, request
from quart_schema import validate_request

from gateway.errors import InvalidRequest, ModelNotFound, ServiceUnavailable
from gateway.http.auth import may_use
from gateway.http.current import current_gateway
from gateway.http.field_rules import TemplateKwargs
from gateway.http.schemas import ChatMessage, TokenId, ToolDefinition
from gateway.http.serving_path import serve_exchange
from gateway.observability.logging_setup import set_log_context
from gateway.serving.router import ModelRoute
from gateway.tools.plan import tool_specs
from wire import messages as wire
from wire.codec import as_dict
from wire.params import ChatOptions

blueprint = Blueprint("tokenize", __name__)
ANSWER_TIMEOUT_S = 30.0


# Only a chat template reads these: beside `prompt` they would change nothing, so a value other
# than the default is refused by name rather than dropped.
CHAT_ONLY_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")


class TokenizeRequest(BaseModel):
    # Strict: "add_special_tokens": "no" or 0 is a 400 naming the field, not read as false.
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = Field(None, min_length=1, description="May be left out when one model is served.")
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=4096)
    add_special_tokens: bool = True
    # With messages, the chat template's switches, as in chat completions (vLLM).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: TemplateKwargs | None = None
    tools: list[ToolDefinition] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.prompt is not None:
            for name in CHAT_ONLY_FIELDS:
                if getattr(self, name) not in (type(self).model_fields[name].default, [], {}):
                    raise InvalidRequest(f"{name} applies only with messages, not with prompt", param=name)
        elif self.add_special_tokens and "add_special_tokens" in self.model_fields_set:
            # The chat template places the special tokens itself, as in chat completions; adding
            # more on top (vLLM's meaning of true here) is not done, so it is refused, not dropped.
            raise InvalidRequest(
                "add_special_tokens with messages must be false: the chat template adds the special tokens",
                param="add_special_tokens",
            )
        return self

    def chat_options(self) -> ChatOptions:
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidRequest(
                "continue_final_message needs add_generation_prompt false", param="continue_final_message"
            )
        tools = tool_specs([t.model_dump(exclude_none=True) for t in self.tools or []])
        return ChatOptions(tools, self.add_generation_prompt, self.continue_final_message,
                           dict(self.chat_template_kwargs or {}))  # fmt: skip


class DetokenizeRequest(BaseModel):
    # Strict: token ids sent as strings, floats or booleans are a 400, not read as integers.
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = Field(None, min_length=1, description="May be left out when one model is served.")
    tokens: list[TokenId] = Field(..., max_length=1_000_000)
    skip_special_tokens: bool = Field(True, description="Only true: the worker's decoder skips them.")

    @model_validator(mode="after")
    def _decodable(self) -> DetokenizeRequest:
        if not self.skip_special_tokens:
            raise InvalidRequest(
                "skip_special_tokens false is not supported (they are skipped)", param="skip_special_tokens"
            )
        return self


def model_route(name: str | None) -> ModelRoute:
    """The named model's route, or the only model's when none is named; its canonical name goes on
    the request's log lines and its metrics label."""
    router = current_gateway().router
    if name is not None:
        route = router.route(name)
    else:
        routes = list(router.routes.values())
        if len(routes) != 1:
            raise InvalidRequest("model is required: this gateway serves several models", param="model")
        if not may_use(routes[0].config.name):
            raise ModelNotFound("(default)")
        route = routes[0]
    set_log_context(model=route.config.name)
    return route


@blueprint.post("/tokenize")
@blueprint.post("/v1/tokenize")
@validate_request(TokenizeRequest)
async def tokenize(data: TokenizeRequest) -> Any:
    req = data
    route = model_route(req.model)
    messages = [m.to_wire() for m in req.messages] if req.messages else None
    chat = req.chat_options() if messages is not None else None

    def tokenize_message(rid: str) -> wire.Tokenize:
        return wire.Tokenize(rid, req.prompt, messages, req.add_special_tokens, chat)

    reply = await serve_exchange(route, tokenize_message, ANSWER_TIMEOUT_S)
    return jsonify(
        {"tokens": reply.token_ids, "count": len(reply.token_ids), "max_model_len": route.config.max_seq_len}
    )


@blueprint.post("/detokenize")
@blueprint.post("/v1/detokenize")
@validate_request(DetokenizeRequest)
async def detokenize(data: DetokenizeRequest) -> Any:
    req = data
    route = model_route(req.model)
    reply = await serve_exchange(route, lambda rid: wire.Detokenize(rid, list(req.tokens)), ANSWER_TIMEOUT_S)
    return jsonify({"prompt": reply.text})


@blueprint.get("/tokenizer_info")
@blueprint.get("/v1/tokenizer_info")
async def tokenizer_info() -> Any:
    """vLLM's /tokenizer_info (what lm-eval's remote tokenizer reads): the tokenizer's special
    tokens, class, length limit and chat template. `?model=` picks a model."""
    route = model_route(request.args.get("model"))
    ready = next((r.ready_message for r in route.replicas if r.ready and r.ready_message), None)
    if ready is None or ready.tokenizer is None:
        raise ServiceUnavailable(f"model '{route.config.name}' is not ready yet")
    return jsonify(as_dict(ready.tokenizer))
