"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Runs in the gateway process. Owns the HTTP side of a generation: turning a validated request
(quart-schema validates bodies with the pydantic models of gateway.http.schemas) into choice
inputs, handing them to a RequestOwner, and writing its outputs as one JSON body or an SSE stream.
Errors before the stream opens are proper HTTP errors; after it opened they are an SSE `error`
event followed by the end of the stream. The owner does all cancelling and slot bookkeeping.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from quart import Blueprint, Response, jsonify
from quart_schema import document_response, validate_request

from gateway.errors import APIError, InvalidRequest
from gateway.http.auth import may_use
from gateway.http.current import current_gateway
from gateway.http.openai_format import SSE_DONE, SSE_KEEPALIVE, ResponseFormatter, sse_error
from gateway.http.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from gateway.observability.logging_setup import set_log_context
from gateway.observability.metrics import start_request
from gateway.serving.outputs import ChoiceInput
from gateway.serving.request_owner import KEEPALIVE, RequestOwner
from gateway.serving.router import ModelRoute
from gateway.tools.plan import ToolPlan, plan_tools
from wire import messages as wire

blueprint = Blueprint("openai", __name__)


@blueprint.get("/v1/models")
@document_response(ModelList)
async def list_models() -> Any:
    gateway = current_gateway()
    names = [name for name in gateway.router.routes if may_use(name)]  # only what this API key may use
    return jsonify({"object": "list", "data": [gateway.model_card(name) for name in names]})


@blueprint.get("/v1/models/<path:model_id>")
@document_response(ModelCard)
async def get_model(model_id: str) -> Any:
    gateway = current_gateway()
    return jsonify(gateway.model_card(gateway.router.route(model_id).config.name))


@blueprint.post("/v1/chat/completions")
@validate_request(ChatCompletionRequest)
async def chat_completions(data: ChatCompletionRequest) -> Any:
    route = generation_route(data.model)
    tools, tool_choice = data.tool_definitions()
    plan = plan_tools(tools, tool_choice, data.parallel_tool_calls, route.config.name,
                      route.config.tool_call_parser)  # fmt: skip
    options = data.chat_options(plan.tools if plan.active else [])
    messages = [m.to_wire() for m in data.messages]
    check_generation_count(route, 1, data.n)
    inputs = [ChoiceInput(messages=messages, chat=options)] * data.n
    formatter = ResponseFormatter(
        "chatcmpl-" + uuid.uuid4().hex, data.model, chat=True, tools=plan,
        prompt_logprobs=data.prompt_logprobs is not None, continuous_usage=data.continuous_usage(),
    )  # fmt: skip
    return await _serve(data, route, inputs, formatter, data.logprobs_count(), plan)


@blueprint.post("/v1/completions")
@validate_request(CompletionRequest)
async def completions(data: CompletionRequest) -> Any:
    if data.suffix:
        raise InvalidRequest("suffix is not supported", param="suffix")
    route = generation_route(data.model)
    prompts = data.prompts()
    check_generation_count(route, len(prompts), data.n)
    inputs = []
    for prompt_index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            choice = ChoiceInput(prompt=prompt, echo=prompt if data.echo else "", prompt_index=prompt_index)
        else:
            echo = await _prompt_text(route, prompt) if data.echo else ""
            choice = ChoiceInput(prompt_token_ids=prompt, echo=echo, prompt_index=prompt_index)
        inputs.extend([choice] * data.n)
    formatter = ResponseFormatter(
        "cmpl-" + uuid.uuid4().hex, data.model, chat=False,
        echo_logprobs=data.echo and data.logprobs is not None,
        prompt_logprobs=data.prompt_logprobs is not None, continuous_usage=data.continuous_usage(),
    )  # fmt: skip
    return await _serve(data, route, inputs, formatter, data.logprobs, None)


def generation_route(model: str) -> ModelRoute:
    route = current_gateway().router.route(model)
    if route.config.task == "embed":
        raise InvalidRequest(
            f"model '{route.config.name}' is an embedding model; use /v1/embeddings", param="model"
        )
    return route


def check_generation_count(route: ModelRoute, prompts: int, n: int) -> None:
    """A request's jobs (prompts x n) are admitted together, so they must fit what one replica runs
    at once (`max_concurrent_jobs`); more could never start."""
    limit = route.config.limits.max_concurrent_jobs
    if prompts * n > limit:
        raise InvalidRequest(
            f"this request asks for {prompts * n} generations ({prompts} prompt(s) x n={n}); model "
            f"'{route.config.name}' runs at most {limit} at once (max_concurrent_jobs); "
            "send fewer prompts per request or a smaller n",
            param="n" if prompts == 1 else "prompt",
        )


async def _prompt_text(route: ModelRoute, token_ids: list[int]) -> str:
    """The text of a token-id prompt, for echo: decoded by the model's own tokenizer."""
    reply = await current_gateway().service.exchange(
        route, lambda rid: wire.Detokenize(rid, list(token_ids)), timeout_s=30.0
    )
    return reply.text


async def _serve(
    req: Any,
    route: ModelRoute,
    inputs: list[ChoiceInput],
    formatter: ResponseFormatter,
    logprobs: int | None,
    tools: ToolPlan | None,
) -> Any:
    gateway = current_gateway()
    set_log_context(model=route.config.name)  # the canonical name, on every line of this request
    schema = tools.constraint_schema() if tools is not None else None
    params = req.sampling_params(route.config, logprobs, schema)
    deadline = gateway.router.deadline_for(route, req.timeout)
    recorder = start_request(route.config.name)
    owner = gateway.service.open(route, inputs, params, deadline, recorder, streaming=req.stream)
    await owner.admit()  # refusals (400, 429, 503, 408) surface here, before any stream opens
    if req.stream:
        body = _stream(owner, formatter, req.include_usage_in_stream())
        response = Response(body, content_type="text/event-stream; charset=utf-8")
        response.headers["Cache-Control"] = "no-cache"
        response.headers["X-Accel-Buffering"] = "no"
        response.timeout = None  # long generations must not be cut by Quart's response timeout
        return response
    try:
        async for _ in owner.events():
            pass
        return jsonify(formatter.final_body(owner.choices))
    finally:
        owner.close()


async def _stream(
    owner: RequestOwner, formatter: ResponseFormatter, with_usage: bool
) -> AsyncIterator[bytes]:
    try:
        for chunk in formatter.first_chunks([c.index for c in owner.choices], with_usage):
            yield chunk
        # One write per batch: what is already queued for this stream goes out together, so a
        # stream that fell behind (or an n > 1 request, whose choices share a step) costs one
        # socket send instead of one per token.
        async for batch in owner.event_batches():
            chunks = []
            for event in batch:
                if event is KEEPALIVE:
                    chunks.append(SSE_KEEPALIVE)
                    continue
                index, output = event  # type: ignore[misc]
                chunks.append(formatter.delta_chunk(owner.choices[index], output, with_usage, owner.outputs))
            body = b"".join(chunks)
            if body:
                yield body
        yield (formatter.usage_chunk(owner.outputs) if with_usage else b"") + SSE_DONE
    except APIError as exc:
        yield sse_error(exc.body())
        yield SSE_DONE
    finally:
        # Runs on normal end, on error, and on client disconnect (CancelledError). If the client
        # left before this body ever started, the owner closes when the request task ends.
        owner.close()
