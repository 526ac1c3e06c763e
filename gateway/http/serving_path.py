"""The one serving path every API surface uses; each surface only formats.

Runs in the gateway process, inside Quart request handling. Owns what happens between a validated
request and its last byte, once for every surface (chat, completions, Responses, Messages,
embeddings, tokenize): opening the request's owner (so a drain, a reload or a shutdown sees it),
admission (refusals are HTTP errors before any stream opens), then either one JSON body or an SSE
stream that writes what is already queued as one chunk, keep-alives on a quiet stream, an error
event when the request ends early after the stream opened, and the owner's close on every path,
a client's disconnect included; and fallbacks: a model whose queue is full or which has no ready
worker hands the request to the first of its registry `fallbacks` that can take it (one that would
refuse it, a shorter context say, is passed over), and the response names the model that answered.
A surface brings a `Formatter` (its JSON and event shapes) and the choice inputs and sampling
parameters for the model that will answer, built for that model (its defaults, tool and reasoning
parsers), so a fallback gets its own.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from quart import Response, jsonify, request

from gateway.errors import APIError, InvalidRequest
from gateway.http.auth import may_use
from gateway.http.current import current_gateway
from gateway.observability import tracing
from gateway.observability.logging_setup import set_log_context
from gateway.observability.metrics import count_fallback, start_request
from gateway.serving.choice_text import TextPlan
from gateway.serving.exchange_owner import OneShot
from gateway.serving.output_queue import KEEPALIVE
from gateway.serving.outputs import ChoiceInput, Delta
from gateway.serving.request_owner import RequestOwner
from gateway.serving.router import ModelRoute
from wire.params import SamplingParams

logger = logging.getLogger(__name__)
SSE_KEEPALIVE = b": keepalive\n\n"


class Formatter:
    """One API surface's shapes for one request. Subclasses override what their surface sends;
    a method's default here is what a surface without that part sends (nothing)."""

    keepalive = SSE_KEEPALIVE

    def opening(self, owner: RequestOwner) -> bytes:
        """What a stream starts with, once every choice was admitted."""
        return b""

    def chunk(self, owner: RequestOwner, index: int, delta: Delta) -> bytes:
        """The events for one Delta of choice `index` (empty when there is nothing to send yet)."""
        return b""

    def finishing(self, owner: RequestOwner) -> Callable[[], Awaitable[None]] | None:
        """Every choice finished normally (streamed or not): what to await before `closing` or
        `body` (storing the response), or None when there is nothing."""
        return None

    def closing(self, owner: RequestOwner) -> bytes:
        """What a stream ends with after every choice finished."""
        return b""

    def stream_error(self, error: APIError) -> bytes:
        """The events that end a stream which started before the request failed."""
        raise NotImplementedError

    def body(self, owner: RequestOwner) -> dict[str, Any]:
        """The JSON body of a request that is not streamed."""
        raise NotImplementedError


@dataclass
class Generation:
    """What a surface asks of the model that answers: built for that model's route."""

    inputs: list[ChoiceInput]
    params: SamplingParams
    formatter: Formatter
    text_plan: TextPlan | None = None  # what the gateway itself watches for in the text
    # Work on the model that answers, once its jobs are admitted: by then it is the model that
    # answers (a fallback, perhaps) and it has a ready worker (a token-id prompt's text for echo).
    after_admission: Callable[[RequestOwner], Awaitable[None]] | None = None


# (the route that will answer, the model name the response shows) -> the generation for it
PlanFor = Callable[[ModelRoute, str], Awaitable[Generation]]


def generation_route(model: str) -> ModelRoute:
    route = current_gateway().router.route(model)
    if route.config.task == "embed":
        raise InvalidRequest(
            f"model '{route.config.name}' is an embedding model; use /v1/embeddings", param="model"
        )
    return route


async def serve_generation(
    model: str, plan_for: PlanFor, stream: bool, timeout: float | None, operation: str
) -> Any:
    """Admit the request on `model` (or on one of its fallbacks) and answer it: one JSON body, or an
    SSE stream. `operation` is the GenAI operation the surface performs (chat, text_completion): the
    name of the request's trace span, when tracing is on."""
    gateway = current_gateway()
    route = generation_route(model)
    generation = await plan_for(route, model)
    route, generation = await _fallback_if_needed(route, generation, plan_for)
    set_log_context(model=route.config.name)  # the canonical name, on every line of this request
    deadline = gateway.router.deadline_for(route, timeout)
    recorder = start_request(route.config.name)
    span = None
    if tracing.ENABLED:  # the one check a request makes while tracing is off
        span = tracing.start_request_span(
            operation, model, route.config.name, generation.params, request.headers, stream
        )
    try:
        owner = gateway.service.open(route, generation.inputs, generation.params, deadline, recorder, stream,
                                     generation.text_plan, span)  # fmt: skip
    except APIError as exc:  # draining: the owner that would have ended the span never existed
        if span is not None:
            span.end(exc.status, [], 0, 0, None, exc)
        raise
    await owner.admit()  # refusals (400, 429, 503, 408) surface here, before any stream opens
    if generation.after_admission is not None:
        try:
            await generation.after_admission(owner)
        except BaseException as exc:
            if isinstance(exc, APIError):
                owner.abort(exc)  # its jobs are cancelled, and the request is logged with this error
            owner.close()  # else the client left meanwhile (a cancel): its jobs are cancelled, a 499
            raise
    formatter = generation.formatter
    if stream:
        return event_stream(_stream(owner, formatter))
    try:
        async for _ in owner.events():
            pass
        finish = formatter.finishing(owner)
        if finish is not None:
            await finish()
        return jsonify(formatter.body(owner))
    finally:
        owner.close()


async def _fallback_if_needed(
    primary: ModelRoute, generation: Generation, plan_for: PlanFor
) -> tuple[ModelRoute, Generation]:
    """The route that serves the request: `primary`, unless its queue is full or none of its workers
    is ready and one of its `fallbacks` (that this key may use) would take the request now. The
    check and the admission that follows share one turn of the event loop, so nothing changes
    between them. When no fallback can take it, the primary's own rules apply (wait, or refuse)."""
    if not primary.config.fallbacks:
        return primary, generation
    size = sum(choice.size_estimate(generation.params.truncate_prompt_tokens) for choice in generation.inputs)
    reason = primary.fallback_reason(len(generation.inputs), size)
    if reason is None:
        return primary, generation
    router = current_gateway().router
    for name in primary.config.fallbacks:
        try:
            route = router.route(name)
        except APIError:
            continue  # removed by a reload since the registry was checked
        if route.config.task != "generate" or not may_use(route.config.name):
            continue
        try:
            candidate = await plan_for(route, route.config.name)  # the response names who answered
        except InvalidRequest as exc:
            # The request is valid for its own model, but this fallback cannot take it (a shorter
            # context, fewer slots, no tool or reasoning parser): its 400 would tell the client the
            # request itself is wrong, and that it is no use retrying.
            logger.debug("model %s cannot take a request for %s: %s", route.config.name,
                         primary.config.name, exc.message)  # fmt: skip
            continue
        if route.fallback_reason(len(candidate.inputs), size) is None:
            logger.info(
                "model %s: %s; model %s answers instead", primary.config.name, reason, route.config.name
            )
            count_fallback(primary.config.name, route.config.name, reason)
            return route, candidate
    return primary, generation


def event_stream(body: AsyncIterator[bytes]) -> Response:
    response = Response(body, content_type="text/event-stream; charset=utf-8")
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"
    response.timeout = None  # long generations must not be cut by Quart's response timeout
    return response


async def _stream(owner: RequestOwner, formatter: Formatter) -> AsyncIterator[bytes]:
    body = b""  # what is taken but not yet written
    try:
        opening = formatter.opening(owner)
        if opening:
            yield opening
        # One write per batch: what is already queued for this stream goes out together, so a
        # stream that fell behind (or an n > 1 request, whose choices share a step) costs one
        # socket send instead of one per token. The queue is read here directly, not through
        # owner.event_batches(): one async generator less for every token.
        queue, chunk, keepalive = owner.queue, formatter.chunk, formatter.keepalive
        while True:
            if queue.empty():
                await queue.arrival()
            batch, end = owner.take_queued()
            if batch:
                chunks = []
                for event in batch:
                    if event is KEEPALIVE:
                        chunks.append(keepalive)
                        continue
                    index, delta = event  # type: ignore[misc]
                    chunks.append(chunk(owner, index, delta))
                body = b"".join(chunks)
            if end is not None:
                if end.error is not None:
                    raise end.error
                break
            if body:
                yield body
                body = b""
        # The last outputs go out with the stream's end (or its error event) in one write: the
        # request's last chunk then costs one pass through Quart, Hypercorn and h11 and one
        # send(2), not two. The bytes are the same.
        finish = formatter.finishing(owner)
        if finish is not None:  # the last outputs must not wait for it (a store's round trip)
            if body:
                yield body
                body = b""
            await finish()
        yield body + formatter.closing(owner)
    except APIError as exc:
        yield body + formatter.stream_error(exc)
    finally:
        # Runs on normal end, on error, and on client disconnect (CancelledError). If the client
        # left before this body ever started, the owner closes when the request task ends.
        owner.close()


async def serve_exchange(
    route: ModelRoute, build: Callable[[str], OneShot], timeout_s: float | None, slot_work: int | None = None
) -> Any:
    """A one-shot worker request (tokenize, detokenize, embed) through its owner; its answer."""
    gateway = current_gateway()
    deadline = gateway.router.deadline_for(route, timeout_s)
    return await gateway.service.open_exchange(route, deadline).run(build, slot_work)
