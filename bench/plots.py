"""PNG plots for the benchmarks, written next to their tables (matplotlib, no display needed).

Runs in a benchmark's own process, after it measured. Owns two figure kinds every benchmark can
call with plain data:

- `concurrency_plot`: tokens/s and time to first token against concurrent requests, one line per
  path (raw engine, through the gateway, 1 vs 8 replicas...), each point a measured level;
- `timeline_plot`: a run over time (the soak): requests finished per interval by outcome, and
  latency percentiles, with markers for injected events (a worker killed, a reload), and when
  given, the process's resident memory and open file descriptors sampled over the run.

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
# Event lines by the first word of their label; anything else is drawn as a kill.
EVENT_COLOURS = {"kill": "#cf222e", "reload": "#0969da"}
LABELLED_EVENTS_MAX = 8  # more than this and labels overlap: the legend names the kinds instead


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
    resources: Sequence[Mapping[str, float]] = (),
) -> Path:
    """Per interval ({"t_s", "ok", "clean_errors", "unclean_errors", "p50_ms", "p99_ms"}): outcomes
    stacked, latency percentiles below; `events` are (seconds, label) drawn as vertical lines;
    `resources` ({"t_s", "rss_mib", "fds"} samples) add a third panel, RSS and descriptors."""
    panels = 3 if resources else 2
    figure, axes = plt.subplots(panels, 1, figsize=(11, 3 * panels), sharex=True, constrained_layout=True)
    counts, latency = axes[0], axes[1]
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
    latency.set_ylim(bottom=0)
    latency.legend(loc="upper right")
    if resources:
        _resources_panel(axes[2], resources)
    axes[-1].set_xlabel("seconds since start")
    for axis in axes:
        axis.grid(True, alpha=0.3)
        for at, label in events:
            axis.axvline(at, color=_event_colour(label), linestyle="--", linewidth=1)
    if len(events) <= LABELLED_EVENTS_MAX:
        for at, label in events:
            counts.annotate(label, (at, counts.get_ylim()[1]), fontsize=8, color=_event_colour(label),
                            ha="left", va="top")  # fmt: skip
    else:
        kinds = sorted({_event_kind(label) for _, label in events if _event_kind(label) in EVENT_COLOURS})
        text = ", ".join(f"{kind}s: {EVENT_COLOURS[kind]} dashes" for kind in kinds)
        counts.set_title(text.replace("#cf222e", "red").replace("#0969da", "blue"), fontsize=8, loc="left")
    figure.suptitle(title)
    figure.text(0.5, -0.02, footer, ha="center", fontsize=8, color="#555")
    return _save(figure, path)


def _resources_panel(axis: plt.Axes, samples: Sequence[Mapping[str, float]]) -> None:
    t = [s["t_s"] for s in samples]
    axis.plot(t, [s["rss_mib"] for s in samples], color="#8250df", label="RSS (MiB)")
    axis.set_ylabel("gateway RSS (MiB)")
    axis.set_ylim(bottom=0)
    fds = axis.twinx()
    fds.plot(t, [s["fds"] for s in samples], color="#6e7781", linestyle=":", label="open fds")
    fds.set_ylabel("open file descriptors")
    fds.set_ylim(bottom=0)
    lines = axis.get_lines() + fds.get_lines()
    axis.legend(lines, [str(line.get_label()) for line in lines], loc="lower right")


def _event_kind(label: str) -> str:
    """ "reload: change a" -> "reload"; "kill a" -> "kill"."""
    return label.split()[0].rstrip(":") if label.strip() else ""


def _event_colour(label: str) -> str:
    return EVENT_COLOURS.get(_event_kind(label), EVENT_COLOURS["kill"])


def _save(figure: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path
