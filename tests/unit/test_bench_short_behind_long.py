"""bench/bench_short_behind_long.py's table: each checkout's time to first token quiet and behind a
long prompt, their ratio per round, and this checkout over the other paired by round.

Runs in the pytest process; no gateway is started.
"""

from __future__ import annotations

import pytest

bench = pytest.importorskip("bench.bench_short_behind_long", reason="the bench needs httpx and yaml")


def one_round(quiet: float, behind: float, before: int) -> dict[str, object]:
    return {"quiet": {"ttft_ms": [quiet] * 4, "ttft_ms_p50": quiet},
            "behind_long": {"ttft_ms": [behind] * 4, "ttft_ms_p50": behind, "long_ms": [500.0],
                            "before_long_answer": before},
            "ratio": behind / quiet}  # fmt: skip


def test_the_table_gives_each_checkout_its_spread_and_pairs_the_rounds() -> None:
    report = {
        "env": {"cpu": "test cpu", "cores": 2, "date": "2026-11-29T1200Z", "load_before": "1.00 1.00 1.00",
                "load_after": "2.00 2.00 2.00", "shorts": 4, "repeats": 1, "prompt_chars": 1000, "rounds": 2},
        "checkouts": {"this": "aaa", "compare": "bbb"},
        "rounds": {"this": [one_round(30, 60, 4), one_round(40, 60, 3)],
                   "compare": [one_round(30, 300, 0), one_round(30, 600, 0)]},
    }  # fmt: skip
    table = bench.summary(report)
    assert "| this (aaa) | 35.0 (30.0-40.0) | 60.0 (60.0-60.0) | 1.75 (1.50-2.00) | 7/8 | 500 |" in table
    assert "| compare (bbb) | 30.0 (30.0-30.0) | 450.0 (300.0-600.0) | 15.00 (10.00-20.00) | 0/8 |" in table
    # Paired by round: 60/300 and 60/600.
    assert "paired by round: median 0.150 (0.100-0.200)." in table
