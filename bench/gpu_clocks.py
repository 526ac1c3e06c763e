"""The GPU's clocks and power over a benchmark run, to put beside each round's rate.

Imported by bench/bench_engines.py (a standalone benchmark process on a GPU host). Owns one
`nvidia-smi` child that prints GPU 0's SM and memory clocks, power, utilization and free memory
every 100 ms, and a thread that stamps each line as it arrives. A CPU-bound step at one stream
leaves the GPU idle between kernels, and a GPU that lowers its clocks when idle slows the next step:
the rounds of one path move between speeds 1.5-1.8x apart, and this says whether the GPU's clocks
moved with them.
The least free memory in a round says whether the processes sharing the GPU (the library's, every
worker's) left each other room: a process whose allocator runs short frees and retries in its steps.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from dataclasses import dataclass

FIELDS = "clocks.sm,clocks.mem,power.draw,utilization.gpu,memory.free"


@dataclass(frozen=True)
class Sample:
    at: float  # time.perf_counter() when the line arrived
    sm_mhz: float
    mem_mhz: float
    power_w: float
    busy_pct: float
    free_mib: float


def parse(line: str, at: float) -> Sample | None:
    """'1980, 2619, 312.45, 97, 5120' -> a sample; None for a line nvidia-smi could not fill in."""
    try:
        sm, mem, power, busy, free = (float(part) for part in line.split(","))
    except ValueError:
        return None
    return Sample(at, sm, mem, power, busy, free)


def window(samples: list[Sample], start: float, end: float) -> dict[str, float] | None:
    """Means over the samples taken between start and end, and the least free memory; None when
    there were none."""
    inside = [s for s in samples if start <= s.at <= end]
    if not inside:
        return None
    return {
        "sm_mhz": round(sum(s.sm_mhz for s in inside) / len(inside)),
        "mem_mhz": round(sum(s.mem_mhz for s in inside) / len(inside)),
        "power_w": round(sum(s.power_w for s in inside) / len(inside), 1),
        "busy_pct": round(sum(s.busy_pct for s in inside) / len(inside), 1),
        "free_mib_min": min(s.free_mib for s in inside),
    }


class GpuClocks:
    """Samples while open; `between(start, end)` gives a round's means. Without nvidia-smi on
    the host it samples nothing, and every round's figure is None."""

    def __init__(self, interval_ms: int = 100) -> None:
        self.interval_ms = interval_ms
        self.samples: list[Sample] = []
        self._process: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> GpuClocks:
        binary = shutil.which("nvidia-smi")
        if binary is None:
            return self
        command = [binary, "--id=0", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits",
                   f"-lms={self.interval_ms}"]  # fmt: skip
        self._process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        self._reader = threading.Thread(target=self._read, name="gpu-clocks", daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            sample = parse(line, time.perf_counter())
            if sample is not None:
                self.samples.append(sample)  # list.append is atomic; readers copy the list first

    def between(self, start: float, end: float) -> dict[str, float] | None:
        return window(list(self.samples), start, end)

    def __exit__(self, *exc: object) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
