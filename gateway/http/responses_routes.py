"""OpenAI's Responses API: POST /v1/responses, and GET / DELETE /v1/responses/{id} of stored ones.

Runs in the gateway process. Owns the routes: a request (gateway.http.responses_schema) continues
the stored conversation its `previous_response_id` names, runs on the one serving path as a chat
completion (gateway.http.serving_path), and gateway.http.responses_format writes the response
object or its event stream. With `store: true` (or the server's default), the finished response
and the conversation it ends are kept in the response store (gateway.state) before the client gets
the last byte, so it can be fetched or continued at once. A stored response belongs to the API key
that created it: for any other key it is a 404, as a missing one is. While the store cannot answer
(Redis unreachable, a disk error), a request that stores, fetches, continues or deletes a response
is a 503 `store_unavailable` (a stored one is refused before it is generated); others go on. Every
error names this API's fields: one that names the chat request's (a worker's `context_length_exceeded`
names `messages`) is renamed on its way out, before the stream opens or in its error event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from quart import Blueprint, current_app, g, jsonify, request
from quart_schema import validate_request

from gateway.errors import APIError, InvalidRequest, NotFound, ServiceUnavailable
from gateway.http.current import current_gateway
from gateway.http.responses_format import ResponseBuilder
from gateway.http.responses_schema import ResponsesRequest, in_responses_terms
from gateway.http.schemas import ChatMessage
from gateway.http.serving_path import Generation, serve_generation
from gateway.reasoning.plan import plan_reasoning
from gateway.serving.choice_text import TextPlan
from gateway.serving.outputs import ChoiceInput, ChoiceOutput
from gateway.serving.router import ModelRoute
from gateway.state.response_store import ResponseStore, StoredResponse, StoreUnavailable
from wire import trace_context
from wire.params import ChatOptions

logger = logging.getLogger(__name__)
blueprint = Blueprint("responses", __name__)
T = TypeVar("T")


def response_store() -> ResponseStore | None:
    return current_app.extensions["response_store"]  # type: ignore[no-any-return]


def key_owner() -> str:
    """Who owns what this request stores: its API key (by digest; never the key itself)."""
    key = g.get("api_key")
    return key.digest.hex() if key is not None else ""


def _turns(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as a stored conversation keeps them: role and one string of content."""
    return [{"role": wire.role, "content": wire.content} for wire in (m.to_wire() for m in messages)]


@blueprint.post("/v1/responses")
@validate_request(ResponsesRequest)
async def responses(data: ResponsesRequest) -> Any:
    try:
        return await _respond(data)
    except APIError as exc:
        raise in_responses_terms(exc) from None


async def _respond(data: ResponsesRequest) -> Any:
    data.refuse_what_is_not_honoured()
    store = response_store()
    keep = (
        data.store if data.store is not None else current_gateway().registry.server.responses.store_by_default
    )
    if keep and store is None:
        if data.store:
            raise InvalidRequest(
                "this gateway stores no responses (server.responses.backend: none)", param="store"
            )
        keep = False
    if keep:
        assert store is not None
        await _ask(store.check(), "store a response")
    earlier: list[ChatMessage] = []
    if data.previous_response_id is not None:
        previous = (
            await _ask(store.get(data.previous_response_id, key_owner()), "continue a response")
            if store is not None
            else None
        )
        if previous is None:
            message = f"Previous response with id '{data.previous_response_id}' not found."
            raise InvalidRequest(message, param="previous_response_id", code="previous_response_not_found")
        earlier = [ChatMessage(role=m["role"], content=m["content"]) for m in previous.conversation]
    chat = data.as_chat(earlier)
    conversation = _turns([*earlier, *data.input_messages()])
    owner = key_owner()

    async def plan_for(route: ModelRoute, model: str) -> Generation:
        params = chat.sampling_params(route.config, None)
        params, reasoning = plan_reasoning(
            route.config, {}, data.thinking_token_budget, "thinking_token_budget", params
        )
        inputs = [ChoiceInput(messages=[m.to_wire() for m in chat.messages], chat=ChatOptions())]
        builder = ResponseBuilder(model, data.echoed_settings(keep), reasoning=reasoning is not None)
        if keep:
            assert store is not None

            async def keep_response(response: dict[str, Any], output: ChoiceOutput) -> None:
                turns = [*conversation, {"role": "assistant", "content": output.text}]
                record = StoredResponse(response["id"], owner, time.time(), response, turns)
                await _ask(store.put(record), "store a response")

            builder.keep = keep_response
        return Generation(inputs, params, builder, TextPlan(reasoning=reasoning))

    return await serve_generation(data.model, plan_for, data.stream, data.timeout, trace_context.CHAT)


async def _ask(call: Awaitable[T], what: str) -> T:
    """The store's answer; a 503 in the API's error shape (and a log line) when it cannot answer."""
    try:
        return await call
    except StoreUnavailable as exc:
        logger.warning("could not %s: the response store is unavailable (%s)", what, exc)
        raise ServiceUnavailable(
            f"could not {what}: the response store is unavailable", code="store_unavailable"
        ) from None


def _refuse_query() -> None:
    """GET and DELETE take no query parameters here (OpenAI's `include`, `stream`, `starting_after`
    replay or extend a response): a 400 naming the first, not a response that ignores it."""
    for name in request.args:
        raise InvalidRequest(f"query parameter {name} is not supported", param=name)


async def _stored(response_id: str) -> StoredResponse:
    store = response_store()
    record = (
        await _ask(store.get(response_id, key_owner()), "fetch a response") if store is not None else None
    )
    if record is None:
        raise NotFound(f"Response with id '{response_id}' not found.")
    return record


@blueprint.get("/v1/responses/<response_id>")
async def get_response(response_id: str) -> Any:
    """A stored response, as it was returned (only to the API key that created it)."""
    _refuse_query()
    return jsonify((await _stored(response_id)).response)


@blueprint.delete("/v1/responses/<response_id>")
async def delete_response(response_id: str) -> Any:
    """Forget a stored response; later requests cannot continue it."""
    _refuse_query()
    store = response_store()
    if store is None or not await _ask(store.delete(response_id, key_owner()), "delete a response"):
        raise NotFound(f"Response with id '{response_id}' not found.")
    return jsonify({"id": response_id, "object": "response", "deleted": True})
