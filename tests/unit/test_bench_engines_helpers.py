"""bench/bench_engines.py's helpers: `--compare-env` (the second worker's variables as parsed from
the command line, a malformed item refused with what was given) and the gateway-side time to first
token read back from the access logs by the client's request ids (bench/access_log.py; several
gateway processes each write their own), the report's lines for the admission-window worker, the
several gateway processes, the neighbours and the link beside the engine, `--pin-all` placing every
worker's engine thread, not only the default one's (and `--link-beside` its link thread beside it),
the prompts of each round (the same, or fresh with `--fresh-prompts`), and the engine thread's
medians over the rounds as printed. Runs in the test process (and a sleeping child, as a worker to
place)."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bench.access_log import add_gateway_ttft, ttft_by_round
from bench.bench_engines import (
    ENV_PATH,
    LINK_BESIDE_PATH,
    LOGPROBS_PATH,
    WINDOW_PATH,
    PromptSource,
    env_assignments,
    gateway_process_sizes,
    logprobs_lines,
    main,
    markdown,
    pin_other_workers,
    pinned,
    processes_path,
    thread_lines,
    thread_summary,
)
from bench.cpu_placement import named_threads
from bench.streams import Round, Stream, paired, summarize


def test_items_become_variables() -> None:
    parsed = env_assignments("MKL_NUM_THREADS=2, OMP_NUM_THREADS=4")
    assert parsed == {"MKL_NUM_THREADS": "2", "OMP_NUM_THREADS": "4"}
    assert env_assignments("EMPTY=") == {"EMPTY": ""}


def test_a_window_for_the_process_groups_needs_the_groups(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ended:
        main(["--model", "unused", "--processes-window-ms", "8"])
    assert ended.value.code == 2
    assert "--processes-window-ms sets the window of --gateway-processes' worker" in capsys.readouterr().err


@pytest.mark.parametrize(
    "options",
    [["--link-beside"], ["--paths", "raw,engine", "--link-paths", "--link-modes", "link,link-beside"]],
)
def test_the_link_beside_the_engine_needs_a_pinned_engine(
    options: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as ended:
        main(["--model", "unused", *options])
    assert ended.value.code == 2
    assert "--link-beside puts the link thread beside the pinned engine thread" in capsys.readouterr().err


def test_gateway_process_sizes_are_distinct_counts() -> None:
    assert gateway_process_sizes("1,4") == [1, 4] and gateway_process_sizes("2") == [2]
    for bad in ("", "0", "1,1", "x", "2,-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="distinct process counts"):
            gateway_process_sizes(bad)


@pytest.mark.parametrize("text", ["", "NOVALUE", "=5", "A=1,B"])
def test_a_malformed_item_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=VALUE"):
        env_assignments(text)


LOG = """\
2026-11-26 22:46:45,248 INFO gateway.access: POST /v1/completions 200 2310.1ms tokens=151+128 ttft=24.5ms \
finish=length client=127.0.0.1 [request_id=bench-m-1s-3-0 model=m worker=m#0]
2026-11-26 22:46:47,248 INFO gateway.access: POST /v1/completions 200 2310.1ms tokens=151+128 ttft=20.5ms \
finish=length client=127.0.0.1 [request_id=bench-m-env-1s-4-0 model=m-env worker=m-env#0]
2026-11-26 22:46:49,248 INFO gateway.access: POST /v1/completions 200 2310.1ms tokens=151+128 ttft=30.0ms \
finish=length client=127.0.0.1 [request_id=bench-m-2s-5-0 model=m worker=m#0]
2026-11-26 22:46:49,249 INFO gateway.access: POST /v1/completions 200 2310.1ms tokens=151+128 ttft=34.0ms \
finish=length client=127.0.0.1 [request_id=bench-m-2s-5-1 model=m worker=m#0]
2026-11-26 22:46:49,250 INFO gateway.access: POST /v1/completions 200 1.1ms tokens=3+0 \
finish=length client=127.0.0.1 [request_id=other model=m worker=m#0]
"""


def test_the_access_log_gives_each_rounds_ttft(tmp_path: Path) -> None:
    assert ttft_by_round(LOG) == {
        "bench-m-1s-3": [24.5],
        "bench-m-env-1s-4": [20.5],
        "bench-m-2s-5": [30.0, 34.0],
    }
    log = tmp_path / "gateway.log"
    log.write_text(LOG)
    rows = [
        {"round_ids": ["bench-m-1s-3"]},
        {"round_ids": ["bench-m-2s-5"]},
        {"round_ids": ["bench-x-1s-9"]},
        {},
    ]
    add_gateway_ttft(rows, log)
    assert [row.get("gateway_ttft_ms_p50") for row in rows] == [24.5, 32.0, None, None]
    # Several gateway processes: a round's requests are spread over their logs (one may be missing).
    lines = LOG.splitlines(keepends=True)
    first, second = tmp_path / "gateway-0.log", tmp_path / "gateway-1.log"
    first.write_text("".join(lines[:3]))  # the 2-stream round's first request
    second.write_text("".join(lines[3:]))  # and its second
    rows = [{"round_ids": ["bench-m-2s-5"]}]
    add_gateway_ttft(rows, first, second, tmp_path / "never-written.log")
    assert rows[0]["gateway_ttft_ms_p50"] == 32.0


def _rounds(step_s: float, count: int = 7) -> list[Round]:
    return [
        Round([Stream(0.0, [0.02 + step_s * (i + k % 3 * 0.01) for i in range(8)])]) for k in range(count)
    ]


def test_the_report_pairs_the_window_worker_and_the_neighbours_with_their_baselines() -> None:
    """The lines a GPU run prints for --admission-window-ms and --neighbours, from rows built as
    run_overhead builds them: a report that cannot be written would lose the run's numbers."""
    raw, gateway, window, beside = _rounds(0.020), _rounds(0.021), _rounds(0.021), _rounds(0.022)
    for r in raw:
        r.step_seconds = [0.020] * 7
    for r in beside:
        r.neighbour_cpu_s = 0.01
    rows = [
        {"path": "raw", "streams": 1, **summarize(raw), "engine_cpu_rounds": [(3, 1.0)] * 7,
         "gpu_rounds": [{"sm_mhz": 1980}] * 7},
        {"path": "gateway", "streams": 1, **summarize(gateway), **paired(gateway, raw),
         **{f"neighbours_{k}": v for k, v in paired(gateway, beside).items()}},
        {"path": WINDOW_PATH, "streams": 1, **summarize(window), **paired(window, raw),
         **{f"window_{k}": v for k, v in paired(window, gateway).items()}},
        {"path": processes_path(2), "streams": 1, **summarize(window), **paired(window, raw),
         **{f"processes_{k}": v for k, v in paired(window, gateway).items()},
         **{f"one_process_{k}": v for k, v in paired(window, beside).items()}},
        {"path": "raw, neighbours", "streams": 1, **summarize(beside), **paired(beside, raw),
         "neighbour_cpu_pct": 5.0},
        {"path": LINK_BESIDE_PATH, "streams": 1, **summarize(beside), **paired(beside, raw),
         **{f"beside_{k}": v for k, v in paired(beside, gateway).items()}},
    ]  # fmt: skip
    report = {"device": "d", "date": "t", "engine": "exllamav3", "model": "/m", "new_tokens": 8, "rounds": 7,
              "versions": {"engine": "1", "torch": "2"}, "rows": rows, "logprobs": [], "mixed": [],
              "settings": {"admission_window_ms": 8.0, "neighbours": ["28 ms : 600 us"],
                           "engine_threads_pinned": True}}  # fmt: skip
    text = markdown(report)
    assert "every engine thread on one core" in text
    assert f"| 1 streams: {WINDOW_PATH} 8.0 ms / gateway, paired | tok/s 1.000; TTFT +0.0 ms" in text
    assert (
        "| 1 streams: gateway, 2 processes on one port / gateway, paired | tok/s 1.000; TTFT +0.0 ms" in text
    )
    to_one = window[0].tok_s / beside[0].tok_s  # here "beside" stands in for the one-process rounds
    one_line = "| 1 streams: gateway, 2 processes / gateway, 1 process, on one port each, paired | tok/s"
    assert f"{one_line} {to_one:.3f}" in text
    ratio = gateway[0].tok_s / beside[0].tok_s  # every turn alike here
    assert f"| 1 streams: gateway / raw beside neighbours ['28 ms : 600 us'], paired | {ratio:.3f}" in text
    assert "| raw, neighbours, 1 streams: the neighbours' CPU, % of one core | 5.0 |" in text
    to_gateway = beside[0].tok_s / gateway[0].tok_s
    assert (
        f"| 1 streams: {LINK_BESIDE_PATH} / gateway, paired | tok/s {to_gateway:.3f} "
        f"(turns {to_gateway:.3f}-{to_gateway:.3f}" in text
    )
    assert "@ 3 (1.00), 1980 MHz" in text


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to place a worker on one")
def test_pin_all_puts_every_workers_engine_thread_on_the_engines_core() -> None:
    """A second worker's rounds (the admission window's, --compare-env's) must run where the default
    worker's run, or a comparison of the two compares the cores they landed on."""
    cpus = sorted(os.sched_getaffinity(0))
    own, rest = {cpus[-1]}, set(cpus[:-1])
    with subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    ) as worker:
        try:
            seen: dict[str, set[int]] = {}

            def round_of(path: str) -> object:
                def round_() -> str:
                    seen[path] = os.sched_getaffinity(worker.pid)
                    return path

                return round_

            run = {path: (round_of(path), worker.pid) for path in (WINDOW_PATH, ENV_PATH)}
            run["peer"] = (round_of("peer"), None)  # a server of someone else's: nothing to place
            pin_other_workers(run, {worker.pid: rest}, own)
            for path, (round_, _pid) in run.items():
                assert round_() == path
            assert seen[WINDOW_PATH] == own and seen[ENV_PATH] == own
            assert seen["peer"] == set(cpus)
            assert os.sched_getaffinity(worker.pid) == set(cpus)  # free again after each round
        finally:
            worker.kill()


LINKED_CHILD = """
import sys, threading
from model_worker.native_names import name_this_thread
done = threading.Event()
def link():
    name_this_thread()
    sys.stdin.read()
    done.set()
def prompts():
    name_this_thread()
    done.wait()
threads = [threading.Thread(target=link, name="worker-link"),
           threading.Thread(target=prompts, name="worker-prompts")]
for thread in threads:
    thread.start()
print(threads[0].native_id, threads[1].native_id, flush=True)
for thread in threads:
    thread.join()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to place a worker on one")
def test_link_beside_puts_the_workers_link_thread_on_the_engines_core() -> None:
    """--link-beside: the worker's thread named worker-link joins its engine (main) thread on the
    engine's core for the round; its other threads stay on the rest, and all are free afterwards."""
    cpus = sorted(os.sched_getaffinity(0))
    own, rest = {cpus[-1]}, set(cpus[:-1])
    with subprocess.Popen(
        [sys.executable, "-c", LINKED_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    ) as worker:  # fmt: skip
        try:
            assert worker.stdout is not None
            link, prompts = (int(tid) for tid in worker.stdout.readline().split())
            assert named_threads(worker.pid, "worker-link") == [link]
            seen: dict[int, set[int]] = {}

            def round_() -> str:
                for tid in os.listdir(f"/proc/{worker.pid}/task"):
                    seen[int(tid)] = os.sched_getaffinity(int(tid))
                return "done"

            def link_thread() -> list[tuple[int, int]]:
                return [(worker.pid, tid) for tid in named_threads(worker.pid, "worker-link")]

            beside = pinned(round_, {worker.pid: rest}, (worker.pid, worker.pid), own, link_thread)
            assert beside() == "done"
            assert seen == {worker.pid: own, link: own, prompts: rest}
            assert os.sched_getaffinity(link) == set(cpus)  # free again after the round
        finally:
            worker.kill()


def test_fresh_prompts_are_new_in_every_round_and_the_default_ones_repeat() -> None:
    repeated = PromptSource(4, fresh=False)
    assert repeated.texts() == repeated.texts()
    fresh = PromptSource(4, fresh=True)
    rounds = [fresh.texts() for _ in range(3)]
    assert all(len(texts) == 4 for texts in rounds)
    every = [text for texts in rounds for text in texts]
    assert len(set(every)) == len(every)  # no round, and no stream, repeats another's prompt
    # Each stream's prompt starts with its own text, so none shares a cached prefix with another.
    assert len({text.split(".")[0] for text in rounds[0]}) == 4


def test_a_second_scenarios_fresh_prompts_are_not_the_levels() -> None:
    level, logprobs = PromptSource(4, fresh=True), PromptSource(4, fresh=True, scenario="logprobs")
    sent = [text for _ in range(3) for text in level.texts()]
    assert not set(sent) & {text for _ in range(3) for text in logprobs.texts()}
    # Without --fresh-prompts both repeat the same prompts, as runs before the option sent them.
    assert PromptSource(4, False, scenario="logprobs").texts() == PromptSource(4, False).texts()


def test_thread_medians_are_printed_rounded() -> None:
    """A median of an even count of rounds is a mean of two: the table shows it to 2 places."""
    usages = [
        {"main_sleeps_per_s": 165.3, "others_cpu_pct": 1.4},
        {"main_sleeps_per_s": 165.4, "others_cpu_pct": 1.5, "others_by_name": {"worker-link": 1.0}},
    ]
    done = [Round([Stream(0.0, [0.01])], threads=usage) for usage in usages]
    summary = thread_summary(done)["threads"]
    assert summary["main_sleeps_per_s"] == 165.35
    assert summary["others_cpu_pct"] == 1.45
    assert summary["others_by_name"] == {"worker-link": 1.0}
    line = thread_lines([{"path": "gateway", "streams": 1, "threads": summary}])[2]
    assert "| 165.35 |" in line


def test_the_logprobs_target_pairs_each_turn_and_reads_older_reports() -> None:
    plain, with_logprobs = _rounds(0.020, 6), _rounds(0.025, 6)
    paired_row = {"path": LOGPROBS_PATH, "streams": 64, **summarize(with_logprobs)}
    paired_row.update(paired(with_logprobs, plain))
    rows = [{"path": "gateway", "streams": 64, **summarize(plain)}, paired_row]
    turns = sorted(w.tok_s / p.tok_s for w, p in zip(with_logprobs, plain, strict=True))
    median = statistics.median(turns)
    assert median < 0.90
    [line] = logprobs_lines(rows)
    assert line == (f"| 64 streams: logprobs 1 total tok/s >= 0.90 x without | {median:.3f} "
                    f"(turns {turns[0]:.3f}-{turns[-1]:.3f}) | **no** |")  # fmt: skip
    older = [rows[0], {k: v for k, v in paired_row.items() if not k.startswith("paired_")}]
    of_medians = older[1]["tok_s_total"] / older[0]["tok_s_total"]
    assert logprobs_lines(older) == [
        f"| 64 streams: logprobs 1 total tok/s >= 0.90 x without | {of_medians:.3f} | **no** |"
    ]
