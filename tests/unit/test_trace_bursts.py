"""bench/trace_bursts.py: a step trace cut into bursts at its pauses, each with its first steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.trace_bursts import bursts, main


def line(t: float, jobs: int, first: int, prefill: int, step_ms: float = 20.04) -> dict[str, object]:
    return {"t": t, "jobs": jobs, "first": first, "prefill": prefill, "step_ms": step_ms, "outside_ms": 0.05}


def test_a_pause_starts_a_burst_and_each_shows_its_first_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A prefill step longer than the pause (0.5 s) does not start a burst: the loop was never idle.
    lone_first = [
        line(0.0, 1, 1, 150),
        line(0.04, 16, 15, 2250),
        line(0.06, 16, 0, 0, step_ms=510.0),
        line(0.58, 16, 0, 0),
    ]
    together = [{**line(5.0, 16, 16, 2400), "gather_ms": 12.34, "gather_end": "told"}, line(5.02, 16, 0, 0)]
    single = [line(9.0, 1, 1, 150)]
    found = bursts(lone_first + together + single, gap_s=0.25, steps=2)
    assert [(most, [step[:3] for step in shown]) for most, shown in found] == [
        (16, [(1, 1, 150), (16, 15, 2250)]),
        (16, [(16, 16, 2400), (16, 0, 0)]),
        (1, [(1, 1, 150)]),
    ]
    assert found[0][1][0][3:] == (20.0, 0.05)
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in lone_first + together + single))
    main([str(trace), "--steps", "1"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].endswith("7 steps, 3 bursts")
    assert printed[1:] == [
        "   [(1, 1, 150, 20.0, 0.05)]",
        "   [(16, 16, 2400, 20.0, 0.05, ('told', 12.3))]",
    ]  # not the lone one
