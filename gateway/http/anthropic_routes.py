"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

Runs in the gateway process. Owns turning a validated Messages request (gateway.http.anthropic_schemas)
into the chat request it is, the tool plan, the thinking settings (a budget, the template's
switch) and the stop sequences the gateway matches itself (so the response can say which one
stopped the text), for the model that answers; the one serving
path (gateway.http.serving_path) does the rest, and gateway.http.anthropic_format writes the message
or its event stream. Errors on these routes have Anthropic's shape (gateway.http.app renders them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quart import Blueprint, jsonify, request
from quart_schema import validate_request

from gateway.errors import InvalidRequest
from gateway.http.anthropic_format import MessagesFormatter
from gateway.http.anthropic_schemas import CountTokensRequest, MessagesRequest
from gateway.http.schemas import ChatCompletionRequest
from gateway.http.serving_path import Generation, generation_route, serve_exchange, serve_generation
from gateway.reasoning.plan import plan_reasoning
from gateway.serving.choice_text import TextPlan
from gateway.serving.outputs import ChoiceInput
from gateway.serving.router import ModelRoute
from gateway.tools.plan import ToolPlan, plan_tools
from wire import messages as wire
from wire import trace_context

blueprint = Blueprint("anthropic", __name__)
ANSWER_TIMEOUT_S = 30.0


def is_anthropic_request() -> bool:
    """Whether the current request is on these routes (its errors then take Anthropic's shape)."""
    return request.path == "/v1/messages" or request.path.startswith("/v1/messages/")


def _tool_plan(chat: ChatCompletionRequest, route: ModelRoute) -> ToolPlan:
    tools, tool_choice = chat.tool_definitions()
    return plan_tools(tools, tool_choice, chat.parallel_tool_calls, route.config.name,
                      route.config.tool_call_parser)  # fmt: skip


@dataclass(frozen=True)
class Thinking:
    """What the request's `thinking` asks: the template switch, a budget, and whether to show it."""

    template_kwargs: dict[str, Any]
    budget: int | None = None
    shown: bool = True


def _thinking(thinking: dict[str, Any] | None, max_tokens: int | None) -> Thinking:
    """`enabled` with budget_tokens caps the thinking (below max_tokens, as Anthropic requires);
    `disabled` turns the template's thinking off (`enable_thinking: false`, as Qwen3's template
    reads it); `adaptive` or none: the model's own way. `display: omitted` sends empty thinking."""
    if thinking is None:
        return Thinking({})
    kind, display = thinking.get("type"), thinking.get("display")
    allowed = {"enabled": {"type", "budget_tokens", "display"}, "adaptive": {"type", "display"},
               "disabled": {"type"}}.get(kind if isinstance(kind, str) else "")  # fmt: skip
    if allowed is None:
        raise InvalidRequest("thinking type must be enabled, adaptive or disabled", param="thinking")
    unknown = set(thinking) - allowed
    if unknown:
        raise InvalidRequest(f"thinking.{sorted(unknown)[0]} is not supported", param="thinking")
    if display not in (None, "summarized", "omitted"):
        raise InvalidRequest("thinking.display must be summarized or omitted", param="thinking")
    shown = display != "omitted"
    if kind == "disabled":
        return Thinking({"enable_thinking": False})
    if kind == "adaptive":
        return Thinking({}, shown=shown)
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise InvalidRequest("thinking.budget_tokens must be a positive integer", param="thinking")
    if max_tokens is not None and budget >= max_tokens:
        raise InvalidRequest("thinking.budget_tokens must be less than max_tokens", param="thinking")
    return Thinking({}, budget, shown)


@blueprint.post("/v1/messages")
@validate_request(MessagesRequest)
async def messages(data: MessagesRequest) -> Any:
    thinking = _thinking(data.thinking, data.max_tokens)
    chat = data.as_chat(thinking.template_kwargs)

    async def plan_for(route: ModelRoute, model: str) -> Generation:
        plan = _tool_plan(chat, route)
        options = chat.chat_options(plan.tools if plan.active else [])
        params = chat.sampling_params(route.config, None, plan.constraint_schema())
        plan.check_output_constraint(params.json_schema is not None, "output_config", "none, any or tool")
        params, reasoning = plan_reasoning(route.config, options.template_kwargs, thinking.budget, "thinking",
                                           params)  # fmt: skip
        inputs = [ChoiceInput(messages=[m.to_wire() for m in chat.messages], chat=options)]
        text_plan = TextPlan(stop_sequences=list(data.stop_sequences or []), reasoning=reasoning)
        return Generation(inputs, params, MessagesFormatter(model, plan, thinking.shown), text_plan)

    return await serve_generation(data.model, plan_for, data.stream, data.timeout, trace_context.CHAT)


@blueprint.post("/v1/messages/count_tokens")
@validate_request(CountTokensRequest)
async def count_tokens(data: CountTokensRequest) -> Any:
    """The prompt's tokens as the model's template renders it (tools included)."""
    chat = data.as_chat(_thinking(data.thinking, data.max_tokens).template_kwargs)
    route = generation_route(data.model)
    plan = _tool_plan(chat, route)
    options = chat.chat_options(plan.tools if plan.active else [])
    messages = [m.to_wire() for m in chat.messages]

    def tokenize(rid: str) -> wire.Tokenize:
        return wire.Tokenize(rid, None, messages, True, options)

    reply = await serve_exchange(route, tokenize, ANSWER_TIMEOUT_S)
    return jsonify({"input_tokens": len(reply.token_ids)})
