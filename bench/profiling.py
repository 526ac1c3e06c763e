"""Where the time goes: py-spy samples of the benchmark's processes during one round.

Imported by bench/bench_engines.py (the benchmark process on a GPU host). Owns the py-spy runs
(one per process, sampling from outside at 1 kHz, `--nonblocking`, so the process runs as usual)
and their reduction to a short summary per process: the share of non-idle samples in each of the
functions that take most of it, inclusive (a function and what it calls) and by itself.
"""

from __future__ import annotations

import collections
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

IDLE_FRAMES = ("select", "poll", "epoll", "wait", "sleep", "recv")


class Profiler:
    def __init__(self, py_spy: str, out_dir: Path) -> None:
        self.py_spy, self.out_dir = py_spy, out_dir
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.summaries: dict[str, Any] = {}

    @contextmanager
    def record(self, label: str, pids: dict[str, int]) -> Iterator[None]:
        spies = {}
        for name, pid in pids.items():
            out = self.out_dir / f"{label}-{name}.txt"
            command = [self.py_spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "1000",
                       "--nonblocking", "--threads", "-o", str(out)]  # fmt: skip
            spies[name] = (subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), out)
        try:
            yield
        finally:
            for name, (spy, out) in spies.items():
                spy.send_signal(signal.SIGINT)
                try:
                    _, err = spy.communicate(timeout=60)
                except subprocess.TimeoutExpired:
                    spy.kill()
                    err = b"timed out"
                summary = summarize(out) if out.exists() else {"error": err.decode(errors="replace")[-500:]}
                self.summaries[f"{label} {name}"] = summary


def summarize(path: Path, top: int = 25) -> dict[str, Any]:
    """Shares of the non-idle samples, by function: inclusive and self."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = idle = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        samples, frames = int(count), stack.split(";")
        total += samples
        if any(word in frames[-1].split(" (")[0].lower() for word in IDLE_FRAMES):
            idle += samples
            continue
        own[frames[-1]] += samples
        for frame in set(frames):
            inclusive[frame] += samples
    busy = max(total - idle, 1)

    def shares(counter: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(frame, round(100 * n / busy, 1)) for frame, n in counter.most_common(top)]

    return {"samples": total, "idle": idle, "inclusive_pct": shares(inclusive), "self_pct": shares(own)}
