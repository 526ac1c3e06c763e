"""Output constraints (JSON schemas, regular expressions) compiled off the serve loop, within budgets.

Runs in the worker process. The serve loop hands a job whose constraint is not compiled yet to
`ConstraintCompiler`, keeps stepping every other job, and submits the job once its parser is ready
(or answers Rejected). Two budgets keep one request from stalling a worker:
- size, checked at once: a regular expression's automaton is estimated from its parse tree (bounded
  repeats multiply), and one estimated above `max_states` is refused before anything is built
  (`^[a-z]{1,30000}$` would take minutes to build);
- time: compiling runs in the compiler's own process (model_worker.constraint_process), one
  constraint at a time; one not ready within `timeout_s` is refused and its process killed.
A refused constraint is remembered and refused at once when it comes again.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from model_worker.constraint_process import Compiled, CompilerProcess
from model_worker.engines.base import RequestRejected
from model_worker.engines.structured_output import (
    constraint_key,
    is_compiled,
    patterns_of,
    remember_parser,
    wants_json,
)
from wire.params import SamplingParams
from wire.results import RejectCode

try:  # the regular-expression parser of the standard library (sre_parse before Python 3.11)
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse

logger = logging.getLogger(__name__)
_UNBOUNDED = sre_parse.MAXREPEAT
MAX_REFUSED_REMEMBERED = 256


class Unenforceable(ValueError):
    """A valid regular expression that the enforcer would get wrong."""


def estimated_states(pattern: str) -> int:
    """Roughly how many states the pattern's automaton has: bounded repeats multiply the states of
    what they repeat, alternatives add up. ValueError for a pattern Python cannot parse, or one
    with a lookaround."""
    try:
        tree = sre_parse.parse(pattern)
    except Exception as exc:  # re.error, or deeper trouble with hostile input
        raise ValueError(str(exc)) from None

    def size(items: Any) -> int:
        total = 0
        for op, argument in items:
            name = str(op)
            if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                low, high, item = argument
                total += (high if high != _UNBOUNDED else low + 1) * max(size(item), 1)
            elif name == "SUBPATTERN":
                total += size(argument[-1])
            elif name == "BRANCH":
                total += sum(size(branch) for branch in argument[1])
            elif name in ("ASSERT", "ASSERT_NOT"):
                # interegular reads a lookaround as something else (`a+(?=b)` matches "ab"), and the
                # enforcer then allows what the pattern forbids.
                raise Unenforceable("lookarounds ((?=...), (?!...), (?<=...), (?<!...)) are not supported")
            elif name == "ATOMIC_GROUP":
                total += size(argument[-1])
            else:
                total += 1
        return total

    return size(tree)


@dataclass(eq=False)
class _Pending:
    params: SamplingParams
    compiled: bool = False


class ConstraintCompiler:
    def __init__(self, timeout_s: float, max_states: int) -> None:
        self.timeout_s = timeout_s
        self.max_states = max_states
        self._process = CompilerProcess()
        self._pending: dict[tuple[Any, ...], _Pending] = {}  # in arrival order: compiled first-come
        self._running: tuple[Any, ...] | None = None
        # Refused constraints stay refused at once: a client repeating one that ran out of time must
        # not occupy the compiler for a whole budget each time.
        self._refused: OrderedDict[tuple[Any, ...], RequestRejected] = OrderedDict()
        # The engine's one-time tokenizer data for constraints, built on a thread beside the compiles.
        self._prepare_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="constraint-prepare")
        self._prepared: Future[None] | None = None

    def needed(self, params: SamplingParams) -> bool:
        """Whether the job must wait for a compilation; RequestRejected now if it is over budget."""
        if not wants_json(params) or is_compiled(params):
            return False
        refused = self._refused.get(constraint_key(params))
        if refused is not None:
            raise refused
        for pattern in patterns_of(params):
            try:
                states = estimated_states(pattern)
            except ValueError as exc:
                what = "cannot be enforced" if isinstance(exc, Unenforceable) else "is invalid"
                raise RequestRejected(
                    RejectCode.INVALID_RESPONSE_FORMAT,
                    f"the regular expression {pattern[:60]!r} {what}: {exc}",
                    "response_format",
                ) from None
            if states > self.max_states:
                raise RequestRejected(
                    RejectCode.INVALID_RESPONSE_FORMAT,
                    f"the regular expression {pattern[:60]!r} needs about {states} automaton states, "
                    f"more than this model's max_constraint_states ({self.max_states}); "
                    "bound its repeats more tightly",
                    "response_format",
                )
        return True

    def start(self, params: SamplingParams, prepare: Callable[[], None] | None = None) -> tuple[Any, ...]:
        """Queue the constraint for compiling (once per distinct constraint); returns the key to poll
        with `result`. `prepare` (the engine's one-time tokenizer data) runs once, on a thread."""
        if prepare is not None and self._prepared is None:
            self._prepared = self._prepare_pool.submit(prepare)
        key = constraint_key(params)
        self._pending.setdefault(key, _Pending(params))
        self._advance()
        return key

    def result(self, key: tuple[Any, ...]) -> bool | None:
        """True when compiled, None while still compiling within its budget; RequestRejected when the
        constraint cannot be enforced or missed its time budget."""
        self._advance()
        refused = self._refused.get(key)
        if refused is not None:
            raise refused
        pending = self._pending.get(key)
        if pending is not None:
            if not pending.compiled:
                return None
            del self._pending[key]
        if self._prepared is not None:
            if not self._prepared.done():
                return None
            error = self._prepared.exception()
            if error is not None:
                raise RequestRejected(
                    RejectCode.INVALID_RESPONSE_FORMAT, f"the constraint failed: {error}", "response_format"
                )
        return True

    def _advance(self) -> None:
        """Collect the running compile's outcome, stop one over budget, send the next."""
        running = self._running
        if running is not None:
            pending = self._pending[running]
            answer = self._process.answer()
            since = self._process.busy_since
            if isinstance(answer, Compiled):
                remember_parser(pending.params, answer.parser)
                pending.compiled = True
            elif answer is not None:
                self._refuse(running, answer)
            elif since is not None and time.monotonic() >= since + self.timeout_s:
                self._process.stop()
                self._refuse(running, self._over_time())
            else:
                return
            self._running = None
        waiting = next((key for key, p in self._pending.items() if not p.compiled), None)
        if waiting is not None and self._process.idle:
            self._process.send(self._pending[waiting].params)
            self._running = waiting

    def _refuse(self, key: tuple[Any, ...], refusal: RequestRejected) -> None:
        del self._pending[key]
        self._refused[key] = refusal
        while len(self._refused) > MAX_REFUSED_REMEMBERED:
            self._refused.popitem(last=False)

    def _over_time(self) -> RequestRejected:
        return RequestRejected(
            RejectCode.INVALID_RESPONSE_FORMAT,
            f"the constraint could not be compiled within {self.timeout_s:g}s "
            "(max_constraint_compile_s); simplify the schema or expression",
            "response_format",
        )

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def close(self) -> None:
        self._process.stop()
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)
