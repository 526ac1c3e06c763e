"""Token usage per API key, and the budgets checked against it.

Runs in the gateway process, on its asyncio loop. Owns the `UsageLedger`: the tokens (prompt plus
completion) each API key used in the current UTC day and the current UTC month, added when a
request finishes, and the check a request's key must pass before it is admitted. The figures live
in this process: with several gateways each counts its own share (a shared counter store is the
scale-out mode's), and a restart starts the periods again from zero. Prometheus counters per key
(gateway.observability.metrics) keep the long-run totals.

A request admitted under budget runs to its end, so a key can overshoot its budget by what its
requests in flight use; the next request is then refused with 429 until the period turns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Literal

Period = Literal["day", "month"]
PERIODS: tuple[Period, ...] = ("day", "month")


@dataclass(frozen=True)
class BudgetSpent:
    """Why a key may not start another request now, and when it may again."""

    period: Period
    budget: int
    used: int
    resets_at: datetime

    def retry_after_s(self, now: datetime) -> int:
        return max(int((self.resets_at - now).total_seconds()) + 1, 1)

    def message(self) -> str:
        return (
            f"this API key's budget of {self.budget} tokens per {self.period} is used up ({self.used} used); "
            f"it resets at {self.resets_at.strftime('%Y-%m-%dT%H:%M:%SZ')}"
        )


def period_id(period: Period, now: datetime) -> str:
    return now.strftime("%Y-%m-%d" if period == "day" else "%Y-%m")


def period_end(period: Period, now: datetime) -> datetime:
    start = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return start + timedelta(days=1)
    first = start.replace(day=1)
    return (first + timedelta(days=32)).replace(day=1)


class UsageLedger:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        # (key name, period, period id) -> tokens; only the current ids are kept.
        self._used: dict[tuple[str, Period, str], int] = {}
        # The current period ids and the clock times they hold for: every period here turns at the
        # start of a UTC day, so they are worked out again only then (datetime and strftime were
        # most of what a finished request's `add` cost).
        self._ids: dict[Period, str] = {}
        self._ids_from = self._ids_until = 0.0
        self._turned = False  # the ids changed since `add` last dropped what is stale

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self._clock(), tz=timezone.utc)

    def _current_ids(self) -> dict[Period, str]:
        now_s = self._clock()
        if not self._ids_from <= now_s < self._ids_until:
            now = datetime.fromtimestamp(now_s, tz=timezone.utc)
            day = now.replace(hour=0, minute=0, second=0, microsecond=0)
            self._ids_from = day.timestamp()
            self._ids_until = (day + timedelta(days=1)).timestamp()
            ids = {period: period_id(period, now) for period in PERIODS}
            self._turned = self._turned or ids != self._ids
            self._ids = ids
        return self._ids

    def add(self, key: str, tokens: int) -> None:
        if tokens <= 0:
            return
        current = self._current_ids()
        for period, ident in current.items():
            slot = (key, period, ident)
            self._used[slot] = self._used.get(slot, 0) + tokens
        # A period that has turned is dropped the next time anything is added.
        if self._turned:
            self._turned = False
            for stale in [s for s in self._used if s[2] != current[s[1]]]:
                del self._used[stale]

    def used(self, key: str, period: Period) -> int:
        return self._used.get((key, period, self._current_ids()[period]), 0)

    def spent(self, key: str, budgets: dict[str, int | None]) -> BudgetSpent | None:
        """The first budget of `budgets` the key has used up, else None."""
        now = self._now()
        for period in PERIODS:
            budget = budgets.get(period)
            if budget is None:
                continue
            used = self.used(key, period)
            if used >= budget:
                return BudgetSpent(period, budget, used, period_end(period, now))
        return None

    def retry_after_s(self, spent: BudgetSpent) -> int:
        return spent.retry_after_s(self._now())
