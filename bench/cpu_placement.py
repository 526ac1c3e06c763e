"""CPU placement for the GPU benchmark: which cores the worker, the gateway and the client run on.

Imported by bench/bench_engines.py (a standalone benchmark process on a GPU host). Owns the host's
core topology (SMT siblings), pinning the threads of a process (or one of them) to a set of CPUs, and
a sampler that watches, while a round runs, which CPUs the engine thread ran on and whether another
busy thread shared its physical core. An exllama step beyond a batch of 8 is CPU-bound Python, so a sibling
hyperthread busy with the client or the gateway slows every step of that round.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path


def physical_cores() -> dict[int, int]:
    """cpu -> the lowest cpu of its physical core (its SMT siblings map to the same number)."""
    cores = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            cores[cpu] = min(_cpu_list(siblings.read_text()))
        except (OSError, ValueError):
            cores[cpu] = cpu
    return cores


def _cpu_list(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus


def topology() -> dict[str, object]:
    cores = physical_cores()
    model = ""
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))  # fmt: skip
    except (OSError, StopIteration):
        pass
    return {"cpus": len(cores), "physical_cores": len(set(cores.values())), "model": model}


def split_cores() -> tuple[set[int], set[int]]:
    """(the worker's CPUs: one whole physical core, the last; every other CPU) for pinned rounds."""
    cores = physical_cores()
    last = max(cores.values())
    own = {cpu for cpu, core in cores.items() if core == last}
    return own, set(cores) - own


def _threads(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def named_threads(pid: int, name: str) -> list[int]:
    """The process's threads that the operating system knows by this name (model_worker.native_names)."""
    found = []
    for tid in _threads(pid):
        try:
            if Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() == name:
                found.append(tid)
        except OSError:  # a thread that ended meanwhile
            pass
    return found


def pin(pid: int, cpus: Iterable[int]) -> None:
    """Every thread of the process (threads made later inherit from their creator)."""
    wanted = set(cpus)
    for tid in _threads(pid):
        try:
            os.sched_setaffinity(tid, wanted)
        except OSError:  # a thread that ended meanwhile
            pass


@contextmanager
def placed(
    placement: dict[int, set[int]], threads: dict[tuple[int, int], set[int]] | None = None
) -> Iterator[None]:
    """Pin each pid's threads to its CPUs for the block, then each (pid, tid) of `threads` to its
    own; afterwards every thread may run anywhere again."""
    everywhere = set(physical_cores())
    for pid, cpus in placement.items():
        pin(pid, cpus)
    for (_pid, tid), cpus in (threads or {}).items():
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # the thread ended meanwhile
            pass
    try:
        yield
    finally:
        for pid in placement:
            pin(pid, everywhere)


class SiblingWatch:
    """Samples, every 20 ms, the CPU of the worker's engine thread and of every running thread of
    the other processes; counts the samples in which one of them ran on the same physical core.
    The sampler is a process of its own: a thread here would see this process's other threads
    only while they wait for its GIL, never running."""

    def __init__(self, engine_thread: tuple[int, int], others: list[int], min_samples: int = 0) -> None:
        pid, tid = engine_thread
        # At its end it goes on until it holds min_samples (for at most 10 s more).
        self._command = [sys.executable, str(Path(__file__).resolve()), str(pid), str(tid), str(min_samples),
                         *(str(other) for other in others)]  # fmt: skip
        self._process: subprocess.Popen[str] | None = None
        self.samples = 0
        self.shared = 0
        self.cpus: dict[int, int] = {}  # CPU -> samples in which the engine thread ran there

    def __enter__(self) -> SiblingWatch:
        self._process = subprocess.Popen(
            self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._process is not None
        out, _ = self._process.communicate("", timeout=30)  # its stdin closes: it reports and ends
        samples, shared, *cpus = out.split()
        self.samples, self.shared = int(samples), int(shared)
        self.cpus = {int(cpu): int(count) for cpu, count in (item.split(":") for item in cpus)}

    @property
    def shared_fraction(self) -> float | None:
        return round(self.shared / self.samples, 3) if self.samples else None

    @property
    def main_cpu(self) -> tuple[int, float] | None:
        """The CPU the engine thread ran on most, and the share of the samples it ran there."""
        if not self.samples:
            return None
        cpu, count = max(self.cpus.items(), key=lambda item: item[1])
        return cpu, round(count / self.samples, 3)


def _watch(
    engine: tuple[int, int], others: list[int], stop: threading.Event, min_samples: int
) -> tuple[int, int, dict[int, int]]:
    cores = physical_cores()
    samples = shared = 0
    cpus: dict[int, int] = {}
    deadline: float | None = None
    while not stop.wait(0.02) or samples < min_samples:
        if stop.is_set():  # stop.wait() no longer paces the samples
            deadline = deadline or time.monotonic() + 10.0
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        cpu = _running_cpu(*engine)
        if cpu is None:
            continue
        samples += 1
        cpus[cpu] = cpus.get(cpu, 0) + 1
        core = cores.get(cpu)
        running = (_running_cpu(pid, tid) for pid in others for tid in _threads(pid) if (pid, tid) != engine)
        if any(other is not None and cores.get(other) == core for other in running):
            shared += 1
    return samples, shared, cpus


def _running_cpu(pid: int, tid: int) -> int | None:
    """The CPU a thread runs on now, or None when it is not running."""
    try:
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[36]) if fields[0] == "R" else None


if __name__ == "__main__":  # the sampler process: ENGINE_PID ENGINE_TID OTHER_PID...; stops at stdin's end
    stop = threading.Event()

    def stop_at_end_of_input() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=stop_at_end_of_input, daemon=True).start()
    pid, tid, min_samples, *rest = (int(arg) for arg in sys.argv[1:])
    samples, shared, cpus = _watch((pid, tid), rest, stop, min_samples)
    print(samples, shared, *(f"{cpu}:{count}" for cpu, count in sorted(cpus.items())))
