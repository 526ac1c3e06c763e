"""What a request asks of a reasoning model: whether its output is split, its thinking budget, and
the output constraint that waits until the thinking is over.

Runs in the gateway process, at the API edge (every surface calls `plan_reasoning` for the model
that answers). The worker cannot switch a job's constraint or insert tokens mid-generation, so:

- a thinking budget is enforced by the gateway: when the model has thought that many tokens
  without closing its thinking, its job is cancelled and a continuation job starts from the prompt,
  the thinking so far and the parser's closing tag (`</think>`), so the model goes on with its
  answer (gateway.serving.continuation);
- an output constraint (a required or named tool call, response_format, guided_*) would forbid
  the thinking itself, so while the model thinks its job runs without it; when the thinking ends
  (on its own or by the budget), the continuation job carries the constraint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.config.models import ModelConfig
from gateway.errors import InvalidRequest
from gateway.reasoning.parsers import ReasoningParser, parser_named
from wire.params import SamplingParams

# The SamplingParams fields that constrain the output.
CONSTRAINT_FIELDS = ("json_object", "json_schema", "regex", "compact_json")
_NO_CONSTRAINT: dict[str, Any] = {
    "json_object": False,
    "json_schema": None,
    "regex": None,
    "compact_json": False,
}


@dataclass(frozen=True)
class ReasoningPlan:
    parser: ReasoningParser
    budget: int | None = None  # thinking tokens at most, then the gateway closes the thinking
    withheld: dict[str, Any] | None = None  # the constraint, applied once the thinking is over

    @property
    def may_continue(self) -> bool:
        """Whether a continuation job may take over from the first one."""
        return self.budget is not None or self.withheld is not None


def plan_reasoning(
    model: ModelConfig,
    template_kwargs: dict[str, Any],
    budget: int | None,
    budget_param: str,
    params: SamplingParams,
) -> tuple[SamplingParams, ReasoningPlan | None]:
    """The parameters the first job runs with, and the plan (None: the output is all answer)."""
    if model.reasoning_parser is None:
        if budget is not None:
            raise InvalidRequest(
                f"model '{model.name}' has no reasoning_parser in the registry, so its thinking cannot be "
                "told from its answer or capped",
                param=budget_param,
            )
        return params, None
    parser = parser_named(model.reasoning_parser)
    if not parser.thinks(template_kwargs):
        return params, None
    constraint = {name: getattr(params, name) for name in CONSTRAINT_FIELDS}
    withheld = constraint if constraint != _NO_CONSTRAINT else None
    if withheld is not None:
        params = replace_params(params, **_NO_CONSTRAINT)
    return params, ReasoningPlan(parser, budget, withheld)


def replace_params(params: SamplingParams, **changes: Any) -> SamplingParams:
    """A copy of the (frozen) parameters with some fields changed."""
    return msgspec.structs.replace(params, **changes)
