"""What handing each step's frame to another thread costs a GIL-bound engine thread, on the CPU.

Runs as its own process (its main thread is the engine thread) beside bench/link_sink.py's sink
process; needs no GPU. Owns a stand-in for an exllama step beyond a batch of 8, where the step is
CPU-bound Python: per job a few small torch ops (each lets go of the GIL and takes it back, as a
kernel launch does) and a little Python, then a GIL-free stretch like the wait for the GPU. Every
round runs the same steps with no frame (`none`) and with each step's Step frame sent by each mode
of bench/link_sink.py (`link`: the worker's own LinkThread; `link-beside`: the same on the engine
thread's core; `direct`: the engine thread itself; `take`, `take-send`: the floors of any second
thread), interleaved, every other round in reverse order, with the engine thread alone on the last
CPU (but for link-beside's link thread) and every other thread of both processes on the others.
Reports each mode's median step and its steps per second against `none` in the same round
(paired), and the engine thread's sleeps per step; writes a markdown table and JSON.

    .venv/bin/python bench/bench_link_handover.py --jobs 16,64 --rounds 12
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.cpu_placement import placed, split_cores, topology  # noqa: E402
from bench.link_sink import MODES, FrameSink  # noqa: E402
from bench.streams import median_interval  # noqa: E402
from wire.results import JobOutput  # noqa: E402

SENDING = ("link", "link-beside", "direct", "take-send")  # the modes whose frames reach the sink
SMALL = torch.randn(8, 8)
WAIT = torch.randn(192, 192)


def step(jobs: int, gil_free_ops: int) -> list[JobOutput]:
    """One stand-in engine step: GIL-bound launches per job, then a GIL-free stretch."""
    x = SMALL
    for job in range(jobs):
        for _ in range(4):
            x = torch.add(x, SMALL)
        _ = [job * i for i in range(40)]
    for _ in range(gil_free_ops):
        torch.mm(WAIT, WAIT)
    return [JobOutput(f"job-{job}", "tok", [job + 1]) for job in range(jobs)]


def sleeps_so_far() -> int:
    """The calling thread's voluntary context switches: how often it went to sleep (a GIL wait is one)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


def one_round(
    jobs: int, steps: int, gil_free_ops: int, send: Callable[[list[Any]], None] | None
) -> dict[str, float]:
    durations = []
    slept = sleeps_so_far()
    for _ in range(steps):
        started = time.perf_counter()
        outputs = step(jobs, gil_free_ops)
        if send is not None:
            send(outputs)
        durations.append(time.perf_counter() - started)
    return {
        "step_ms": 1000 * statistics.median(durations),
        "sleeps_per_step": (sleeps_so_far() - slept) / steps,
    }


def measure(args: argparse.Namespace, senders: dict[str, Callable[[list[Any]], None]]) -> dict[str, Any]:
    """Every level's rounds: {jobs: {mode: [round, ...]}}, each round a dict of one_round."""
    order = ["none", *senders]
    levels: dict[str, Any] = {}
    for jobs in args.jobs:
        for mode in order:  # a warm-up round of each
            one_round(jobs, max(args.steps // 4, 1), args.gil_free_ops, senders.get(mode))
        rounds: dict[str, list[dict[str, float]]] = {mode: [] for mode in order}
        for turn in range(args.rounds):
            for mode in order if turn % 2 == 0 else reversed(order):
                rounds[mode].append(one_round(jobs, args.steps, args.gil_free_ops, senders.get(mode)))
        levels[str(jobs)] = rounds
        print(f"bench: {jobs} jobs done", flush=True)
    return levels


def summarize(rounds: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    base = [r["step_ms"] for r in rounds["none"]]
    summary = {}
    for mode, results in rounds.items():
        steps = [r["step_ms"] for r in results]
        # Steps per second against `none` in the same turn: the host's speed drifts between turns.
        ratios = sorted(b / s for b, s in zip(base, steps, strict=True))
        summary[mode] = {
            "step_ms_p50": statistics.median(steps),
            "step_ms_rounds": [round(s, 4) for s in steps],
            "sleeps_per_step": statistics.median(r["sleeps_per_step"] for r in results),
            "paired_ratio": statistics.median(ratios),
            "paired_ratio_min": ratios[0],
            "paired_ratio_max": ratios[-1],
            "paired_ratio_ci95": median_interval(ratios),
        }
    return summary


def report(result: dict[str, Any]) -> str:
    settings, cpu = result["settings"], result["cpu"]
    lines = [
        f"{cpu['model']} ({cpu['cpus']} CPUs) | {result['date']} | Python {result['python']} | "
        f"torch {result['torch']} | {settings['rounds']} interleaved rounds of {settings['steps']} "
        f"steps per mode, {settings['gil_free_ops']} GIL-free ops per step | "
        f"engine thread pinned: {result['pinned']}",
        "",
        "| jobs | mode | median step ms (rounds' min-max) | steps/s against none, paired (min-max) "
        "| engine sleeps per step |",
        "|---|---|---|---|---|",
    ]
    for jobs, summary in result["levels"].items():
        for mode, row in summary.items():
            rounds = row["step_ms_rounds"]
            lines.append(
                f"| {jobs} | {mode} | {row['step_ms_p50']:.3f} ({min(rounds):.3f}-{max(rounds):.3f}) | "
                f"{row['paired_ratio']:.3f} ({row['paired_ratio_min']:.3f}-{row['paired_ratio_max']:.3f}) | "
                f"{row['sleeps_per_step']:.2f} |"
            )
    lines += ["", f"Frames sent: {result['frames_sent']}; taken by the sink: {result['frames_taken']}."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=150, help="steps per round")
    parser.add_argument("--gil-free-ops", type=int, default=30, help="192x192 matmuls per step")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # as GPU workers run: the GIL-free stretch is one thread's
    own, others = split_cores()
    pinned = bool(others)
    with FrameSink() as sink:
        senders = {mode: sink.sender(mode) for mode in MODES}
        pids = [os.getpid(), *sink.pids()]
        placement = {pid: others for pid in pids} if pinned else {}
        # The engine thread alone on its core, but for the link thread of `link-beside`.
        beside = [threading.get_native_id(), *sink.beside_threads()]
        engine_thread = {(os.getpid(), tid): own for tid in beside} if pinned else {}
        with placed(placement, engine_thread):
            levels = measure(args, senders)
    frames_sent = sum(
        len(rounds[mode]) * args.steps + max(args.steps // 4, 1)
        for rounds in levels.values()
        for mode in SENDING
    )
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu": topology(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pinned": {"engine": sorted(own), "others": sorted(others)} if pinned else False,
        "settings": {k: getattr(args, k) for k in ("jobs", "rounds", "steps", "gil_free_ops")},
        "levels": {jobs: summarize(rounds) for jobs, rounds in levels.items()},
        "frames_sent": frames_sent,
        "frames_taken": sink.frames_taken,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"link_handover_{datetime.now(timezone.utc):%Y-%m-%dT%H%MZ}"
    table = report(result)
    stem.with_suffix(".md").write_text(table)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    print(table)
    if sink.frames_taken != frames_sent:
        print(f"bench: the sink took {sink.frames_taken} frames of {frames_sent}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
