"""bench/bench_gateway_cpu.py's comparison of two checkouts: the table pairs each round of one with
the same round of the other, and reads a process's CPU time from /proc.

Runs in the pytest process; no gateway is started.
"""

from __future__ import annotations

import os

import pytest

bench = pytest.importorskip("bench.bench_gateway_cpu", reason="the bench needs its extras (httpx, yaml)")


def row(us: float, tokens: int = 100, chunks: int = 100) -> dict[str, float]:
    return {"us_per_token": us, "user_us_per_token": us * 0.8, "sys_us_per_token": us * 0.2,
            "tokens": tokens, "chunks": chunks, "rest_cores": 1.5}  # fmt: skip


def test_the_table_pairs_rounds_and_says_whether_every_chunk_held_one_token() -> None:
    report = {
        "env": {"cpu": "test cpu", "cores": 2, "date": "2026-11-26T12:00:00Z", "python": "3.11",
                "torch": "t", "transformers": "x", "preset": "small"},
        "levels": [1, 8],
        "rounds": {"this": {1: [row(50), row(60)], 8: [row(40), row(40, chunks=90)]},
                   "compare": {1: [row(100), row(50)], 8: [row(80), row(20)]}},
        "commits": {"this": "aaa", "compare": "bbb"},
        "cpu_tokens": 100, "rounds_run": 2,
    }  # fmt: skip
    table = bench.compare_markdown(report)
    lines = {line.split(" | ")[0]: line for line in table.splitlines() if line.startswith("| ")}
    # Paired ratios 0.5 and 1.2: median 0.85; one of two rounds lower.
    assert "| 0.850 (0.500-1.200) | 1 of 2 | True |" in lines["| 1"]
    assert "| 1.250 (0.500-2.000) | 1 of 2 | False |" in lines["| 8"]
    assert "55.0 (50.0-60.0)" in lines["| 1"] and "75.0 (50.0-100.0)" in lines["| 1"]


def test_per_request_rounds_get_their_own_paired_table() -> None:
    report = {
        "env": {"cpu": "test cpu", "cores": 2, "date": "2026-11-27T12:00:00Z", "python": "3.11",
                "torch": "t", "transformers": "x", "preset": "small"},
        "levels": [1], "rounds": {"this": {1: [row(50)]}, "compare": {1: [row(100)]}},
        "commits": {"this": "aaa", "compare": "bbb"}, "cpu_tokens": 100, "rounds_run": 2,
        "request_levels": [64], "burst_requests": 384,
        "request_rounds": {
            "this": {64: [{"us_per_request": 900.0, "rest_cores": 1.0},
                          {"us_per_request": 1100.0, "rest_cores": 1.2}]},
            "compare": {64: [{"us_per_request": 1000.0, "rest_cores": 1.1},
                             {"us_per_request": 1000.0, "rest_cores": 1.3}]}},
    }  # fmt: skip
    table = bench.compare_markdown(report)
    line = next(line for line in table.splitlines() if line.startswith("| 64 |"))
    # Paired ratios 0.9 and 1.1: median 1.0, one of two rounds lower.
    expected = "| 64 | 1000.0 (900.0-1100.0) | 1000.0 (1000.0-1000.0) | 1.000 (0.900-1.100) | 1 of 2 |"
    assert line == expected + " 1.00-1.30 |"
    assert "384 streamed completions of one token per burst" in table


def test_run_seconds_grows_with_the_cpu_this_process_uses() -> None:
    before = bench.run_seconds(os.getpid())
    sum(i * i for i in range(300_000))
    assert bench.run_seconds(os.getpid()) > before
