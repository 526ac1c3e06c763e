"""CPU time of processes and of the whole host, read from /proc.

Imported by the benchmark processes under bench/; owns no state. utime + stime count in clock
ticks (10 ms), enough over a burst of many tokens; schedstat counts nanoseconds on a CPU per
thread, precise enough for one stream.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def user_system_seconds(pid: int) -> tuple[float, float]:
    """utime and stime of a whole process (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()  # comm may hold spaces; cut after it
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def cpu_seconds(pid: int) -> float:
    """utime + stime of a whole process."""
    return sum(user_system_seconds(pid))


def run_seconds(pid: int) -> float:
    """Time every live thread of a process spent on a CPU, in ns resolution (schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
    return total / 1e9


def steal_seconds() -> float:
    """CPU seconds the hypervisor ran something else while this host's CPUs wanted to run (steal),
    summed over every core, from /proc/stat; 0 on bare metal."""
    with open("/proc/stat") as stat:
        return int(stat.readline().split()[8]) / TICK


def busy_seconds() -> float:
    """CPU seconds spent by the whole machine (every core, not idle or iowait), from /proc/stat."""
    with open("/proc/stat") as stat:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, stat.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / TICK


@dataclass(frozen=True)
class ThreadTimes:
    """One thread's counters: its name, time on a CPU and waiting for one (ns, schedstat), and its
    voluntary (it slept: a lock such as the GIL, a sync, I/O) and involuntary (preempted) switches."""

    name: str
    on_cpu_ns: int
    runqueue_ns: int
    voluntary: int
    involuntary: int


def thread_times(pid: int) -> dict[int, ThreadTimes]:
    """Every live thread of a process, by thread id."""
    threads = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            on_cpu, runqueue = (int(v) for v in (task / "schedstat").read_text().split()[:2])
            switches = {}
            for line in (task / "status").read_text().splitlines():
                if "ctxt_switches" in line:
                    key, value = line.split(":")
                    switches[key.strip()] = int(value)
            name = (task / "comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError, ValueError):  # a thread that ended meanwhile
            continue
        threads[int(task.name)] = ThreadTimes(
            name, on_cpu, runqueue, switches.get("voluntary_ctxt_switches", 0),
            switches.get("nonvoluntary_ctxt_switches", 0),
        )  # fmt: skip
    return threads


def thread_usage(
    pid: int, before: dict[int, ThreadTimes], after: dict[int, ThreadTimes], seconds: float
) -> dict[str, float | dict[str, float]]:
    """What a process's threads did over `seconds` of wall time: its main thread (the one that drives
    the engine, in a worker and in the benchmark's raw path) on a CPU and waiting for one, in % of
    the wall time, and its voluntary and involuntary switches per second; the other threads' CPU %,
    in all and by name."""
    main_before, main_after = before.get(pid), after.get(pid)
    usage: dict[str, float | dict[str, float]] = {}
    if main_before and main_after and seconds > 0:
        usage["main_on_cpu_pct"] = round(
            100 * (main_after.on_cpu_ns - main_before.on_cpu_ns) / 1e9 / seconds, 1
        )
        usage["main_runqueue_pct"] = round(
            100 * (main_after.runqueue_ns - main_before.runqueue_ns) / 1e9 / seconds, 1
        )
        usage["main_sleeps_per_s"] = round((main_after.voluntary - main_before.voluntary) / seconds, 1)
        usage["main_preempted_per_s"] = round((main_after.involuntary - main_before.involuntary) / seconds, 1)
    others: dict[str, float] = {}
    for tid, times in after.items():
        if tid == pid:
            continue
        start = before.get(tid)
        spent = times.on_cpu_ns - (start.on_cpu_ns if start else 0)
        if spent > 0 and seconds > 0:
            others[times.name] = others.get(times.name, 0.0) + 100 * spent / 1e9 / seconds
    usage["others_cpu_pct"] = round(sum(others.values()), 1)
    usage["others_by_name"] = {k: round(v, 1) for k, v in sorted(others.items(), key=lambda kv: -kv[1])[:4]}
    return usage
