"""POST /v1/embeddings: vectors from models declared `task: embed` in the registry.

Runs in the gateway process. Owns the OpenAI embeddings request and response shapes (float lists,
or base64 of little-endian float32, which the openai SDK asks for by default). The worker pools
and normalizes as the model's sentence-transformers files say, and batches every input it holds.
A chat model answers 400 here, as an embedding model does on the chat and completions routes.
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from quart import Blueprint, jsonify, request
from quart_schema import validate_request

from gateway.errors import InvalidRequest, as_api_error
from gateway.http.current import current_gateway
from gateway.http.schemas import PromptCutRequest, TokenId, prompt_cut
from gateway.http.serving_path import serve_exchange
from gateway.observability import tracing
from gateway.observability.logging_setup import set_log_context
from gateway.observability.metrics import start_request
from wire import messages as wire
from wire import trace_context

blueprint = Blueprint("embeddings", __name__)
MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    # Strict: a value of the wrong JSON type ("dimensions": "64", token ids sent as true or 1.0) is a
    # 400 naming the field, never coerced into an input the client did not send.
    model_config = ConfigDict(extra="allow", strict=True)
    model: str = Field(..., min_length=1)
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(
        None, ge=1, lt=2**31, description="Refused unless it is the model's own size."
    )
    user: str | None = None
    timeout: float | None = Field(None, gt=0, description="Per-request deadline in seconds (extension).")
    truncate_prompt_tokens: PromptCutRequest = None

    @field_validator("input", mode="before")
    @classmethod
    def _one_kind(cls, value: Any) -> Any:
        """A list holds one kind of input. A mix (a string beside token ids) or an item of no kind
        is refused naming that item, not reported against whichever union shape pydantic tried."""
        if not isinstance(value, list) or not value:
            return value
        first = _input_kind(value[0])
        for index, item in enumerate(value):
            kind = _input_kind(item)
            if kind is None:
                raise InvalidRequest(
                    f"input.{index} must be a string, a token id or a list of token ids",
                    param=f"input.{index}",
                )
            if kind != first:
                raise InvalidRequest(
                    f"input.{index}: the inputs of one request are all {first}", param=f"input.{index}"
                )
        return value

    def inputs(self) -> tuple[list[str] | None, list[list[int]] | None]:
        """The texts, or the token-id lists, to embed: one of the two is None."""
        value = self.input
        # OpenAI refuses an empty input: an empty string's vector would be the special tokens' alone.
        if isinstance(value, str):
            if not value:
                raise InvalidRequest("input is empty: there is nothing to embed", param="input")
            return [value], None
        if not value:
            raise InvalidRequest("input must not be empty", param="input")
        if isinstance(value[0], int):  # one input as token ids (_one_kind made them all ids)
            return None, [list(value)]
        if len(value) > MAX_INPUTS:  # inputs, not the tokens of one: those the model's length bounds
            raise InvalidRequest(f"at most {MAX_INPUTS} inputs", param="input")
        for index, item in enumerate(value):
            if not item:
                raise InvalidRequest(
                    f"input.{index} is empty: there is nothing to embed", param=f"input.{index}"
                )
        if isinstance(value[0], str):
            return list(value), None
        return None, [list(v) for v in value]


def _input_kind(item: object) -> str | None:
    """What one item of a list `input` is: "strings", "token ids" or "lists of token ids"."""
    if isinstance(item, str):
        return "strings"
    if type(item) is int:  # never a bool: true is not token 1
        return "token ids"
    if isinstance(item, list) and all(type(t) is int for t in item):
        return "lists of token ids"
    return None


def _encode(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


@blueprint.post("/v1/embeddings")
@validate_request(EmbeddingRequest)
async def embeddings(data: EmbeddingRequest) -> Any:
    gateway = current_gateway()
    route = gateway.router.route(data.model)
    set_log_context(model=route.config.name)
    if route.config.task != "embed":
        raise InvalidRequest(
            f"model '{route.config.name}' is not an embedding model (registry task: embed)", param="model"
        )
    cut = prompt_cut(data.truncate_prompt_tokens, route.config.max_seq_len)
    texts, token_ids = data.inputs()
    sizes = [len(t) // 4 for t in texts or []] + [len(ids) for ids in token_ids or []]
    size = sum(sizes if cut is None else (min(s, cut) for s in sizes))
    recorder = start_request(route.config.name)  # an error is counted with its status after the route
    span = None
    if tracing.ENABLED:
        span = tracing.start_request_span(
            trace_context.EMBEDDINGS, data.model, route.config.name, None, request.headers, False,
            **{"gen_ai.request.encoding_formats": [data.encoding_format]},
        )  # fmt: skip
    traceparent = span.traceparent if span is not None else None
    try:
        # Through its owner like a generation: a drain, a reload or a shutdown sees it.
        reply = await serve_exchange(
            route,
            lambda rid: wire.Embed(rid, texts, token_ids, traceparent, cut),
            data.timeout,
            slot_work=size,
        )
        width = len(reply.vectors[0]) if reply.vectors else 0
        if data.dimensions is not None and data.dimensions != width:
            raise InvalidRequest(
                f"dimensions must be this model's {width} (no truncation)", param="dimensions"
            )
    except BaseException as exc:
        if span is not None:
            error = as_api_error(exc)
            span.end(error.status, [], 0, None, None, error)
        raise
    if span is not None:
        span.end(200, [], reply.prompt_tokens, None, None, None)
    recorder.finish(200, reply.prompt_tokens)
    return jsonify(
        {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": _encode(vector, data.encoding_format)}
                for i, vector in enumerate(reply.vectors)
            ],
            "model": data.model,
            "usage": {"prompt_tokens": reply.prompt_tokens, "total_tokens": reply.prompt_tokens},
        }
    )
