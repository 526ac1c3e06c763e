"""bench/trace_rounds.py: one-stream rounds read back from a step trace, against the client's rounds."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from bench.trace_rounds import loop_rate, main, one_stream_rounds, summary


def step(first: int = 0, prefill: int = 0, jobs: int = 1, step_ms: float = 10.0, cpu_ms: float = 9.9) -> dict:
    return {"jobs": jobs, "tokens": jobs, "first": first, "prefill": prefill, "step_ms": step_ms,
            "outside_ms": 0.0, "send_ms": 0.0, "cpu_ms": cpu_ms, "faults": 0, "preempted": 0,
            "sleeps": 2}  # fmt: skip


def one_round(step_ms: float) -> list[dict]:
    first = step(first=1, prefill=100, step_ms=40.0, cpu_ms=40.0)
    return [first, *(step(step_ms=step_ms, cpu_ms=step_ms - 0.1) for _ in range(3))]


def test_rounds_are_told_apart_and_several_streams_are_left_out() -> None:
    warm_up, slow, fast = one_round(10.0), one_round(20.0), one_round(10.0)
    burst = [step(first=4, prefill=400, jobs=4), step(jobs=4)]  # a round of four streams
    short = one_round(10.0)[:2]  # a round cut short: not all its tokens
    rounds = one_stream_rounds([*warm_up, *slow, *burst, *short, *fast], new_tokens=4)
    assert [len(r) for r in rounds] == [4, 4, 4]
    assert [loop_rate(r) for r in rounds] == [100.0, 50.0, 100.0]  # 3 tokens over 30 or 60 ms


def test_the_client_rounds_are_matched_to_the_last_trace_rounds() -> None:
    rounds = [one_round(10.0), one_round(20.0), one_round(10.0)]  # the first is the warm-up
    figures = summary(rounds, client_tok_s=[45.0, 99.0])
    assert figures["matched"] == 2
    assert figures["client_over_loop"] == pytest.approx((0.9 + 0.99) / 2)
    assert figures["client_over_loop_range"] == [0.9, 0.99]
    assert figures["wait_ms_per_step"] == pytest.approx(0.1, abs=1e-3)  # decode steps only
    assert figures["sleeps_per_step"] == 2


def test_the_command_reads_a_result_and_gzipped_traces(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = tmp_path / "bench.json"
    result.write_text(json.dumps({"new_tokens": 4, "rows": [
        {"path": "gateway", "streams": 1, "tok_s_rounds": [99.0]},
        {"path": "gateway", "streams": 64, "tok_s_rounds": [1.0]},
    ]}))  # fmt: skip
    trace = tmp_path / "trace.jsonl.gz"
    with gzip.open(trace, "wt") as out:
        out.writelines(json.dumps(line) + "\n" for line in one_round(10.0))
    main([str(result), f"gateway={trace}"])
    printed = capsys.readouterr().out
    assert printed.startswith("gateway ") and json.loads(printed.split(" ", 1)[1])["client_over_loop"] == 0.99
    with pytest.raises(SystemExit):
        main([str(result), f"raw={trace}"])  # no one-stream row of that path
