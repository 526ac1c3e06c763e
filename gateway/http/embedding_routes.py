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

from pydantic import BaseModel, ConfigDict, Field
from quart import Blueprint, jsonify, request
from quart_schema import validate_request

from gateway.errors import InvalidRequest, as_api_error
from gateway.http.current import current_gateway
from gateway.http.schemas import TokenId
from gateway.http.serving_path import serve_exchange
from gateway.observability import tracing
from gateway.observability.logging_setup import set_log_context
from gateway.observability.metrics import start_request
from wire import messages as wire
from wire import trace_context

blueprint = Blueprint("embeddings", __name__)
MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(..., min_length=1)
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(
        None, ge=1, lt=2**31, description="Refused unless it is the model's own size."
    )
    user: str | None = None
    timeout: float | None = Field(None, gt=0, description="Per-request deadline in seconds (extension).")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, lt=2**31, description="Refused (vLLM): inputs are never cut."
    )

    def inputs(self) -> tuple[list[str] | None, list[list[int]] | None]:
        value = self.input
        if isinstance(value, str):
            return [value], None
        if not value:
            raise InvalidRequest("input must not be empty", param="input")
        if len(value) > MAX_INPUTS:
            raise InvalidRequest(f"at most {MAX_INPUTS} inputs", param="input")
        if all(isinstance(v, str) for v in value):
            return list(value), None  # type: ignore[arg-type]
        if all(isinstance(v, int) for v in value):
            return None, [list(value)]  # type: ignore[arg-type]
        return None, [list(v) for v in value]  # type: ignore[arg-type]


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
    if data.truncate_prompt_tokens is not None:
        raise InvalidRequest("truncate_prompt_tokens is not supported", param="truncate_prompt_tokens")
    texts, token_ids = data.inputs()
    size = sum(len(t) // 4 for t in texts or []) + sum(len(ids) for ids in token_ids or [])
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
            route, lambda rid: wire.Embed(rid, texts, token_ids, traceparent), data.timeout, slot_work=size
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
