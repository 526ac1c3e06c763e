"""model_worker/step_trace.py: the lines a StepTrace writes, driven as the worker's serve loop drives
it, with the link thread's hand-over waits put in as that thread puts them. Runs in the test
process; no worker, no GPU."""

from __future__ import annotations

import json
import mmap
import time
from pathlib import Path

import pytest

from model_worker.step_trace import StepTrace, _cuda_allocator_counts, summarize


def _step(trace: StepTrace, job: str, waits_taken_meanwhile: int) -> None:
    trace.before_step()
    trace.after_step([(job, 1, False)])
    for _ in range(waits_taken_meanwhile):  # the link thread took earlier frames during this step
        trace.handoff_waits.append(0.002)
    trace.after_send()


def test_every_frame_the_link_thread_took_is_counted_even_after_the_last_step(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    trace = StepTrace(str(path))
    _step(trace, "a", 0)
    _step(trace, "a", 1)  # the first step's frame
    _step(trace, "a", 0)  # the link thread lags behind ...
    # ... and takes the last three frames once the steps are over, before the trace closes.
    trace.handoff_waits.extend([0.001, 0.004, 0.003])
    trace.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 3 and all(line["step_ms"] >= 0 and line["jobs"] == 1 for line in lines)
    assert [line.get("link_frames", 0) for line in lines] == [0, 1, 3]
    assert lines[1]["link_ms"] == 2.0 and lines[2]["link_ms"] == 4.0
    assert sum(line["tokens"] for line in lines) == 3 and sum(line["first"] for line in lines) == 1


def test_a_trace_without_steps_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    trace = StepTrace(str(path))
    trace.handoff_waits.append(0.001)  # a heartbeat's frame: no step line to carry it
    trace.close()
    assert path.read_text() == ""


def test_each_line_says_how_many_prompt_tokens_its_step_prefilled(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    trace = StepTrace(str(path))
    ingested, found = [0], [0]
    trace.count_prefill(lambda: ingested[0], lambda: found[0])
    steps = ((2048, 0, []), (700, 512, [("a", 1, False)]), (0, 0, [("a", 1, True)]))
    for prefilled, cached, outputs in steps:
        trace.before_step()
        ingested[0] += prefilled  # what the engine read of the prompt during the step
        found[0] += cached  # of which it found these in its cache
        trace.after_step(outputs)
        trace.after_send()
    trace.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["prefill"] for line in lines] == [2048, 700, 0]
    assert [line["cached"] for line in lines] == [0, 512, 0]
    assert [line["first"] for line in lines] == [0, 1, 0]


def test_each_line_says_how_often_the_gpu_allocator_retried_and_called_the_device(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    trace = StepTrace(str(path))
    counts = [(3, 40)]  # what start-up left: not any step's
    trace.count_allocations(lambda: counts[-1])
    for grown in ((3, 40), (5, 46), (5, 46)):  # a step with room, a squeezed one, one with room again
        trace.before_step()
        counts.append(grown)
        trace.after_step([("a", 1, False)])
        trace.after_send()
    trace.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line["alloc_retries"], line["device_allocs"]) for line in lines] == [(0, 0), (2, 6), (0, 0)]
    summary = summarize(str(path))["all"]
    assert (summary["alloc_retries"], summary["device_allocs"]) == (2, 6)


def test_the_allocator_counts_come_from_torchs_own_statistics(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    stats = {"num_alloc_retries": 2, "num_device_alloc": 5, "num_device_free": 3, "allocated_bytes": {}}
    # raising=True (the default): the public function must exist in the torch this project pins.
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda: stats)
    assert _cuda_allocator_counts() == (2, 8)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", dict)  # CUDA not initialized yet
    assert _cuda_allocator_counts() == (0, 0)


def test_each_line_counts_the_times_its_thread_slept_in_the_step_and_between_steps(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    trace = StepTrace(str(path))
    for naps_in_step, naps_between in ((0, 0), (3, 0), (0, 2)):
        for _ in range(naps_between):  # the loop waits for something between steps
            time.sleep(0.002)  # the thread blocks: one voluntary switch
        trace.before_step()
        for _ in range(naps_in_step):  # the step waits (for the GPU, the GIL, a lock)
            time.sleep(0.002)  # the thread blocks: one voluntary switch
        trace.after_step([("a", 1, False)])
        trace.after_send()
    trace.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    # At least: the kernel may put the thread to sleep for reasons of its own too.
    assert lines[1]["sleeps"] >= 3 and lines[2]["sleeps_outside"] >= 2
    assert lines[0]["sleeps_outside"] is None  # nothing came before the first step
    summary = summarize(str(path))["all"]
    assert summary["sleeps_per_step"] >= 1.0 and summary["sleeps_outside_per_step"] >= 1.0


def test_each_line_says_what_cpu_the_step_used_and_what_it_waited(tmp_path: Path) -> None:
    """A step that computes uses its wall time as CPU; one that sleeps uses almost none; a step that
    touches fresh memory takes page faults. This thread's own counters, read around each step."""
    path = tmp_path / "trace.jsonl"
    trace = StepTrace(str(path))

    def computing() -> None:
        deadline = time.thread_time() + 0.03
        while time.thread_time() < deadline:
            pass

    def waiting() -> None:
        time.sleep(0.03)

    def touching() -> None:
        # 64 MiB straight from the kernel (not from an allocator that may hand back memory it already
        # touched), written so that the kernel must back every page.
        with mmap.mmap(-1, 64 << 20) as pages:
            for offset in range(0, len(pages), 4096):
                pages[offset] = 1

    for work in (computing, waiting, touching):
        trace.before_step()
        work()
        trace.after_step([("a", 1, False)])
        trace.after_send()
    trace.close()
    computed, waited, touched = (json.loads(line) for line in path.read_text().splitlines())
    assert computed["cpu_ms"] >= 29.0 and computed["cpu_ms"] <= computed["step_ms"] + 1.0
    assert waited["step_ms"] >= 29.0 and waited["cpu_ms"] < 5.0 and waited["sleeps"] >= 1
    # At least one fault per huge page (2 MiB) where the host backs memory with them; 16,384 with 4 KiB pages.
    assert touched["faults"] >= 32
    assert all(line["preempted"] >= 0 and line["sys_ms"] >= 0 for line in (computed, waited, touched))
    summary = summarize(str(path))["all"]
    assert summary["cpu_ms_p50"] is not None and summary["faults_per_step"] >= 32 / 3
