"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Runs in the gateway process. Owns request parsing (via gateway.schemas), fan-out of n choices and
multiple prompts into jobs, and the SSE stream. Errors before the stream opens are proper HTTP
errors; after it opened they are an SSE `error` event followed by the end of the stream.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from quart import Blueprint, Response, jsonify, request

from gateway.api.openai_format import SSE_DONE, SSE_KEEPALIVE, ChoiceState, ResponseFormatter, sse_error
from gateway.auth import may_use
from gateway.errors import APIError, InvalidRequest
from gateway.generation import ActiveJob
from gateway.logging_setup import set_log_context
from gateway.metrics import CLIENT_CLOSED, RequestRecorder, start_request
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.state import Gateway, current_gateway
from model_worker.protocol import JobOutput

logger = logging.getLogger(__name__)
blueprint = Blueprint("openai", __name__)


async def parse_body(schema: type[BaseModel]) -> Any:
    body = await request.get_json(force=True, silent=True)
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        parsed = schema.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise InvalidRequest(f"{param}: {first['msg']}" if param else first["msg"], param=param) from None
    if parsed.model_extra:
        logger.debug("ignored unknown fields: %s", sorted(parsed.model_extra))
    return parsed


@blueprint.get("/v1/models")
async def list_models() -> Any:
    gateway = current_gateway()
    names = [name for name in gateway.router.routes if may_use(name)]  # only what this API key may use
    return jsonify({"object": "list", "data": [gateway.model_card(name) for name in names]})


@blueprint.get("/v1/models/<path:model_id>")
async def get_model(model_id: str) -> Any:
    gateway = current_gateway()
    return jsonify(gateway.model_card(gateway.router.route(model_id).config.name))


@blueprint.post("/v1/chat/completions")
async def chat_completions() -> Any:
    req: ChatCompletionRequest = await parse_body(ChatCompletionRequest)
    messages = [m.to_wire() for m in req.messages]
    inputs = [{"messages": messages}] * req.n
    return await _serve(req, inputs, chat=True, logprobs=req.logprobs_count(), echoes=[])


@blueprint.post("/v1/completions")
async def completions() -> Any:
    req: CompletionRequest = await parse_body(CompletionRequest)
    if req.suffix:
        raise InvalidRequest("suffix is not supported", param="suffix")
    inputs: list[dict[str, Any]] = []
    echoes: list[str] = []
    for prompt in req.prompts():
        key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
        for _ in range(req.n):
            inputs.append({key: prompt})
            echoes.append(prompt if req.echo and isinstance(prompt, str) else "")
    if req.echo and any(not isinstance(p, str) for p in req.prompts()):
        raise InvalidRequest("echo is supported for text prompts only", param="echo")
    return await _serve(req, inputs, chat=False, logprobs=req.logprobs, echoes=echoes)


async def _serve(
    req: Any, inputs: list[dict[str, Any]], chat: bool, logprobs: int | None, echoes: list[str]
) -> Any:
    gateway = current_gateway()
    route = gateway.router.route(req.model)
    set_log_context(model=route.config.name)  # the canonical name, on every line of this request
    params = req.sampling_params(route.config, logprobs)
    deadline = gateway.router.deadline_for(route, req.timeout)
    prefix = "chatcmpl-" if chat else "cmpl-"
    formatter = ResponseFormatter(prefix + uuid.uuid4().hex, req.model, chat)
    recorder = start_request(route.config.name)
    jobs: list[ActiveJob] = []
    gateway.service.in_flight += 1
    try:
        for index, fields in enumerate(inputs):
            seeded = params
            if params.seed is not None and index:
                # Distinct choices of one request must not be identical copies.
                seeded = type(params)(**{**params.to_wire(), "seed": params.seed + index})
            jobs.append(await gateway.service.submit(route, seeded, deadline, **fields))
    except BaseException as exc:
        gateway.service.in_flight -= 1
        recorder.fail(exc)
        await asyncio.gather(*(job.close() for job in jobs))
        raise
    if req.stream:
        release = gateway.service.track_release(jobs)
        body = _stream(gateway, jobs, formatter, req.include_usage_in_stream(), echoes, recorder, release)
        response = Response(body, content_type="text/event-stream; charset=utf-8")
        response.headers["Cache-Control"] = "no-cache"
        response.headers["X-Accel-Buffering"] = "no"
        response.timeout = None  # long generations must not be cut by Quart's response timeout
        return response
    states = [ChoiceState(i, job.prompt_tokens) for i, job in enumerate(jobs)]
    try:
        async for index, item in _merged(jobs, keepalive=False):
            states[index].add(item)
            recorder.output(item)
        recorder.finish(200, states)
        return jsonify(formatter.final_body(states, echoes))
    except BaseException as exc:
        recorder.fail(exc, states)
        raise
    finally:
        gateway.service.in_flight -= 1
        await asyncio.gather(*(job.close() for job in jobs))


async def _stream(
    gateway: Gateway,
    jobs: list[ActiveJob],
    formatter: ResponseFormatter,
    with_usage: bool,
    echoes: list[str],
    recorder: RequestRecorder,
    release: Callable[[], Awaitable[None]],
) -> AsyncIterator[bytes]:
    states = [ChoiceState(i, job.prompt_tokens) for i, job in enumerate(jobs)]
    echo_pending = list(echoes)
    try:
        for chunk in formatter.first_chunks([s.index for s in states], with_usage):
            yield chunk
        async for index, item in _merged(jobs, keepalive=True):
            if item is SSE_KEEPALIVE:
                yield SSE_KEEPALIVE
                continue
            state = states[index]
            state.add(item)
            recorder.output(item)
            echo = echo_pending[index] if echo_pending else ""
            if echo:
                echo_pending[index] = ""
            if item.text or item.finish_reason or item.logprobs or echo:
                yield formatter.delta_chunk(state, item, with_usage, echo)
        if with_usage:
            yield formatter.usage_chunk(states)
        recorder.finish(200, states)
        yield SSE_DONE
    except APIError as exc:
        logger.info("stream ended with error %s: %s", exc.code, exc.message)
        recorder.fail(exc, states)
        yield sse_error(exc.body())
        yield SSE_DONE
    finally:
        # Runs on normal end, on error, and on client disconnect (CancelledError): cancels
        # every job that has not finished, so no zombie job keeps cache pages. (If the client
        # left before this body ever started, the request task's done-callback releases instead.)
        recorder.finish(CLIENT_CLOSED, states)  # still open here: the client went away
        await release()


async def _merged(jobs: list[ActiveJob], keepalive: bool) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, JobOutput or SSE_KEEPALIVE) from every job, in arrival order."""
    if len(jobs) == 1:
        async for item in jobs[0].outputs(keepalive):
            yield 0, item if isinstance(item, JobOutput) else SSE_KEEPALIVE
        return
    # Bounded, so a client that stops reading stops the pumps too: the per-job queues then grow
    # and the write-stall watchdog sees it, as it does for a single choice.
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(maxsize=64)

    async def pump(index: int, job: ActiveJob) -> None:
        try:
            async for item in job.outputs(keepalive):
                await queue.put((index, item if isinstance(item, JobOutput) else SSE_KEEPALIVE))
        except APIError as exc:
            await queue.put((index, exc))
        await queue.put((index, None))

    pumps = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        remaining = len(jobs)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, APIError):
                raise item
            else:
                yield index, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
