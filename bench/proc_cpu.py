"""CPU time of processes and of the whole host, read from /proc.

Imported by the benchmark processes under bench/; owns no state. utime + stime count in clock
ticks (10 ms), enough over a burst of many tokens; schedstat counts nanoseconds on a CPU per
thread, precise enough for one stream.
"""

from __future__ import annotations

import os
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


def busy_seconds() -> float:
    """CPU seconds spent by the whole machine (every core, not idle or iowait), from /proc/stat."""
    with open("/proc/stat") as stat:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, stat.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / TICK
