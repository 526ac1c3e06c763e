"""One-stream rounds of a traced benchmark run: how much of each round the engine's own loop explains.

Runs as a standalone process on any host, after a `bench_engines.py --trace` run with one stream,
over its JSON result and the step traces of its paths (model_worker.step_trace). A one-stream round
in a trace is a step that gave the job its first token after prefilling its prompt, then one step
per token. For each path it prints:
  client / loop   the client's tok/s in the round over the rate of the engine loop's own decode
                  steps (tokens after the first, over the sum of their steps, the time between them
                  and each frame's hand-over): what the path loses outside the engine's loop (the
                  first token's prefill on every path; HTTP, the worker's link and the last chunk
                  through the gateway). Median and range over the rounds.
  wait per step   the mean of a decode step's wall time less its thread's CPU time: what the
                  engine thread waited for (the GIL, a lock) inside its steps.
  faults, preempted, sleeps   per decode step, means.
The last rounds of each trace are matched to the client's rounds in order (the earlier ones are the
benchmark's warm-up).

    python bench/trace_rounds.py bench/results/bench_exllamav3_2026-11-29T1329Z-thread-cpu-1stream.json \\
        raw=bench/results/trace-exllamav3-raw_2026-11-29T1329Z-thread-cpu-1stream.jsonl.gz \\
        gateway=bench/results/trace-exllamav3-gateway_2026-11-29T1329Z-thread-cpu-1stream.jsonl.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path
from typing import Any

Line = dict[str, Any]


def read_trace(path: Path) -> list[Line]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as trace:
        return [json.loads(line) for line in trace if line.strip()]


def one_stream_rounds(lines: list[Line], new_tokens: int) -> list[list[Line]]:
    """Each one-job round that gave all `new_tokens` tokens, in order: its first-token step first."""
    rounds: list[list[Line]] = []
    current: list[Line] | None = None
    for line in lines:
        if line["jobs"] > 1:  # a round of several streams: not one of these
            current = None
        elif line["jobs"] == 1 and line.get("first") == 1 and line.get("prefill"):
            current = [line]
            rounds.append(current)
        elif current is not None:
            current.append(line)
    return [r for r in rounds if sum(line["tokens"] for line in r) == new_tokens]


def loop_rate(round_: list[Line]) -> float:
    """Tokens per second of the round's decode steps, by the engine loop's own clock."""
    decode = round_[1:]
    ms = sum(
        line["step_ms"] + (line.get("outside_ms") or 0.0) + (line.get("send_ms") or 0.0) for line in decode
    )
    return sum(line["tokens"] for line in decode) * 1000.0 / ms


def summary(rounds: list[list[Line]], client_tok_s: list[float]) -> dict[str, Any]:
    matched = rounds[len(rounds) - len(client_tok_s) :] if len(rounds) >= len(client_tok_s) else []
    shares = [client / loop_rate(r) for r, client in zip(matched, client_tok_s, strict=True)]
    decode = [line for r in rounds for line in r[1:]]

    def mean(key: str) -> float | None:
        values = [line[key] for line in decode if line.get(key) is not None]
        return round(statistics.mean(values), 3) if values else None

    waits = [line["step_ms"] - line["cpu_ms"] for line in decode if line.get("cpu_ms") is not None]
    return {
        "rounds": len(rounds),
        "matched": len(matched),
        "client_over_loop": round(statistics.median(shares), 4) if shares else None,
        "client_over_loop_range": [round(min(shares), 4), round(max(shares), 4)] if shares else None,
        "wait_ms_per_step": round(statistics.mean(waits), 3) if waits else None,
        "faults_per_step": mean("faults"),
        "preempted_per_step": mean("preempted"),
        "sleeps_per_step": mean("sleeps"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path, help="the run's bench_engines.py JSON result")
    parser.add_argument("traces", nargs="+", help="PATH=TRACE: a path's step trace (.jsonl or .jsonl.gz)")
    args = parser.parse_args(argv)
    result = json.loads(args.result.read_text())
    rows = {row["path"]: row for row in result["rows"] if row["streams"] == 1}
    for item in args.traces:
        path, _, file = item.partition("=")
        if path not in rows or not file:
            parser.error(f"{item!r}: expected PATH=TRACE with PATH one of {sorted(rows)}")
        rounds = one_stream_rounds(read_trace(Path(file)), int(result["new_tokens"]))
        print(path, json.dumps(summary(rounds, rows[path].get("tok_s_rounds") or [])))


if __name__ == "__main__":
    main()
