"""The first steps of each burst in a worker's step trace (GATEWAY_STEP_TRACE, model_worker.step_trace).

Runs as a standalone process on the host that ran the benchmark, after it. A burst starts after a
pause of more than `--gap-s` between one step's end and the next one's start; for each burst that
reached `--min-jobs` jobs it prints its first `--steps` steps as (jobs, first tokens, prompt tokens
prefilled, step ms, loop ms outside the step before it), and for a step after the worker gathered
a burst also (why the gather ended, its ms). So it shows whether a burst of requests
started in one step (the library's way, and an idle worker's with limits.burst_gather_ms) or one
request first and the rest after.

    python bench/trace_bursts.py '/tmp/bench/trace-exllamav3-gateway*.jsonl*'
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
from pathlib import Path
from typing import Any

Step = tuple[Any, ...]  # (jobs, first, prefill, step ms, outside ms[, (gather end, gather ms)])


def bursts(lines: list[dict[str, Any]], gap_s: float, steps: int) -> list[tuple[int, list[Step]]]:
    """Each burst's most jobs in one step, and its first `steps` steps."""
    found: list[tuple[int, list[Step]]] = []
    last_end: float | None = None
    for line in lines:
        # `t` is when a step began: the pause is what lies between the last step's end and this one.
        if last_end is None or line["t"] - last_end > gap_s:
            found.append((0, []))
        last_end = line["t"] + line["step_ms"] / 1000
        most, shown = found[-1]
        found[-1] = (max(most, line["jobs"]), shown)
        if len(shown) < steps:
            step: Step = (line["jobs"], line["first"], line["prefill"], round(line["step_ms"], 1),
                          line.get("outside_ms"))  # fmt: skip
            if "gather_end" in line:
                step += ((line["gather_end"], round(line["gather_ms"], 1)),)
            shown.append(step)
    return found


def read(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as lines:
        return [json.loads(line) for line in lines]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pattern", help="a glob of step trace files (.jsonl or .jsonl.gz)")
    parser.add_argument("--gap-s", type=float, default=0.25, help="a pause this long starts a new burst")
    parser.add_argument("--steps", type=int, default=3, help="steps shown of each burst")
    parser.add_argument(
        "--min-jobs", type=int, default=8, help="show only bursts that reached this many jobs"
    )
    args = parser.parse_args(argv)
    for name in sorted(glob.glob(args.pattern)):
        lines = read(Path(name))
        found = bursts(lines, args.gap_s, args.steps)
        print(f"{name} {len(lines)} steps, {len(found)} bursts")
        for most, shown in found:
            if most >= args.min_jobs:
                print("  ", shown)


if __name__ == "__main__":
    main()
