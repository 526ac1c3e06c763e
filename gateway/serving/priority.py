"""Priority classes of requests waiting for a model's slots, and the rule that keeps low ones moving.

Runs in the gateway process, on its asyncio loop. Owns the request's class (a context variable set by
the HTTP layer from the API key and the X-Priority header, read by the router when the request
starts to wait; each request runs in its own task, so each has its own value) and the ordering rule
of a model's queue:

- waiters are served by class, `high` before `normal` before `low`, and in arrival order within a
  class;
- a waiter moves up one class for every `priority_aging_s` it has waited (the model's limits), so a
  `low` request behind a steady stream of `high` ones competes as `high` after twice that time, and is
  then served before every later arrival. Nothing waits for ever while slots keep freeing.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import get_args

from gateway.config.api_keys import Priority

CLASSES: tuple[Priority, ...] = get_args(Priority)  # best first
RANK: dict[str, int] = {name: rank for rank, name in enumerate(CLASSES)}
DEFAULT: Priority = "normal"
HEADER = "X-Priority"

_current: ContextVar[Priority] = ContextVar("request_priority", default=DEFAULT)


def set_request_priority(priority: Priority) -> None:
    _current.set(priority)


def request_priority() -> Priority:
    return _current.get()


def effective_rank(priority: Priority, waited_s: float, aging_s: float) -> int:
    """The class a waiter competes in now: its own, raised one step per `aging_s` waited."""
    return max(RANK[priority] - int(waited_s // aging_s), 0)


def allowed_priority(requested: str | None, ceiling: Priority) -> Priority | None:
    """The class a request gets: what it asks for (X-Priority), never above its key's class.
    None if the header names no class."""
    if requested is None:
        return ceiling
    asked = requested.strip().lower()
    if asked not in RANK:
        return None
    return CLASSES[max(RANK[asked], RANK[ceiling])]
