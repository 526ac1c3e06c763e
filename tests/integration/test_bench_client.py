"""The benchmark's HTTP client (bench/streams.py) against a real gateway: streams counted by tokens,
its own CPU time recorded, and the summary's spread over rounds.

Runs in the pytest process against the module's two-model CPU gateway: the same client that
bench/bench_engines.py points at our gateway and at any peer server (--peer).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from bench.cpu_placement import SiblingWatch, physical_cores, placed
from bench.gpu_clocks import GpuClocks, parse, window
from bench.neighbours import Load, Neighbours, parse_loads
from bench.streams import Round, Stream, http_round, median_interval, paired, summarize
from tests.harness import GatewayProcess, wait_until


def test_the_async_client_counts_tokens_and_its_own_cpu(two_model_gateway: GatewayProcess) -> None:
    prompts = [f"Stream {i}: hello" for i in range(4)]
    done = http_round(two_model_gateway.url, "demo-small", prompts, 8, 1)
    assert len(done.streams) == 4 and all(s.tokens == 8 for s in done.streams)
    assert done.client_cpu_s > 0 and done.seconds > 0
    summary = summarize([done, http_round(two_model_gateway.url, "demo-small", prompts, 8, 1)])
    assert summary["tokens"] == 64 and summary["rounds"] == 2
    assert summary["tok_s_total_min"] <= summary["tok_s_total"] <= summary["tok_s_total_max"]
    assert summary["client_cpu_us_per_token"] > 0

    # Each request names its round, so the gateway's access lines (its own TTFT) match the rounds.
    def logged_ids() -> set[str] | None:
        ids = set(re.findall(r"request_id=(bench-demo-small-4s-\d+-\d)\b", two_model_gateway.log()))
        return ids if len(ids) >= 8 else None

    ids = wait_until(logged_ids, "the bench's request ids of both rounds in the access log")
    assert {i.rsplit("-", 1)[1] for i in ids} == {"0", "1", "2", "3"}


def test_a_gateway_round_records_the_gateway_cpu_per_token(two_model_gateway: GatewayProcess) -> None:
    """bench_engines' gateway rounds read the gateway's and the worker's CPU over the round; the
    per-token figure and its 50 us target reach the report's targets."""
    from bench.bench_engines import measured, targets

    worker = next(int(w["pid"]) for w in two_model_gateway.workers() if w["model"] == "demo-small")
    prompts = [f"Stream {i}: hello" for i in range(4)]
    done = measured(lambda: http_round(two_model_gateway.url, "demo-small", prompts, 8, None), worker,
                    [two_model_gateway.pid])  # fmt: skip
    assert done.gateway_cpu_s is not None and done.gateway_cpu_s > 0
    assert done.worker_cpu_s is not None and done.worker_cpu_s >= 0
    assert done.host_steal_pct is not None and 0 <= done.host_steal_pct <= 100
    # The worker's own threads, by the names it gives them, beside its engine (main) thread.
    assert done.threads is not None and done.threads["main_on_cpu_pct"] > 0, done.threads
    assert "worker-link" in done.threads["others_by_name"], done.threads
    per_token = 1e6 * done.gateway_cpu_s / 32
    row = {"path": "gateway", "streams": 4, "gateway_cpu_us_per_token": per_token, "tokens_per_chunk": 1.0}
    assert (("4 streams: gateway CPU per streamed token <= 50 us", f"{per_token:.1f} us", per_token <= 50)
            in targets([row]))  # fmt: skip


def test_the_summary_reports_the_median_and_the_spread_of_rounds() -> None:
    def round_of(tokens_per_s: float) -> Round:
        stream = Stream(0.0, [(i + 1) / tokens_per_s for i in range(10)])
        return Round([stream])

    rounds = [round_of(100.0), round_of(300.0), round_of(200.0)]
    summary = summarize(rounds)
    assert (summary["tok_s_total_min"], summary["tok_s_total"], summary["tok_s_total_max"]) == (
        100.0, 200.0, 300.0)  # fmt: skip
    assert summary["tok_s_rounds"] == [100.0, 300.0, 200.0]
    assert summary["host_steal_pct"] is None  # no round measured it
    for done, steal in zip(rounds, [4.0, 0.5, 1.0], strict=True):
        done.host_steal_pct = steal
    summary = summarize(rounds)
    assert (summary["host_steal_pct"], summary["host_steal_pct_rounds"]) == (1.0, [4.0, 0.5, 1.0])


def test_paired_ratios_divide_each_round_by_the_raw_round_of_its_turn() -> None:
    """The host drifts between turns; a ratio within a turn must cancel that drift."""

    def round_of(first_token_s: float, stretch: float = 1.0) -> Round:
        """11 tokens, one every first_token_s; every time stretched by `stretch` (a slower path)."""
        return Round([Stream(0.0, [stretch * first_token_s * (i + 1) for i in range(11)])])

    raw = [round_of(0.010), round_of(0.020), round_of(0.005)]
    gateway = [round_of(0.010, 1 / 0.95), round_of(0.020, 1 / 0.95), round_of(0.005, 1 / 0.95)]
    result = paired(gateway, raw)
    # Every turn is 0.95 x its raw round, though the host's speed halves and quadruples between turns.
    for key in ("paired_ratio", "paired_ratio_min", "paired_ratio_max"):
        assert result[key] == pytest.approx(0.95)
    # The first token comes 1/0.95 - 1 of its raw time later: 0.26, 0.53 and 1.05 ms.
    assert result["paired_ttft_added_ms"] == pytest.approx(10 / 19)
    assert result["paired_ttft_added_ms_min"] == pytest.approx(5 / 19)
    assert result["paired_ttft_added_ms_max"] == pytest.approx(20 / 19)
    # Three turns cannot place the median with 95 % confidence; the report then gives none.
    assert result["paired_ratio_ci95"] is None and result["paired_ttft_added_ms_ci95"] is None


def test_paired_figures_of_an_even_count_of_turns_are_the_mean_of_the_middle_two() -> None:
    """Four turns at 0.8, 0.9, 1.0 and 1.1 of their raw rounds: the median is 0.95, not the upper
    middle turn (1.0), and the first token's time added likewise."""
    tokens = 11

    def round_of(gap_s: float) -> Round:
        return Round([Stream(0.0, [gap_s * (i + 1) for i in range(tokens)])])

    raw = [round_of(0.010) for _ in range(4)]
    gateway = [round_of(0.010 / ratio) for ratio in (1.0, 0.8, 1.1, 0.9)]
    result = paired(gateway, raw)
    assert result["paired_ratio"] == pytest.approx(0.95)
    added = sorted(1000 * (0.010 / ratio - 0.010) for ratio in (1.0, 0.8, 1.1, 0.9))
    assert result["paired_ttft_added_ms"] == pytest.approx((added[1] + added[2]) / 2)
    assert result["paired_ratio_turns"] == pytest.approx([1.0, 0.8, 1.1, 0.9], abs=1e-4)  # in turn order


def test_the_median_interval_is_the_order_statistics_of_the_binomial() -> None:
    """95 % for the median: x(2)..x(8) of 9 (coverage 0.961; x(3)..x(7) would be 0.820) and the
    textbook x(8)..x(18) of 25; the order of the values does not matter."""
    nine = [9.0, 1.0, 8.0, 2.0, 7.0, 3.0, 6.0, 4.0, 5.0]
    assert median_interval(nine) == [2.0, 8.0]
    assert median_interval([float(v) for v in range(25, 0, -1)]) == [8.0, 18.0]
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # 30/32 = 0.9375 at best
    assert median_interval([float(v) for v in range(6)]) == [0.0, 5.0]  # 62/64 = 0.969


def test_the_sibling_watch_sees_two_busy_processes_on_one_core() -> None:
    """bench/cpu_placement.py: the sampler process reports a shared core only when another busy
    thread runs on the engine thread's physical core."""
    busy = [sys.executable, "-c", "while True: pass"]
    engine, other = subprocess.Popen(busy), subprocess.Popen(busy)
    try:
        cores = physical_cores()
        first = min(cores)
        elsewhere = {cpu for cpu, core in cores.items() if core != cores[first]}
        with placed({engine.pid: {first}, other.pid: {first}}):
            with SiblingWatch((engine.pid, engine.pid), [other.pid], min_samples=20) as together:
                pass
        assert together.samples > 0 and together.shared_fraction is not None
        assert together.shared_fraction > 0.5
        assert set(together.cpus) == {first} and together.main_cpu == (first, 1.0)
        if elsewhere:  # a host of one core cannot hold them apart
            with placed({engine.pid: {first}, other.pid: elsewhere}):
                with SiblingWatch((engine.pid, engine.pid), [other.pid], min_samples=20) as apart:
                    pass
            assert apart.samples > 0 and apart.shared_fraction == 0.0
    finally:
        engine.kill()
        other.kill()
        engine.wait()
        other.wait()


def test_one_thread_can_be_pinned_apart_from_the_rest_of_its_process() -> None:
    """`--pin`: the engine thread alone on its core, every other thread of its process elsewhere;
    afterwards all of them may run anywhere again."""
    cores = physical_cores()
    first = min(cores)
    elsewhere = {cpu for cpu, core in cores.items() if core != cores[first]}
    if not elsewhere:
        pytest.skip("a host of one core cannot hold them apart")
    code = "import threading, sys; threading.Thread(target=sys.stdin.read).start(); sys.stdin.read()"
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE) as process:
        threads = wait_until(lambda: len(_tids(process.pid)) >= 2 and _tids(process.pid), "its second thread")
        helper = next(tid for tid in threads if tid != process.pid)
        with placed({process.pid: elsewhere}, {(process.pid, process.pid): {first}}):
            assert os.sched_getaffinity(process.pid) == {first}
            assert os.sched_getaffinity(helper) == elsewhere
        assert os.sched_getaffinity(process.pid) == os.sched_getaffinity(helper) == set(cores)
        process.kill()


def _tids(pid: int) -> list[int]:
    return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def test_the_neighbours_use_a_cpu_only_while_awake() -> None:
    """bench_engines.py --neighbours: processes that wake and burn a CPU beside the raw path's
    rounds, and are stopped between them."""
    with Neighbours(parse_loads("5:2000,10:1000")) as neighbours:
        pids = [p.pid for p in neighbours._processes]
        wait_until(lambda: all(_state(pid) == "T" for pid in pids), "both neighbours stopped at start")
        before = neighbours.cpu_seconds()
        with neighbours.awake():
            wait_until(lambda: neighbours.cpu_seconds() - before >= 0.2, "the neighbours using a CPU")
        # Stopped again between rounds (a signal lands a moment after it is sent).
        wait_until(lambda: all(_state(pid) == "T" for pid in pids), "both neighbours stopped again")
    assert all(not os.path.exists(f"/proc/{pid}") for pid in pids)  # and gone with the block


def test_a_neighbour_load_must_be_shorter_than_its_period() -> None:
    assert parse_loads("27:600,27:340") == [Load(27, 600), Load(27, 340)]
    for bad in ("27", "10:10000", "0:5", "5:-1"):
        with pytest.raises(ValueError):
            parse_loads(bad)


def test_gpu_clock_samples_are_averaged_over_each_round() -> None:
    lines = ["1980, 2619, 300.5, 90, 4096", "[N/A], 2619, 1, 1, 1", "1410, 2619, 200.5, 50, 2048",
             "1980, 2619, 100, 10, 8192"]  # fmt: skip
    samples = [parse(line, at) for at, line in enumerate(lines)]
    assert samples[1] is None  # a field nvidia-smi could not read drops the line, not the run
    kept = [s for s in samples if s is not None]
    assert window(kept, 0, 2) == {
        "sm_mhz": 1695, "mem_mhz": 2619, "power_w": 250.5, "busy_pct": 70.0, "free_mib_min": 2048.0
    }  # fmt: skip
    assert window(kept, 3, 3)["sm_mhz"] == 1980 and window(kept, 4, 9) is None


def test_without_nvidia_smi_the_clock_watch_records_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with GpuClocks() as clocks:
        assert clocks.between(0, float("inf")) is None
