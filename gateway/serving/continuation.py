"""A choice's job handed over to a continuation job, mid-request: how a thinking budget is enforced
and how an output constraint waits for the end of the thinking.

Runs in the gateway process, on its asyncio loop, as a task the request owner keeps (and cancels
when the request ends). The worker can neither insert tokens into a running job nor change its
constraint, so the gateway does what it can do honestly within the protocol: it cancels the job
(`RequestOwner.suspend`), asks the same worker for the prompt's token ids and, to close the
thinking, for those of the parser's closing tag (`</think>`), then starts a new job on the same
worker and slot whose prompt is the original prompt, every token generated so far, and the tag.
The model continues from exactly where it stopped, now in its answer. Costs: one more prefill of
the prompt and the thinking (a prefix cache makes it cheap), and the thinking may run past the
budget by the tokens of one engine step (one token, or a speculative draft).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from gateway.errors import InvalidRequest, RequestTimeout, WorkerFailed, as_api_error
from gateway.reasoning.plan import replace_params
from gateway.serving.choice_text import Cut
from wire import messages as wire
from wire.results import FinishReason, RejectCode

if TYPE_CHECKING:
    from gateway.serving.choice import Choice
    from gateway.serving.request_owner import RequestOwner

logger = logging.getLogger(__name__)
TOKENIZE_TIMEOUT_S = 30.0


async def continue_choice(owner: RequestOwner, choice: Choice, cut: Cut) -> None:
    """Start the job that continues `choice` after `cut`; any failure ends the request."""
    try:
        await _continue(owner, choice, cut)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        owner.abort(as_api_error(exc))


async def _continue(owner: RequestOwner, choice: Choice, cut: Cut) -> None:
    text = choice.text
    plan = text.plan.reasoning
    assert plan is not None
    remaining = choice.params.max_tokens - text.generated_tokens
    if remaining <= 0:
        owner.finish_suspended(choice, FinishReason.LENGTH)
        return
    prompt = await _prompt_ids(owner, choice)
    keep = choice.params.truncate_prompt_tokens
    if keep is not None:  # the first job saw only these: the continuation sees them, then what it wrote
        prompt = prompt[-keep:]
    ids = [*prompt, *text.generated_ids]
    if cut is Cut.CLOSE_THINKING:
        ids += await _token_ids(owner, choice, plan.parser.closing)
        logger.info("thinking budget of %d tokens spent; the thinking is closed and the answer continues",
                    plan.budget)  # fmt: skip
    changes: dict[str, object] = {
        "max_tokens": remaining,
        "min_tokens": max(choice.params.min_tokens - text.generated_tokens, 0),
        "prompt_logprobs": None,  # the prompt's were sent with the first job
        "truncate_prompt_tokens": None,  # cut above, before the thinking was added
        **(plan.withheld or {}),
    }
    answer = await owner.restart_job(choice, ids, replace_params(choice.params, **changes))
    if isinstance(answer, wire.Accepted):
        return
    if answer.code is RejectCode.CONTEXT_LENGTH_EXCEEDED:  # no room left in the context: cut by length
        owner.finish_suspended(choice, FinishReason.LENGTH)
        return
    raise InvalidRequest(answer.message, code=answer.code.value, param=answer.param)


async def _prompt_ids(owner: RequestOwner, choice: Choice) -> list[int]:
    """The token ids of the choice's prompt, as its worker renders it (once per request)."""
    source = choice.input
    if source.prompt_token_ids is not None:
        return list(source.prompt_token_ids)
    key = ("prompt", id(source))
    if key not in owner.token_cache:

        def tokenize(rid: str) -> wire.Tokenize:
            return wire.Tokenize(rid, source.prompt, source.messages, True, source.chat)

        owner.token_cache[key] = asyncio.ensure_future(_exchange(owner, choice, tokenize))
    return await asyncio.shield(owner.token_cache[key])


async def _token_ids(owner: RequestOwner, choice: Choice, text: str) -> list[int]:
    key = ("text", text)
    if key not in owner.token_cache:

        def tokenize(rid: str) -> wire.Tokenize:
            return wire.Tokenize(rid, text, None, False)

        owner.token_cache[key] = asyncio.ensure_future(_exchange(owner, choice, tokenize))
    return await asyncio.shield(owner.token_cache[key])


async def _exchange(owner: RequestOwner, choice: Choice, build: Callable[[str], wire.Tokenize]) -> list[int]:
    assert choice.worker_id is not None
    try:
        message = build(uuid.uuid4().hex)
        reply = await owner.service.link.exchange(choice.worker_id, message, TOKENIZE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise RequestTimeout("the worker did not tokenize the continuation in time") from None
    if reply is False:
        raise WorkerFailed(f"the worker for model '{owner.route.config.name}' is unreachable")
    if isinstance(reply, wire.Rejected):
        raise InvalidRequest(reply.message, code=reply.code.value, param=reply.param)
    return list(reply.token_ids)
