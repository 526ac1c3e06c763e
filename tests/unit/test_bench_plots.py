"""bench/plots.py: the benchmarks' figures are real PNGs with the data they were given.

Runs matplotlib (Agg) in the pytest process and reads the written files back.
"""

from __future__ import annotations

from pathlib import Path

import pytest

plots = pytest.importorskip("bench.plots", reason="matplotlib is not installed (test extra)")


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_concurrency_plot_writes_both_panels(tmp_path: Path) -> None:
    series = {
        "raw": [{"concurrency": c, "tok_s": 100.0 * c, "ttft_ms": 5.0 * c} for c in (1, 2, 4, 8)],
        "gateway": [{"concurrency": c, "tok_s": 95.0 * c, "ttft_ms": 6.0 * c} for c in (8, 4, 2, 1)],
    }
    out = plots.concurrency_plot(series, "title", "machine, date", tmp_path / "deep" / "bench.png")
    width, height = png_size(out)
    assert out == tmp_path / "deep" / "bench.png" and width > 2 * height > 600  # two panels side by side


def test_timeline_plot_with_events(tmp_path: Path) -> None:
    rows = [
        {
            "t_s": 5.0 + 10 * i,
            "ok": 10,
            "clean_errors": i % 2,
            "unclean_errors": 0,
            "p50_ms": 50.0,
            "p99_ms": 90.0,
        }
        for i in range(6)
    ]
    out = plots.timeline_plot(rows, "soak", "machine, date", tmp_path / "soak.png", events=[(30.0, "kill a")])
    width, height = png_size(out)
    assert width > 600 and height > 400


def test_timeline_plot_with_resources_adds_a_panel(tmp_path: Path) -> None:
    rows = [{"t_s": 5.0 + 10 * i, "ok": 10, "clean_errors": 0, "unclean_errors": 0, "p50_ms": 50.0,
             "p99_ms": 90.0} for i in range(30)]  # fmt: skip
    samples = [{"t_s": 10.0 * i, "rss_mib": 60 + i / 10, "fds": 40 + i % 3, "load1": 1.0} for i in range(30)]
    events = [(20.0 * i, "kill a" if i % 2 else "reload: change a") for i in range(1, 14)]
    two = plots.timeline_plot(rows, "soak", "machine, date", tmp_path / "two.png", events=events)
    three = plots.timeline_plot(
        rows, "soak", "machine, date", tmp_path / "three.png", events=events, resources=samples
    )
    # The soak labels its events "kill MODEL" and "reload: WHAT": each kind keeps its own colour.
    assert plots._event_colour("reload: change a") == plots.EVENT_COLOURS["reload"]
    assert plots._event_colour("kill a") == plots.EVENT_COLOURS["kill"]
    (width2, height2), (width3, height3) = png_size(two), png_size(three)
    assert height3 > height2 * 1.3 and abs(width3 - width2) < 0.2 * width2  # one more panel below
