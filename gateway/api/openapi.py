"""GET /openapi.json: the HTTP API's OpenAPI 3.1 description, generated from the request schemas.

Runs in the gateway process. Owns no state; the request bodies' JSON Schemas come from the same
pydantic models that validate requests, so the description cannot drift from the code. Fuzzers
(schemathesis in tests/) and client generators read it.
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema
from quart import Blueprint, jsonify

from gateway.schemas import ChatCompletionRequest, CompletionRequest

blueprint = Blueprint("openapi", __name__)

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_ERROR_STATUSES = ("400", "404", "408", "413", "429", "503")


def _responses(ok: str) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": ok, "content": {"application/json": {"schema": {}}}}}
    for status in _ERROR_STATUSES:
        responses[status] = {
            "description": "error",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
    return responses


def _post(schema_name: str, summary: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema_name}"}}},
            },
            "responses": _responses("a completion, or an SSE stream when stream is true"),
        }
    }


def _get(summary: str, parameters: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    operation: dict[str, Any] = {"summary": summary, "responses": _responses(summary)}
    if parameters:
        operation["parameters"] = parameters
    return {"get": operation}


def build_openapi() -> dict[str, Any]:
    from gateway.api.tokenize import DetokenizeRequest, TokenizeRequest

    _, schemas = models_json_schema(
        [
            (ChatCompletionRequest, "validation"),
            (CompletionRequest, "validation"),
            (TokenizeRequest, "validation"),
            (DetokenizeRequest, "validation"),
        ],
        ref_template="#/components/schemas/{model}",
    )
    components = dict(schemas.get("$defs", {}))
    components["Error"] = _ERROR
    model_id = {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "LLM gateway (OpenAI-compatible)", "version": "1"},
        "paths": {
            "/v1/models": _get("list models"),
            "/v1/models/{model_id}": _get("one model", [model_id]),
            "/v1/completions": _post("CompletionRequest", "text completion"),
            "/v1/chat/completions": _post("ChatCompletionRequest", "chat completion"),
            "/tokenize": _post("TokenizeRequest", "token ids of a prompt or of rendered chat messages"),
            "/detokenize": _post("DetokenizeRequest", "text of token ids"),
            "/health/live": _get("liveness"),
            "/health/ready": _get("readiness"),
            "/admin/workers": _get("workers"),
        },
        "components": {"schemas": components},
    }


@blueprint.get("/openapi.json")
async def openapi() -> Any:
    return jsonify(build_openapi())
