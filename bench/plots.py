"""PNG plots for the benchmarks, written next to their tables (matplotlib, no display needed).

Runs in a benchmark's own process, after it measured. Owns two figure kinds every benchmark can
call with plain data:

- `concurrency_plot`: tokens/s and time to first token against concurrent requests, one line per
  path (raw engine, through the gateway, 1 vs 8 replicas...), each point a measured level;
- `timeline_plot`: a run over time (the soak): requests finished per interval by outcome, and
  latency percentiles, with markers for injected events (a worker killed).

Each returns the path it wrote. The figure's footer carries the machine and date the caller gives,
so a PNG that travels without its table still says where its figures come from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit

import matplotlib.pyplot as plt  # noqa: E402 (after choosing the backend)

# One point of a concurrency sweep: {"concurrency": int, "tok_s": float, "ttft_ms": float}.
Point = Mapping[str, float]


def concurrency_plot(series: Mapping[str, Sequence[Point]], title: str, footer: str, path: Path) -> Path:
    """tokens/s (total, all requests) and median time to first token against concurrency, per path."""
    figure, (speed, ttft) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    levels: set[float] = set()
    for name, points in series.items():
        ordered = sorted(points, key=lambda p: p["concurrency"])
        x = [p["concurrency"] for p in ordered]
        levels.update(x)
        speed.plot(x, [p["tok_s"] for p in ordered], marker="o", label=name)
        ttft.plot(x, [p["ttft_ms"] for p in ordered], marker="o", label=name)
    for axis, label in ((speed, "tokens/s, all requests"), (ttft, "time to first token, median (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(sorted(levels), [f"{int(v)}" for v in sorted(levels)])
        axis.set_xlabel("concurrent requests")
        axis.set_ylabel(label)
        axis.set_ylim(bottom=0)
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.suptitle(title)
    figure.text(0.5, -0.02, footer, ha="center", fontsize=8, color="#555")
    return _save(figure, path)


def timeline_plot(
    intervals: Sequence[Mapping[str, float]],
    title: str,
    footer: str,
    path: Path,
    events: Sequence[tuple[float, str]] = (),
) -> Path:
    """Per interval ({"t_s", "ok", "clean_errors", "unclean_errors", "p50_ms", "p99_ms"}): outcomes
    stacked, latency percentiles below; `events` are (seconds, label) drawn as vertical lines."""
    figure, (counts, latency) = plt.subplots(2, 1, figsize=(11, 6), sharex=True, constrained_layout=True)
    t = [i["t_s"] for i in intervals]
    width = (t[1] - t[0]) * 0.9 if len(t) > 1 else 1.0
    ok = [i["ok"] for i in intervals]
    clean = [i["clean_errors"] for i in intervals]
    unclean = [i["unclean_errors"] for i in intervals]
    counts.bar(t, ok, width, label="succeeded", color="#1a7f37")
    counts.bar(t, clean, width, bottom=ok, label="clean error (503 / SSE error)", color="#9a6700")
    counts.bar(t, unclean, width, bottom=[a + b for a, b in zip(ok, clean, strict=True)],
               label="unclean (reset, other 5xx)", color="#cf222e")  # fmt: skip
    counts.set_ylabel("requests finished")
    counts.legend(loc="upper right")
    latency.plot(t, [i["p50_ms"] for i in intervals], label="p50")
    latency.plot(t, [i["p99_ms"] for i in intervals], label="p99")
    latency.set_ylabel("request latency (ms)")
    latency.set_xlabel("seconds since start")
    latency.set_ylim(bottom=0)
    latency.legend(loc="upper right")
    for axis in (counts, latency):
        axis.grid(True, alpha=0.3)
        for at, _ in events:
            axis.axvline(at, color="#cf222e", linestyle="--", linewidth=1)
    for at, label in events:
        counts.annotate(label, (at, counts.get_ylim()[1]), fontsize=8, color="#cf222e", ha="left", va="top")
    figure.suptitle(title)
    figure.text(0.5, -0.02, footer, ha="center", fontsize=8, color="#555")
    return _save(figure, path)


def _save(figure: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path
