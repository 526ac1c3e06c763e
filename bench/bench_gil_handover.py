"""How long a frame handed from the engine thread to the link thread waits for the GIL.

Runs as a standalone process (the bench process), on any host; no model, no GPU. It copies the
worker's hand-over: an "engine" thread that runs pure Python for a step's time, then puts a frame
on a SimpleQueue and rings a pipe (as model_worker.link_thread does), and a "link" thread that waits
in a ZeroMQ poller on that pipe and, once it holds the GIL again, takes the frame and spends a
frame's encoding time on it. Per CPython switch interval it prints the hand-over's percentiles (the
ring to the link thread running) and how much longer the engine's step took than its own work.

    python bench/bench_gil_handover.py --steps 300 --intervals-ms 5,1,0.5,0.2
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import threading
import time

import zmq


def busy(seconds: float) -> None:
    """Pure Python for `seconds`: the GIL is held and let go only when another thread asks."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(200))


def measure(interval_s: float, steps: int, step_s: float, encode_s: float) -> dict[str, float]:
    sys.setswitchinterval(interval_s)
    frames: queue.SimpleQueue[float] = queue.SimpleQueue()
    bell_read, bell_write = os.pipe()
    os.set_blocking(bell_read, False)
    waits: list[float] = []
    done = threading.Event()

    def link() -> None:
        poller = zmq.Poller()
        poller.register(bell_read, zmq.POLLIN)
        while not done.is_set():
            if not poller.poll(100):
                continue
            running = time.perf_counter()
            try:
                os.read(bell_read, 4096)
            except BlockingIOError:
                pass
            while True:
                try:
                    handed = frames.get_nowait()
                except queue.Empty:
                    break
                waits.append(running - handed)
                busy(encode_s)

    thread = threading.Thread(target=link, name="link")
    thread.start()
    overruns = []
    try:
        for _ in range(steps):
            started = time.perf_counter()
            frames.put(time.perf_counter())
            os.write(bell_write, b"\0")
            busy(step_s)
            overruns.append(time.perf_counter() - started - step_s)
    finally:
        done.set()
        thread.join()
        os.close(bell_read)
        os.close(bell_write)
    waits.sort()
    return {
        "switch_interval_ms": 1e3 * interval_s,
        "handover_ms_p50": 1e3 * waits[len(waits) // 2],
        "handover_ms_p90": 1e3 * waits[int(len(waits) * 0.9)],
        "handover_ms_p99": 1e3 * waits[int(len(waits) * 0.99)],
        "handover_ms_mean": 1e3 * statistics.fmean(waits),
        "step_overrun_ms_p50": 1e3 * statistics.median(overruns),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--step-ms", type=float, default=16.0, help="one engine step (8B shape, one stream)")
    parser.add_argument("--encode-ms", type=float, default=0.1, help="the link thread's work per frame")
    parser.add_argument("--intervals-ms", default="5,1,0.5,0.2")
    args = parser.parse_args()
    print("| switch interval | hand-over p50 | p90 | p99 | mean | engine step overrun p50 |")
    print("|---|---|---|---|---|---|")
    for interval in (float(v) / 1e3 for v in args.intervals_ms.split(",")):
        r = measure(interval, args.steps, args.step_ms / 1e3, args.encode_ms / 1e3)
        cells = [f"{r['switch_interval_ms']:g} ms"]
        cells += [f"{r[key]:.2f} ms" for key in ("handover_ms_p50", "handover_ms_p90", "handover_ms_p99")]
        cells += [f"{r['handover_ms_mean']:.2f} ms", f"{r['step_overrun_ms_p50']:.3f} ms"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
