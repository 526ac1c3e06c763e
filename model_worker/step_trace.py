"""A per-step trace of a generation loop: where each iteration's time goes, as JSON lines.

Runs in the worker process (the serve loop) and in the benchmark's in-process paths, so both can be
compared line by line. Off by default: it is on only when GATEWAY_STEP_TRACE names a file (set it in
a model's registry `env`), and costs the loop one `is not None` test per iteration when off.

Each line is one iteration that stepped the engine:
  t           seconds since the trace started
  step_ms     wall time of the engine step (exllama's iterate())
  gpu_ms      GPU time between CUDA events recorded around the step (absent without CUDA)
  outside_ms  wall time of the loop between the previous step's end and this step's start
              (socket, admissions, encoding and sending frames, heartbeats)
  send_ms     handing this step's frame over to the link thread (the worker), or nothing (in-process)
  link_ms     the worker only: the longest time a frame taken since the previous line had waited,
              from its hand-over until the link thread took it (the thread's wake-up, and the GIL
              it shares with this thread); absent when the link thread took none meanwhile
  link_frames how many frames (steps' and heartbeats') the link thread took since the previous line;
              the last line also counts those it took after that line was due (a link thread that
              lagged behind the last steps), so every frame taken while the trace was on is counted
  sleeps      times this thread went to sleep during the step (voluntary context switches: a
              wait for the GIL, a lock, the GPU or I/O; Linux only)
  sleeps_outside  the same between the previous step's end and this step's start
  cpu_ms      CPU time this thread used during the step, user and system (Linux only): equal to
              step_ms when the step only computed; below it by what the thread waited (the GPU, the
              GIL, a lock); the same step costing more CPU in one process than in another means more
              work or slower execution there, not waiting
  sys_ms      the system (kernel) part of cpu_ms, as the kernel samples it by its clock ticks: a
              step reads a whole tick or none, so only a mean over many steps says how much
  preempted   times the scheduler took the CPU from this thread during the step while it could have
              run (involuntary context switches: another runnable thread on its CPU)
  faults      page faults this thread took during the step (minor ones: memory first touched or
              remapped, e.g. an allocator returning pages to the system and taking them back)
  jobs        jobs that produced output in this step
  tokens      tokens emitted in this step
  first       jobs whose first token came in this step (their prefill finished)
  prefill     prompt tokens the engine ingested by prefill in this step (engines that count them:
              model_worker.engines.base.CountsPrefill; for the exllama libraries, from their
              progress reports, where a prefix found in their cache counts in a job's first report)
  cached      of those, the prompt tokens the engine found in its prefix cache instead of computing
              them, counted in the step that gave each job its first token (exllama: the pages and
              partial page each job reused)
  alloc_retries  CUDA only: times torch's caching allocator failed to find memory for this step and
              freed its cached blocks to try again (each a device-wide synchronization); a process
              squeezed by others on the same GPU shows it
  device_allocs  CUDA only: cudaMalloc and cudaFree calls the allocator made in this step (none, once
              the loop is warm, when the process has room)
  gather_ms   the worker only, on the first step after it was idle and gathered a burst
              (limits.burst_gather_ms): how long it waited for the burst's other jobs (part of
              outside_ms)
  gather_end  why that wait ended: "told" (the gateway's last Generate said no other request was
              being admitted, and no prompt was being prepared), "quiet" (no job came for a quarter
              of burst_gather_ms) or "limit" (burst_gather_ms in all)
"""

from __future__ import annotations

import collections
import json
import os
import resource
import time
from collections.abc import Callable, Sequence
from typing import IO, Any, NamedTuple

TRACE_VARIABLE = "GATEWAY_STEP_TRACE"


class StepTrace:
    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", buffering=1 << 16)  # noqa: SIM115 (closed in close())
        self._origin = time.perf_counter()
        self._last_end: float | None = None
        self._step_start = 0.0
        self._step_end = 0.0
        self._events: tuple[Any, Any] | None = None
        self._torch: Any = None
        try:
            import torch

            if torch.cuda.is_available():
                self._torch = torch
        except ImportError:
            pass
        self._pending: dict[str, Any] | None = None
        self._written: dict[str, Any] | None = None  # the last line, held back until the next or the close
        # Filled by the worker's link thread (LinkThread.trace_handoffs): seconds each frame waited.
        self.handoff_waits: collections.deque[float] = collections.deque()
        self._started_jobs: set[Any] = set()  # jobs that have produced a token and not finished
        self._prefill_counter: Callable[[], int] | None = None
        self._prefilled_before = 0
        self._cached_counter: Callable[[], int] | None = None
        self._cached_before = 0
        self._gather: tuple[float, str] | None = None
        self._allocator_counter: Callable[[], tuple[int, int]] | None = None
        self._allocations = (0, 0)
        self._usage_at_start = self._usage_at_end = _thread_usage()
        if self._torch is not None:
            self.count_allocations(_cuda_allocator_counts)

    @classmethod
    def from_environment(cls) -> StepTrace | None:
        path = os.environ.get(TRACE_VARIABLE)
        return cls(path) if path else None

    def count_prefill(self, counter: Callable[[], int], cached: Callable[[], int] | None = None) -> None:
        """Lines from now on say how many prompt tokens each step prefilled: the rise of
        `counter()` (a running total of prompt tokens ingested) across the step; with `cached` (a
        running total of those found in the engine's cache), how many of them were found."""
        self._prefill_counter = counter
        self._cached_counter = cached

    def count_allocations(self, counter: Callable[[], tuple[int, int]]) -> None:
        """Lines from now on say how often the GPU memory allocator retried and called the device
        in each step: the rises of `counter()`'s running (retries, device mallocs + frees)."""
        self._allocator_counter = counter
        self._allocations = counter()

    def note_gather(self, seconds: float, reason: str) -> None:
        """The loop waited `seconds` for a burst's jobs before the next step, and stopped for `reason`."""
        self._gather = (seconds, reason)

    def before_step(self) -> None:
        if self._prefill_counter is not None:
            self._prefilled_before = self._prefill_counter()
        if self._cached_counter is not None:
            self._cached_before = self._cached_counter()
        self._usage_at_start = _thread_usage()
        self._step_start = time.perf_counter()
        if self._torch is not None:
            start, end = (self._torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            self._events = (start, end)

    def after_step(self, outputs: Sequence[tuple[Any, int, bool]]) -> None:
        """`outputs`: (job id, tokens emitted, finished) for each job with output in this step."""
        self._step_end = time.perf_counter()
        usage = _thread_usage()
        start = self._usage_at_start
        first_tokens = 0
        for job, tokens, finished in outputs:
            if tokens and job not in self._started_jobs:
                first_tokens += 1
                self._started_jobs.add(job)
            if finished:
                self._started_jobs.discard(job)
        line: dict[str, Any] = {
            "t": round(self._step_start - self._origin, 6),
            "step_ms": round((self._step_end - self._step_start) * 1000, 3),
            "outside_ms": None
            if self._last_end is None
            else round((self._step_start - self._last_end) * 1000, 3),
            "sleeps": usage.sleeps - start.sleeps,
            "sleeps_outside": None if self._last_end is None else start.sleeps - self._usage_at_end.sleeps,
            "cpu_ms": round((usage.cpu_s - start.cpu_s) * 1000, 3),
            "sys_ms": round((usage.system_s - start.system_s) * 1000, 3),
            "preempted": usage.preempted - start.preempted,
            "faults": usage.faults - start.faults,
            "jobs": len(outputs),
            "tokens": sum(tokens for _, tokens, _ in outputs),
            "first": first_tokens,
        }
        if self._prefill_counter is not None:
            line["prefill"] = self._prefill_counter() - self._prefilled_before
        if self._cached_counter is not None:
            line["cached"] = self._cached_counter() - self._cached_before
        if self._gather is not None:
            line["gather_ms"], line["gather_end"] = round(self._gather[0] * 1000, 3), self._gather[1]
            self._gather = None
        if self._events is not None:
            start, end = self._events
            end.record()
            end.synchronize()  # the step has already read its tokens back: this waits for nothing
            line["gpu_ms"] = round(start.elapsed_time(end), 3)
        if self._allocator_counter is not None:
            counts = self._allocator_counter()
            line["alloc_retries"] = counts[0] - self._allocations[0]
            line["device_allocs"] = counts[1] - self._allocations[1]
            self._allocations = counts
        self._pending = line
        self._last_end = self._step_end
        self._usage_at_end = usage

    def after_send(self) -> None:
        """The step's frame is out (or there was none): write its line."""
        if self._pending is None:
            return
        now = time.perf_counter()
        self._pending["send_ms"] = round((now - self._step_end) * 1000, 3)
        self._add_link_waits(self._pending)
        self._last_end = now
        self._write_held()
        self._written, self._pending = self._pending, None

    def _add_link_waits(self, line: dict[str, Any]) -> None:
        waits = [self.handoff_waits.popleft() for _ in range(len(self.handoff_waits))]
        if waits:
            line["link_ms"] = max(line.get("link_ms", 0.0), round(max(waits) * 1000, 3))
            line["link_frames"] = line.get("link_frames", 0) + len(waits)

    def _write_held(self) -> None:
        if self._written is not None:
            self._file.write(json.dumps(self._written, separators=(",", ":")) + "\n")
            self._written = None

    def close(self) -> None:
        self.after_send()
        if self._written is not None:  # frames the link thread took after the last line was due
            self._add_link_waits(self._written)
        self._write_held()
        self._file.close()


class ThreadUsage(NamedTuple):
    """The calling thread's running totals, from one getrusage(RUSAGE_THREAD)."""

    sleeps: int  # voluntary context switches
    preempted: int  # involuntary context switches
    cpu_s: float  # user and system, exact (the scheduler's own runtime, not sampled by ticks)
    system_s: float  # sampled by the kernel's ticks: whole steps of 1-4 ms, right only on average
    faults: int  # minor and major page faults


_NO_USAGE = ThreadUsage(0, 0, 0.0, 0.0, 0)  # with cpu_s read on its own


def _thread_usage() -> ThreadUsage:
    """The calling thread's totals so far; zeros where the system does not count them per thread."""
    try:
        u = resource.getrusage(resource.RUSAGE_THREAD)
    except (AttributeError, OSError):
        return _NO_USAGE._replace(cpu_s=time.thread_time())
    return ThreadUsage(u.ru_nvcsw, u.ru_nivcsw, time.thread_time(), u.ru_stime, u.ru_minflt + u.ru_majflt)


def _cuda_allocator_counts() -> tuple[int, int]:
    """torch's caching allocator, this process's current device: retries after a failed allocation,
    and its calls to cudaMalloc and cudaFree."""
    import torch

    stats = torch.cuda.memory_stats_as_nested_dict()  # unflattened: the three are top-level counts
    return stats.get("num_alloc_retries", 0), stats.get("num_device_alloc", 0) + stats.get(
        "num_device_free", 0
    )


def summarize(path: str) -> dict[str, Any]:
    """Medians of a trace's lines, overall and by batch size (for the benchmark's report)."""
    with open(path) as trace:
        lines = [json.loads(line) for line in trace if line.strip()]
    if not lines:
        return {"steps": 0}

    def median(values: list[Any]) -> float | None:
        known = sorted(float(v) for v in values if v is not None)
        return known[len(known) // 2] if known else None

    def figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "steps": len(rows),
            "step_ms_p50": median([r["step_ms"] for r in rows]),
            "gpu_ms_p50": median([r.get("gpu_ms") for r in rows]),
            "outside_ms_p50": median([r["outside_ms"] for r in rows]),
            "send_ms_p50": median([r.get("send_ms") for r in rows]),
            "link_ms_p50": median([r.get("link_ms") for r in rows]),
            "tokens_per_step": round(sum(r["tokens"] for r in rows) / len(rows), 2),
            # Means, not medians: most steps sleep 0 or 1 times, and the figure is what they add up to.
            "sleeps_per_step": mean([r.get("sleeps") for r in rows]),
            "sleeps_outside_per_step": mean([r.get("sleeps_outside") for r in rows]),
            "cpu_ms_p50": median([r.get("cpu_ms") for r in rows]),
            "sys_ms_p50": median([r.get("sys_ms") for r in rows]),
            "preempted_per_step": mean([r.get("preempted") for r in rows]),
            "faults_per_step": mean([r.get("faults") for r in rows]),
            "alloc_retries": sum(r.get("alloc_retries", 0) for r in rows),
            "device_allocs": sum(r.get("device_allocs", 0) for r in rows),
        }

    def mean(values: list[Any]) -> float | None:
        known = [float(v) for v in values if v is not None]
        return round(sum(known) / len(known), 3) if known else None

    by_jobs: dict[int, list[dict[str, Any]]] = {}
    for row in lines:
        by_jobs.setdefault(row["jobs"], []).append(row)
    busiest = max(by_jobs)
    return {"all": figures(lines), "busiest": {"jobs": busiest, **figures(by_jobs[busiest])}}
