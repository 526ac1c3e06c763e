"""POST /tokenize and POST /detokenize (vLLM's shapes), answered by the model's own worker.

Runs in the gateway process. Owns the request/response schemas of the two routes; the tokenizer
and the chat template live in the worker, which answers with a Tokens frame. These take no
generation slot, so they work while a model is saturated.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from quart import Blueprint, jsonify
from quart_schema import validate_request

from gateway.http.current import current_gateway
from gateway.http.schemas import ChatMessage, TokenId
from wire import messages as wire

blueprint = Blueprint("tokenize", __name__)
ANSWER_TIMEOUT_S = 30.0


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(..., min_length=1)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=4096)
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(..., min_length=1)
    tokens: list[TokenId] = Field(..., max_length=1_000_000)


@blueprint.post("/tokenize")
@validate_request(TokenizeRequest)
async def tokenize(data: TokenizeRequest) -> Any:
    req = data
    gateway = current_gateway()
    route = gateway.router.route(req.model)
    messages = [m.to_wire() for m in req.messages] if req.messages else None
    reply = await gateway.service.exchange(
        route, lambda rid: wire.Tokenize(rid, req.prompt, messages, req.add_special_tokens), ANSWER_TIMEOUT_S
    )
    return jsonify(
        {"tokens": reply.token_ids, "count": len(reply.token_ids), "max_model_len": route.config.max_seq_len}
    )


@blueprint.post("/detokenize")
@validate_request(DetokenizeRequest)
async def detokenize(data: DetokenizeRequest) -> Any:
    req = data
    gateway = current_gateway()
    route = gateway.router.route(req.model)
    reply = await gateway.service.exchange(
        route, lambda rid: wire.Detokenize(rid, list(req.tokens)), ANSWER_TIMEOUT_S
    )
    return jsonify({"prompt": reply.text})
