"""The gateway process's resources over a soak: resident memory and open file descriptors.

Runs in the soak process (bench/soak.py), on its asyncio loop; reads /proc (Linux) for the
gateway's pid every few seconds. Owns the samples and their summary against the soak's targets:
RSS growth after the first minutes under 5%, and a flat descriptor count. Each sample also carries
the host's 1-minute load average, since other work on the machine slows everything the soak times.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

RSS_GROWTH_TARGET_PCT = 5.0
FDS_FLAT_MARGIN = 50  # fds above the lowest count still counted as flat (clients' keep-alives)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def sample(pid: int, started: float) -> dict[str, float]:
    return {
        "t_s": round(time.monotonic() - started, 1),
        "rss_mib": round(rss_kib(pid) / 1024, 2),
        "fds": open_fds(pid),
        "load1": load_average(),
    }


async def sample_forever(pid: int, started: float, every_s: float, samples: list[dict[str, float]]) -> None:
    """Append a sample now and every `every_s` until cancelled (the soak's end)."""
    while True:
        samples.append(sample(pid, started))
        await asyncio.sleep(every_s - (time.monotonic() - started) % every_s)


def summary(samples: list[dict[str, float]], baseline_after_s: float) -> dict[str, Any]:
    """RSS at the first sample after `baseline_after_s` and at the end, the growth between them,
    descriptors' range, and whether the targets were met."""
    if not samples:
        return {}
    later = [s for s in samples if s["t_s"] >= baseline_after_s] or samples[-1:]
    base, end = later[0], samples[-1]
    growth = 100.0 * (end["rss_mib"] - base["rss_mib"]) / base["rss_mib"] if base["rss_mib"] else 0.0
    fds = [int(s["fds"]) for s in samples]
    loads = [s["load1"] for s in samples]
    return {
        "baseline_t_s": base["t_s"],
        "rss_mib_first": samples[0]["rss_mib"],
        "rss_mib_baseline": base["rss_mib"],
        "rss_mib_end": end["rss_mib"],
        "rss_mib_max": max(s["rss_mib"] for s in samples),
        "rss_growth_pct_after_baseline": round(growth, 2),
        "fds_min": min(fds),
        "fds_max": max(fds),
        "fds_first": fds[0],
        "fds_end": fds[-1],
        "load1_mean": round(sum(loads) / len(loads), 2),
        "load1_max": max(loads),
        "rss_target_met": growth < RSS_GROWTH_TARGET_PCT,
        "fds_flat": max(fds) - min(fds) <= FDS_FLAT_MARGIN and fds[-1] <= fds[0] + FDS_FLAT_MARGIN,
    }
