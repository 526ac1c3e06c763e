"""Synthetic neighbours for the GPU benchmark: processes that wake up and use a CPU about as often
and as long as the gateway and the benchmark's client do per token, without a GPU, a socket or a
shared GIL.

Started by bench/bench_engines.py (`--neighbours`), each as its own process
(`python -m bench.neighbours PERIOD_MS:BUSY_US`), and held stopped (SIGSTOP) except during the
rounds of the path "raw, neighbours". Owns only those processes. The question they answer: does the
library's own loop, CPU-bound Python at one stream, slow down when other cores of the host wake up
about once per token, as they do on the gateway path, though nothing shares its core or its GIL?
(Cores that wake can take the host's power or cache from the busy one.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.proc_cpu import cpu_seconds

REPO_ROOT = Path(__file__).resolve().parent.parent

# A reply's worth of JSON, like what the gateway and the client encode and parse per token.
PAYLOAD = {
    "id": "cmpl-0123456789abcdef",
    "object": "text_completion",
    "choices": [{"index": 0, "text": " token", "logprobs": None, "finish_reason": None}],
    "usage": {"prompt_tokens": 64, "completion_tokens": 1, "total_tokens": 65},
    "padding": ["x" * 64] * 16,
}


@dataclass(frozen=True)
class Load:
    """One neighbour: wakes every period_ms and then keeps a CPU busy for busy_us."""

    period_ms: float
    busy_us: float

    @classmethod
    def parse(cls, text: str) -> Load:
        period, sep, busy = text.partition(":")
        if not sep:
            raise ValueError(f"a neighbour is PERIOD_MS:BUSY_US, not {text!r}")
        load = cls(float(period), float(busy))
        if load.period_ms <= 0 or not 0 <= load.busy_us < 1000 * load.period_ms:
            raise ValueError(f"a neighbour needs 0 <= busy < period: {text!r}")
        return load


def parse_loads(text: str) -> list[Load]:
    """'25:600,25:340' -> two neighbours."""
    return [Load.parse(part) for part in text.split(",") if part.strip()]


def run(load: Load) -> None:
    """The neighbour's loop, until it is killed: busy, then asleep until the next period."""
    period_s, busy_s = load.period_ms / 1000, load.busy_us / 1e6
    next_wake = time.perf_counter()
    while True:
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:
            json.loads(json.dumps(PAYLOAD))
        next_wake += period_s
        delay = next_wake - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        else:  # behind (or just resumed from a stop): start the periods again from now
            next_wake = time.perf_counter()


class Neighbours:
    """The neighbour processes, started stopped; `awake()` lets them run for a block."""

    def __init__(self, loads: list[Load]) -> None:
        self.loads = loads
        self._processes: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Neighbours:
        for load in self.loads:
            process = subprocess.Popen(
                [sys.executable, "-m", "bench.neighbours", f"{load.period_ms}:{load.busy_us}"], cwd=REPO_ROOT
            )
            self._processes.append(process)
            os.kill(process.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self._processes:
            process.kill()  # SIGKILL ends a stopped process too
            process.wait()
        self._processes.clear()

    @contextmanager
    def awake(self) -> Iterator[None]:
        for process in self._processes:
            os.kill(process.pid, signal.SIGCONT)
        try:
            yield
        finally:
            for process in self._processes:
                os.kill(process.pid, signal.SIGSTOP)

    def cpu_seconds(self) -> float:
        """What the neighbours have used so far, to show that they ran."""
        return sum(cpu_seconds(process.pid) for process in self._processes)


if __name__ == "__main__":
    run(Load.parse(sys.argv[1]))
