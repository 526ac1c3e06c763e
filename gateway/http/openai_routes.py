"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Runs in the gateway process. Owns turning a validated request (quart-schema validates bodies with
the pydantic models of gateway.http.schemas) into choice inputs, sampling parameters and a
formatter for the model that answers; gateway.http.serving_path does the rest (admission, the
body or the stream, every early end). A worker names what it refuses by the wire's fields (`regex`,
`response_format` for any constraint, `tokens`); those refusals leave here naming the field the
client sent instead.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from quart import Blueprint, jsonify
from quart_schema import document_response, validate_request

from gateway.errors import APIError, InvalidRequest
from gateway.http.auth import may_use
from gateway.http.current import current_gateway
from gateway.http.openai_format import ResponseFormatter
from gateway.http.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from gateway.http.serving_path import Generation, serve_exchange, serve_generation
from gateway.reasoning.plan import plan_reasoning
from gateway.serving.choice_text import TextPlan
from gateway.serving.outputs import ChoiceInput
from gateway.serving.request_owner import RequestOwner
from gateway.serving.router import ModelRoute
from gateway.tools.plan import plan_tools
from wire import messages as wire
from wire import trace_context

blueprint = Blueprint("openai", __name__)
ANSWER_TIMEOUT_S = 30.0


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
    tool_constraint = False

    async def plan_for(route: ModelRoute, model: str) -> Generation:
        nonlocal tool_constraint
        tools, tool_choice = data.tool_definitions()
        legacy = data.functions is not None  # one function call at most, answered as function_call
        parallel = False if legacy else data.parallel_tool_calls
        plan = plan_tools(tools, tool_choice, parallel, route.config.name, route.config.tool_call_parser)
        tool_constraint = plan.constrained
        options = data.chat_options(plan.tools if plan.active else [])
        messages = [m.to_wire() for m in data.messages]
        check_generation_count(route, 1, data.n)
        params = data.sampling_params(route.config, data.logprobs_count(), plan.constraint_schema())
        plan.check_output_constraint(params.json_object or params.json_schema is not None,
                                     data.constraint_field(False))  # fmt: skip
        params, reasoning = plan_reasoning(route.config, options.template_kwargs, data.thinking_token_budget,
                                           "thinking_token_budget", params)  # fmt: skip
        formatter = ResponseFormatter(
            "chatcmpl-" + uuid.uuid4().hex, model, chat=True, tools=plan,
            prompt_logprobs=data.prompt_logprobs is not None, with_usage=data.include_usage_in_stream(),
            continuous_usage=data.continuous_usage(), reasoning=reasoning is not None,
            legacy_functions=legacy,
        )  # fmt: skip
        inputs = [ChoiceInput(messages=messages, chat=options)] * data.n
        return Generation(inputs, params, formatter, TextPlan(reasoning=reasoning))

    serving = serve_generation(data.model, plan_for, data.stream, data.timeout, trace_context.CHAT)
    return await _naming_sent_fields(
        serving, lambda: _constraint_names(data.constraint_field(tool_constraint))
    )


@blueprint.post("/v1/completions")
@validate_request(CompletionRequest)
async def completions(data: CompletionRequest) -> Any:
    if data.suffix:
        raise InvalidRequest("suffix is not supported", param="suffix")
    if data.echo and data.truncate_prompt_tokens is not None:
        # The echo would be the whole prompt, its logprobs and usage those of the part the model saw.
        message = "truncate_prompt_tokens cannot be combined with echo"
        raise InvalidRequest(message, param="truncate_prompt_tokens")

    async def plan_for(route: ModelRoute, model: str) -> Generation:
        prompts = data.prompts()
        check_generation_count(route, len(prompts), data.n)
        params = data.sampling_params(route.config, data.logprobs)
        inputs = []
        for prompt_index, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                choice = ChoiceInput(
                    prompt=prompt, echo=prompt if data.echo else "", prompt_index=prompt_index
                )
            else:
                choice = ChoiceInput(prompt_token_ids=prompt, prompt_index=prompt_index)
            inputs.extend([choice] * data.n)
        formatter = ResponseFormatter(
            "cmpl-" + uuid.uuid4().hex, model, chat=False,
            echo_logprobs=data.logprobs if data.echo else None,
            prompt_logprobs=data.prompt_logprobs is not None, with_usage=data.include_usage_in_stream(),
            continuous_usage=data.continuous_usage(),
        )  # fmt: skip
        echo_ids = data.echo and any(choice.prompt_token_ids is not None for choice in inputs)
        echo = _echo_token_prompts(route) if echo_ids else None
        return Generation(inputs, params, formatter, after_admission=echo)

    serving = serve_generation(data.model, plan_for, data.stream, data.timeout, trace_context.TEXT_COMPLETION)
    # `tokens`: the Detokenize for echo refused the token-id prompt.
    return await _naming_sent_fields(
        serving, lambda: {**_constraint_names(data.constraint_field(False)), "tokens": "prompt"}
    )


async def _naming_sent_fields(serving: Awaitable[Any], renames: Callable[[], dict[str, str]]) -> Any:
    """`serving`'s answer; a refusal (each comes before a stream opens) that names a wire field in
    `renames` names the request's field instead."""
    try:
        return await serving
    except APIError as exc:
        exc.param = renames().get(exc.param or "", exc.param)
        raise


def _constraint_names(field: str) -> dict[str, str]:
    # A worker names any constraint it cannot enforce `response_format` (exllamav3 a regex `regex`).
    return {"response_format": field, "regex": field}


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


def _echo_token_prompts(route: ModelRoute) -> Callable[[RequestOwner], Awaitable[None]]:
    """What puts each token-id prompt's text into its choices for echo, once the request is admitted
    on `route`: decoding it earlier would ask a model that may have no ready worker (one that a
    fallback answers for, or that is still loading) and fail the request."""

    async def echo(owner: RequestOwner) -> None:
        texts: dict[int, str] = {}
        for choice in owner.choices:
            ids = choice.input.prompt_token_ids
            if ids is None:
                continue
            index = choice.input.prompt_index
            if index not in texts:
                texts[index] = await _prompt_text(route, ids)
            choice.input = replace(choice.input, echo=texts[index])

    return echo


async def _prompt_text(route: ModelRoute, token_ids: list[int]) -> str:
    """The text of a token-id prompt, for echo: decoded by the model's own tokenizer."""
    reply = await serve_exchange(route, lambda rid: wire.Detokenize(rid, list(token_ids)), ANSWER_TIMEOUT_S)
    return reply.text  # type: ignore[no-any-return]
