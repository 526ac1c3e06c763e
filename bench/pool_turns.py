"""Several benchmark runs pooled turn by turn: one paired ratio and one first-token figure per engine
and concurrency, over every turn of every run given.

Runs as a standalone process on any host, after the runs, over bench_engines.py's JSON results
(`paired_ratio_turns` and `paired_ttft_added_ms_turns`, kept per row since 2026-11-27). One run of
5-15 turns places its median only within a wide interval on hosts whose speed moves by tens of
percent between rounds; the turns of several runs of the same code, pooled, narrow it. Each line:
runs, turns, the median of the turns' ratios (gateway round / library round of the same turn) with
its 95 % interval, and the same for the time to first token added, in ms.

    python bench/pool_turns.py bench/results/bench_exllamav3_2026-11-28T0*.json
    python bench/pool_turns.py bench/results/bench_exllamav2_2026-11-28T*.json --path 'gateway, env'
    python bench/pool_turns.py run1.json 'run2.json@gateway, env'   # that file's row path, the rest's default
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.streams import median_interval  # noqa: E402

Key = tuple[str, str, int]  # (engine and mode, prompts, streams)


@dataclass
class Pooled:
    runs: int = 0
    ratios: list[float] = field(default_factory=list)
    ttft_added_ms: list[float] = field(default_factory=list)


def pool(results: list[tuple[dict[str, Any], str]]) -> dict[Key, Pooled]:
    """Every turn of each result's rows of its path, by engine (exllamav2 marked paged or unpaged), prompts
    (new every round or repeated: a repeated prompt is found in the cache) and streams."""
    pooled: dict[Key, Pooled] = defaultdict(Pooled)
    for result, path in results:
        engine, settings = result["engine"], result["settings"]
        if engine == "exllamav2":
            engine += " unpaged" if settings.get("paged") is False else " paged"
        prompts = "new prompts" if settings.get("fresh_prompts") else "repeated prompts"
        for row in result["rows"]:
            turns = row.get("paired_ratio_turns")
            if row["path"] != path or not turns:
                continue
            entry = pooled[(engine, prompts, row["streams"])]
            entry.runs += 1
            entry.ratios += turns
            entry.ttft_added_ms += row.get("paired_ttft_added_ms_turns") or []
    return dict(pooled)


def _figure(values: list[float], digits: int) -> str:
    if not values:
        return "-"
    interval = median_interval(values)
    spread = f"{interval[0]:.{digits}f} to {interval[1]:.{digits}f}" if interval else "too few turns"
    return f"{statistics.median(values):.{digits}f} ({spread})"


def lines(pooled: dict[Key, Pooled]) -> list[str]:
    return [
        f"{engine}, {prompts}, {streams} streams: {entry.runs} runs, {len(entry.ratios)} turns, "
        f"ratio {_figure(entry.ratios, 3)}, first token added {_figure(entry.ttft_added_ms, 1)} ms"
        for (engine, prompts, streams), entry in sorted(pooled.items())
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "results", nargs="+", help="bench_engines.py JSON result files; FILE@PATH: that file's rows of PATH"
    )
    parser.add_argument("--path", default="gateway", help="the row's path to pool (default: gateway)")
    args = parser.parse_args(argv)
    results = []
    for item in args.results:
        # A run that measured the shipped worker under another path (a --compare-env worker) says so.
        name, _, path = item.partition("@")
        results.append((json.loads(Path(name).read_text()), path or args.path))
    for line in lines(pool(results)):
        print(line)


if __name__ == "__main__":
    main()
