"""Token usage per API key over UTC days and months, and the budget check (gateway.observability.usage).

Runs in the pytest process with a hand-driven clock.
"""

from __future__ import annotations

from datetime import datetime, timezone

from gateway.observability.usage import UsageLedger


class Clock:
    def __init__(self, when: str) -> None:
        self.now = datetime.fromisoformat(when).replace(tzinfo=timezone.utc).timestamp()

    def __call__(self) -> float:
        return self.now

    def set(self, when: str) -> None:
        self.now = datetime.fromisoformat(when).replace(tzinfo=timezone.utc).timestamp()


def test_usage_counts_per_key_and_period_and_turns_with_them() -> None:
    clock = Clock("2026-11-30T23:59:00")
    ledger = UsageLedger(clock)
    ledger.add("alice", 70)
    ledger.add("bob", 5)
    ledger.add("alice", 40)
    assert (ledger.used("alice", "day"), ledger.used("alice", "month"), ledger.used("bob", "day")) == (
        110,
        110,
        5,
    )
    clock.set("2026-12-01T00:00:01")  # a new day and a new month
    assert (ledger.used("alice", "day"), ledger.used("alice", "month")) == (0, 0)
    ledger.add("alice", 1)
    clock.set("2026-12-02T10:00:00")
    assert (ledger.used("alice", "day"), ledger.used("alice", "month")) == (0, 1)


def test_a_spent_budget_says_which_and_until_when() -> None:
    clock = Clock("2026-11-24T20:00:00")
    ledger = UsageLedger(clock)
    budgets: dict[str, int | None] = {"day": 100, "month": None}
    ledger.add("alice", 99)
    assert ledger.spent("alice", budgets) is None
    ledger.add("alice", 1)
    spent = ledger.spent("alice", budgets)
    assert spent is not None and (spent.period, spent.budget, spent.used) == ("day", 100, 100)
    assert ledger.retry_after_s(spent) == 4 * 3600 + 1
    assert "100 tokens per day" in spent.message() and "2026-11-25T00:00:00Z" in spent.message()
    monthly = ledger.spent("alice", {"day": None, "month": 50})
    assert monthly is not None and monthly.resets_at.isoformat().startswith("2026-12-01T00:00:00")
