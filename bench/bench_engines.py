"""Gateway overhead on a GPU engine: raw exllamav2 or exllamav3 in-process versus the gateway.

Runs as a standalone process on a GPU host (scripts/gpu_run.sh starts it). Owns the scenarios and
the report. The same model, settings and prompts are driven (1) in this process through the
engine library's own generator and (2) through a gateway started on a free port, whose worker
loads the same model with the same settings, at 1, 4, 16 and 64 concurrent greedy streams. Raw
and gateway rounds alternate at each concurrency (never overlapping; every other turn in reverse
order), after a warm-up round of each. Then, through the gateway only, streamed completions with
`logprobs: 1` against the same without, alternating. With `--mixed-model` on a two-GPU host it
also serves an exllamav2 model on GPU 0 and an exllamav3 model on GPU 1 from one gateway, each
alone and both at once. Writes a markdown table with the targets and a JSON file (device, date,
versions, every figure).

    python bench/bench_engines.py --engine exllamav2 --model /tmp/models/llama3-8b --out-dir $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.access_log import add_gateway_ttft  # noqa: E402
from bench.cpu_placement import SiblingWatch, named_threads, placed, split_cores, topology  # noqa: E402
from bench.gateway_processes import GatewayProcesses  # noqa: E402
from bench.gpu_clocks import GpuClocks  # noqa: E402
from bench.link_sink import MODES as LINK_MODES  # noqa: E402
from bench.link_sink import FrameSink  # noqa: E402
from bench.neighbours import Neighbours, parse_loads  # noqa: E402
from bench.proc_cpu import cpu_seconds, run_seconds, steal_seconds, thread_times, thread_usage  # noqa: E402
from bench.profiling import Profiler  # noqa: E402
from bench.streams import Round, engine_round, http_round, paired, raw_round, summarize  # noqa: E402
from model_worker.engines.registry import create_engine  # noqa: E402
from model_worker.main import CPU_THREAD_VARIABLES  # noqa: E402
from model_worker.step_trace import TRACE_VARIABLE, StepTrace  # noqa: E402
from model_worker.step_trace import summarize as trace_summary  # noqa: E402
from tests.gpu.support import gateway_env, write_registry  # noqa: E402
from tests.harness import GatewayProcess  # noqa: E402
from wire.codec import as_dict  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village, " * 4


def prompts(count: int) -> list[str]:
    """Distinct prompts of one length, so no stream reuses another's cached prefix."""
    return [f"Stream {i:03d}. {PROMPT}" for i in range(count)]


class PromptSource:
    """A level's prompts for each round: the same ones every round (the default, as earlier runs
    sent them), or with `fresh` new ones every round, so that no round finds its prompts in the
    engine's cache from an earlier one (exllamav3 prefilled 64 repeated 151-token prompts in 190 ms,
    64 new ones in 1.8 s). A `scenario` names a second source at the same level (the logprobs
    rounds), so that its fresh prompts are not the level's from the same round numbers."""

    def __init__(self, count: int, fresh: bool, scenario: str = "") -> None:
        self.count, self.fresh, self.rounds = count, fresh, 0
        self.scenario = f"{scenario} " if scenario else ""

    def texts(self) -> list[str]:
        if not self.fresh:
            return prompts(self.count)
        self.rounds += 1
        tag = f"{self.scenario}round {self.rounds:04d}"
        return [f"Stream {i:03d}, {tag}. {PROMPT}" for i in range(self.count)]


# --split: (path, registry name, engine settings over GPUs 0 and 1). The layer split is given GB per GPU,
# since autosplit would keep an 8B model whole on an 80 GB GPU.
SPLITS = (
    ("gateway, layers over 2 GPUs", "m-layers", {"gpu_split": [12.0, 14.0]}),
    ("gateway, tensor-parallel over 2 GPUs", "m-tp", {"tensor_parallel": True}),
)


def settings(args: argparse.Namespace) -> dict[str, Any]:
    if args.unpaged:  # exllamav2 without paged attention: one job at a time, a cache of one job
        return {"paged": False, "max_chunk_size": 2048}
    return {"max_batch_size": max(args.streams), "max_chunk_size": 2048, "cache_size": args.cache_size}


ENV_PATH = "gateway, env"
WINDOW_PATH = "gateway, admission window"
THREADS_PATH = "gateway, torch threads"
LINK_BESIDE_PATH = "gateway, link beside"  # the default worker, its link thread on the engine's core
LOGPROBS_PATH = "gateway, logprobs 1"  # the default worker, every stream asking for logprobs


def processes_path(count: int) -> str:
    return f"gateway, {count} process" + ("es" if count != 1 else "")


def gateway_process_sizes(text: str) -> list[int]:
    """`--gateway-processes 1,4`: distinct group sizes of at least one process."""
    try:
        sizes = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(
            f"expected distinct process counts of at least 1, like 1,4; got {text!r}"
        )
    return sizes


def env_assignments(text: str) -> dict[str, str]:
    """`--compare-env A=1,B=2` as a dict; refuses an item without a name and `=`."""
    pairs = [item.partition("=") for item in text.split(",") if item.strip()]
    if not pairs or any(not name.strip() or not sep for name, sep, _ in pairs):
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE[,NAME=VALUE], got {text!r}")
    return {name.strip(): value for name, _, value in pairs}


def registry_entry(
    name: str,
    engine: str,
    model: str,
    gpus: list[int],
    args: argparse.Namespace,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    most = max(args.streams)
    entry = {"name": name, "engine": engine, "path": model, "gpus": gpus, "max_seq_len": args.max_seq_len,
             "engine_settings": settings(args),
             "limits": {"max_concurrent_jobs": most, "max_queued_requests": 4 * most}}  # fmt: skip
    if env:
        entry["env"] = env
    return entry


def gateway(config: Path, log: Path) -> GatewayProcess:
    return GatewayProcess(config, env=gateway_env(), ready_timeout=900, log_path=log)


def process_threads(pid: int) -> int | None:
    """The thread count of a process (a worker's, to check its CPU thread setting)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def measured(
    run: Any, pid: int | None, gateway_pids: list[int] | None = None, clocks: GpuClocks | None = None
) -> Round:
    """One round, with the host's steal time meanwhile and what the threads of the process that
    drives the engine did (the worker's, or this process's on an in-process path: see
    proc_cpu.thread_usage); for a worker, the CPU seconds it and the gateway used, and how often
    another busy thread ran on the physical core of its engine thread."""
    steal_before = steal_seconds()
    started = time.perf_counter()
    done = _measured(run, pid, gateway_pids or [])
    if clocks is not None:
        done.gpu = clocks.between(started, time.perf_counter())
    host_cpu_s = done.seconds * (os.cpu_count() or 1)
    done.host_steal_pct = round(100 * (steal_seconds() - steal_before) / host_cpu_s, 2)
    return done


def _measured(run: Any, pid: int | None, gateway_pids: list[int]) -> Round:
    driver = pid or os.getpid()  # an in-process path runs the engine on this process's main thread
    threads_before = thread_times(driver)
    others = [driver, *([os.getpid()] if pid else []), *gateway_pids]
    before = cpu_seconds(pid) if pid else 0.0
    gateway_before = sum(run_seconds(gateway_pid) for gateway_pid in gateway_pids)
    with SiblingWatch((driver, driver), others) as watch:
        done = run()
    done.threads = thread_usage(driver, threads_before, thread_times(driver), done.seconds)
    done.engine_cpu = watch.main_cpu
    done.engine_core_shared = watch.shared_fraction
    if pid:
        done.worker_cpu_s = cpu_seconds(pid) - before
        if gateway_pids:  # every gateway process the round went through
            done.gateway_cpu_s = (
                sum(run_seconds(gateway_pid) for gateway_pid in gateway_pids) - gateway_before
            )
    return done


def thread_summary(done: list[Round]) -> dict[str, Any]:
    """Medians over the rounds of what the engine's process did (proc_cpu.thread_usage), and the
    other threads by name in the last round."""
    usages = [r.threads for r in done if r.threads]
    if not usages:
        return {}
    summary: dict[str, Any] = {}
    for key in ("main_on_cpu_pct", "main_runqueue_pct", "main_sleeps_per_s", "main_preempted_per_s",
                "others_cpu_pct"):  # fmt: skip
        values = [u[key] for u in usages if key in u]
        if values:
            summary[key] = round(statistics.median(values), 2)  # a median of two is a mean: no float noise
    summary["others_by_name"] = usages[-1].get("others_by_name", {})
    return {"threads": summary}


def pinned(
    run: Any,
    placement: dict[int, set[int]],
    engine_thread: tuple[int, int],
    own: set[int],
    beside: Callable[[], list[tuple[int, int]]] = list,
) -> Any:
    """The round with each process's threads held to its CPUs, and the engine thread alone on
    its own (bench/cpu_placement.py), or with the threads `beside` names (a link thread)."""

    def round_() -> Round:
        with placed(placement, {engine_thread: own, **{thread: own for thread in beside()}}):
            return run()

    return round_


def pin_other_workers(
    run: dict[str, Any], placement: dict[int, set[int]], own: set[int], extra_paths: tuple[str, ...] = ()
) -> None:
    """With --pin-all, the rounds of every worker beside the default one ("gateway, admission
    window", the --compare-env and --compare-threads workers, the splits) run with that worker's
    engine thread on the engine's core, as the default worker's do; else a comparison of two
    workers would compare the cores they happened to run on."""
    others = (ENV_PATH, WINDOW_PATH, THREADS_PATH, *(path for path, _, _ in SPLITS), *extra_paths)
    for path in others:
        if path in run and run[path][1] is not None:
            round_, worker_pid = run[path]
            run[path] = (pinned(round_, placement, (worker_pid, worker_pid), own), worker_pid)


def beside_neighbours(run: Any, neighbours: Neighbours) -> Any:
    """The round with the synthetic neighbours awake (bench/neighbours.py)."""

    def round_() -> Round:
        before = neighbours.cpu_seconds()
        with neighbours.awake():
            done = run()
        done.neighbour_cpu_s = neighbours.cpu_seconds() - before
        return done

    return round_


def run_overhead(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Raw vs gateway (and optionally our engine in-process, a peer server, and both sides with
    torch's default CPU threads) at each concurrency, alternating rounds; then logprobs vs none
    (gateway); then, with --py-spy, one profiled round of each."""
    import torch

    default_threads = torch.get_num_threads()
    engine = create_engine(args.engine, args.model, args.max_seq_len, settings(args))
    engine.load(lambda detail, progress: None)
    # As a worker does once its model is loaded (model_worker.serve_loop): full collections then
    # skip the model's objects on both paths alike.
    gc.collect()
    gc.freeze()
    report["settings"]["raw_heap_frozen"] = True
    report["info"] = {k: v for k, v in as_dict(engine.info()).items() if k != "devices"}
    traces = {
        name: StepTrace(str(args.out_dir / f"trace-{args.engine}-{name}.jsonl")) if args.trace else None
        for name in ("raw", "engine", *(f"engine-{mode}" for mode in args.link_modes))
    }
    worker_env = (
        {TRACE_VARIABLE: str(args.out_dir / f"trace-{args.engine}-gateway.jsonl")} if args.trace else {}
    )
    models = [registry_entry("m", args.engine, args.model, [0], args, worker_env)]
    if args.compare_threads:  # the same model, as shipped before: torch's default intra-op threads
        threads = {name: str(default_threads) for name in CPU_THREAD_VARIABLES}
        models.append(registry_entry("m-threads", args.engine, args.model, [0], args, threads))
    if args.compare_env or args.compare_limits:  # the same model, its worker set otherwise
        # Its own trace file (unless the comparison sets one): two workers must not write one file.
        env_trace = {TRACE_VARIABLE: str(args.out_dir / f"trace-{args.engine}-gateway-env.jsonl")}
        env = {**(env_trace if args.trace else {}), **args.compare_env}
        entry = registry_entry("m-env", args.engine, args.model, [0], args, env)
        entry["limits"].update({name: yaml.safe_load(value) for name, value in args.compare_limits.items()})
        models.append(entry)
        report["settings"]["compare_env"] = args.compare_env
        report["settings"]["compare_limits"] = args.compare_limits
    if args.admission_window_ms:  # the same model, its worker gathering bursts before a first step
        trace_env = {TRACE_VARIABLE: str(args.out_dir / f"trace-{args.engine}-gateway-window.jsonl")}
        entry = registry_entry(
            "m-window", args.engine, args.model, [0], args, trace_env if args.trace else None
        )
        entry["limits"]["admission_window_ms"] = args.admission_window_ms
        models.append(entry)
        report["settings"]["admission_window_ms"] = args.admission_window_ms
    for _path, name, split in SPLITS if args.split else ():  # the same model over GPUs 0 and 1
        entry = registry_entry(name, args.engine, args.model, [0, 1], args)
        entry["engine_settings"].update(split)
        models.append(entry)
    config = write_registry(args.out_dir / "bench.yaml", models)
    report["settings"]["fresh_prompts"] = args.fresh_prompts
    report["settings"]["raw_threads"] = args.raw_threads
    report["settings"]["torch_default_threads"] = default_threads
    report["cpu"] = topology()
    report["settings"]["engine_threads_pinned"] = args.pin_all
    report["settings"]["neighbours"] = [f"{n.period_ms:g} ms : {n.busy_us:g} us" for n in args.neighbours]
    log = args.out_dir / f"bench-{args.engine}.log"
    sizes = args.gateway_processes
    processes = contextlib.nullcontext(None)
    if sizes:  # the same model behind groups of gateway processes, each on one port (cluster mode)
        trace_path = args.out_dir / f"trace-{args.engine}-gateway-processes.jsonl"
        procs_env = {TRACE_VARIABLE: str(trace_path)} if args.trace else None
        entry = registry_entry("m-procs", args.engine, args.model, [0], args, procs_env)
        if args.processes_window_ms:  # the groups' worker gathers bursts, as the window worker does
            entry["limits"]["admission_window_ms"] = args.processes_window_ms
            report["settings"]["processes_admission_window_ms"] = args.processes_window_ms
        processes = GatewayProcesses(entry, sizes, args.out_dir / "gateway-processes", env=gateway_env())
        report["settings"]["gateway_processes"] = sizes
    sink = FrameSink() if args.link_paths else contextlib.nullcontext(None)
    with (
        gateway(config, log) as gw,
        sink as frames,
        processes as procs,
        Neighbours(args.neighbours) as neighbours,
        GpuClocks() as clocks,
    ):
        pids = {w["model"]: int(w["pid"]) for w in gw.workers()}
        if procs is not None:
            pids["m-procs"] = procs.worker_pid
        gateway_pids = {processes_path(size): procs.pids(size) for size in sizes} if procs is not None else {}
        senders = {mode: frames.sender(mode) for mode in args.link_modes} if frames is not None else {}
        report["worker_threads"] = {name: process_threads(pid) for name, pid in pids.items()}
        own, rest = split_cores()
        report["cpu"]["pinned"] = {"engine": sorted(own), "others": sorted(rest)}
        me, worker = os.getpid(), pids["m"]

        def in_process_beside() -> list[tuple[int, int]]:
            return [(me, tid) for tid in frames.beside_threads()] if frames is not None else []

        def raw(ids: list[list[int]], threads: int) -> Round:
            torch.set_num_threads(threads)
            try:
                return raw_round(args.engine, engine, ids, args.new_tokens, traces["raw"])
            finally:
                torch.set_num_threads(args.raw_threads)

        torch.set_num_threads(args.raw_threads)
        for count in args.streams:
            source = PromptSource(count, args.fresh_prompts)

            def http(url: str, model: str, source: PromptSource = source) -> Callable[[], Round]:
                return lambda: http_round(url, model, source.texts(), args.new_tokens, None)

            def ids(source: PromptSource = source) -> list[list[int]]:
                return [engine.encode(text, True) for text in source.texts()]

            run = {
                "raw": (lambda ids=ids: raw(ids(), args.raw_threads), None),
                "engine": (
                    lambda ids=ids: engine_round(engine, ids(), args.new_tokens, traces["engine"]),
                    None,
                ),
                "gateway": (http(gw.url, "m"), pids.get("m")),
            }
            for mode, send in senders.items():
                run[f"engine, {mode}"] = (
                    lambda ids=ids, send=send, mode=mode: engine_round(
                        engine, ids(), args.new_tokens, traces[f"engine-{mode}"], send
                    ),
                    None,
                )
            # Every process of the run away from the engine's own core, idle workers included.
            sink_pids = frames.pids() if frames is not None else []
            everyone_else = {
                pid: rest for pid in (me, gw.pid, *pids.values(), *sum(gateway_pids.values(), []), *sink_pids)
            }
            if args.pin_all:  # every round so: a core's speed then moves both paths of a turn alike
                for name in ("raw", "engine", *(f"engine, {mode}" for mode in senders)):
                    beside = in_process_beside if name == "engine, link-beside" else list
                    run[name] = (pinned(run[name][0], everyone_else, (me, me), own, beside), None)
                if args.link_beside:  # the same worker, its link thread on the engine thread's core
                    run[LINK_BESIDE_PATH] = (
                        pinned(run["gateway"][0], everyone_else, (worker, worker), own,
                               lambda: [(worker, tid) for tid in named_threads(worker, "worker-link")]),
                        worker,
                    )  # fmt: skip
                run["gateway"] = (pinned(run["gateway"][0], everyone_else, (worker, worker), own), worker)
            if args.pin:  # both engine threads on the same core of their own; every other thread elsewhere
                run["raw, pinned"] = (pinned(run["raw"][0], everyone_else, (me, me), own), None)
                gateway_pinned = pinned(run["gateway"][0], everyone_else, (worker, worker), own)
                run["gateway, pinned"] = (gateway_pinned, worker)
            if args.neighbours:
                run["raw, neighbours"] = (beside_neighbours(run["raw"][0], neighbours), None)
            if args.compare_threads:
                run["raw, torch threads"] = (lambda ids=ids: raw(ids(), default_threads), None)
                run[THREADS_PATH] = (http(gw.url, "m-threads"), pids.get("m-threads"))
            if args.compare_env or args.compare_limits:
                run[ENV_PATH] = (http(gw.url, "m-env"), pids.get("m-env"))
            if args.admission_window_ms:
                run[WINDOW_PATH] = (http(gw.url, "m-window"), pids.get("m-window"))
            for size in sizes if procs is not None else ():
                run[processes_path(size)] = (http(procs.url(size), "m-procs"), procs.worker_pid)
            for path, name, _ in SPLITS if args.split else ():
                run[path] = (http(gw.url, name), pids.get(name))
            if args.peer:
                run["peer"] = (http(args.peer, args.peer_model), None)
            if args.pin_all:  # the other workers' rounds too: each engine thread on the same core
                pin_other_workers(run, everyone_else, own, tuple(gateway_pids))
            paths = [path for path in run if path.split(",")[0] in args.paths or path.startswith("peer")]
            rounds: dict[str, list[Round]] = {path: [] for path in paths}
            for path in paths:  # warm-up: this batch shape, once each
                run[path][0]()
            for turn in range(args.rounds):  # interleaved: every path once per round
                # Every other turn in reverse, so that no path always comes first (or always right
                # after another) and a pattern within a turn cannot favour one.
                for path in paths if turn % 2 == 0 else paths[::-1]:
                    rounds[path].append(measured(*run[path], gateway_pids.get(path, [gw.pid]), clocks))
            for path, done in rounds.items():
                row = {"path": path, "streams": count, **summarize(done), **thread_summary(done)}
                if path != "raw" and "raw" in rounds:
                    row.update(paired(done, rounds["raw"]))
                if path.startswith("gateway, ") and "over 2 GPUs" in path:  # the split against one GPU
                    row.update({f"one_gpu_{k}": v for k, v in paired(done, rounds["gateway"]).items()})
                if path == "gateway" and "raw, neighbours" in rounds:  # against raw with the same wake-ups
                    beside = paired(done, rounds["raw, neighbours"])
                    row.update({f"neighbours_{k}": v for k, v in beside.items()})
                neighbour_cpu = [r.neighbour_cpu_s for r in done if r.neighbour_cpu_s is not None]
                if neighbour_cpu:
                    seconds = sum(r.seconds for r in done)
                    row["neighbour_cpu_pct"] = round(100 * sum(neighbour_cpu) / seconds, 1)
                if path == WINDOW_PATH and "gateway" in rounds:  # this worker against the default one
                    row.update({f"window_{k}": v for k, v in paired(done, rounds["gateway"]).items()})
                if path in gateway_pids and "gateway" in rounds:  # against the default gateway
                    row.update({f"processes_{k}": v for k, v in paired(done, rounds["gateway"]).items()})
                one = processes_path(1)
                if path in gateway_pids and path != one and one in rounds:  # the same worker, one process
                    row.update({f"one_process_{k}": v for k, v in paired(done, rounds[one]).items()})
                if path.startswith("engine, ") and "engine" in rounds:  # a frame's cost to the steps
                    row.update({f"engine_{k}": v for k, v in paired(done, rounds["engine"]).items()})
                if path == LINK_BESIDE_PATH and "gateway" in rounds:  # the same worker, placed otherwise
                    row.update({f"beside_{k}": v for k, v in paired(done, rounds["gateway"]).items()})
                if path == ENV_PATH and "gateway" in rounds:  # the default worker against this one
                    row.update({f"default_{k}": v for k, v in paired(rounds["gateway"], done).items()})
                worker_cpu = [r.worker_cpu_s for r in done if r.worker_cpu_s is not None]
                if len(worker_cpu) == len(done):
                    row["worker_cpu_pct"] = round(100 * sum(worker_cpu) / sum(r.seconds for r in done), 1)
                gateway_cpu = [r.gateway_cpu_s for r in done if r.gateway_cpu_s is not None]
                if len(gateway_cpu) == len(done):  # the gateway process's CPU per streamed token
                    tokens = sum(s.tokens for r in done for s in r.streams)
                    row["gateway_cpu_us_per_token"] = round(1e6 * sum(gateway_cpu) / tokens, 1)
                shared = [r.engine_core_shared for r in done if r.engine_core_shared is not None]
                if shared:
                    row["engine_core_shared"] = round(sum(shared) / len(shared), 3)
                # Per round: the CPU the engine thread ran on most, and its share of the samples
                # (the host's cores need not run at one speed).
                row["engine_cpu_rounds"] = [r.engine_cpu for r in done]
                row["gpu_rounds"] = [r.gpu for r in done]
                row["round_ids"] = [r.round_id for r in done if r.round_id is not None]
                report["rows"].append(row)
            args.save()  # after each level: a run cut short keeps what it measured
            print(f"bench: {count} streams done", flush=True)
        report["worker_threads_after"] = {name: process_threads(pid) for name, pid in pids.items()}
        for count in args.logprob_streams:
            # With --fresh-prompts every round, of either path, sends prompts no round sent before.
            source = PromptSource(count, args.fresh_prompts, scenario="logprobs")
            http_round(gw.url, "m", source.texts(), args.new_tokens, 1)
            asks = {"gateway": None, LOGPROBS_PATH: 1}
            lp_rounds: dict[str, list[Round]] = {path: [] for path in asks}
            for turn in range(args.rounds):  # every other turn in reverse, as the levels run theirs
                for path in asks if turn % 2 == 0 else reversed(asks):
                    texts = source.texts()
                    lp_rounds[path].append(http_round(gw.url, "m", texts, args.new_tokens, asks[path]))
            for path, done in lp_rounds.items():
                row = {"path": path, "streams": count, **summarize(done)}
                if path == LOGPROBS_PATH:
                    row.update(paired(done, lp_rounds["gateway"]))
                report["logprobs"].append(row)
            args.save()
            print(f"bench: logprobs at {count} streams done", flush=True)
        if args.py_spy:
            profiler = Profiler(args.py_spy, args.out_dir / "profiles")
            spied = {"worker": pids["m"], "gateway": gw.pid}
            for count in args.streams[:: max(len(args.streams) - 1, 1)]:  # the first and last level
                texts = prompts(count)
                ids = [engine.encode(text, True) for text in texts]
                with profiler.record(f"raw-{count}", {"bench": os.getpid()}):
                    raw_round(args.engine, engine, ids, args.new_tokens)
                with profiler.record(f"gateway-{count}", spied):
                    http_round(gw.url, "m", texts, args.new_tokens, None)
                report["profiles"] = profiler.summaries
                args.save()
        report["worker"] = gw.workers()[0]["info"]
    # The gateways have stopped; the several processes' requests are in their own logs.
    process_logs = sorted((args.out_dir / "gateway-processes").glob("gateway-processes-*-*.log"))
    add_gateway_ttft(report["rows"], args.out_dir / f"bench-{args.engine}.log", *process_logs)
    for trace in traces.values():
        if trace is not None:
            trace.close()
    if args.trace:
        report["traces"] = {
            path.stem: trace_summary(str(path))
            for path in sorted(args.out_dir.glob(f"trace-{args.engine}-*.jsonl"))
        }
    engine.close()


def run_mixed(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """exllamav2 on GPU 0 and exllamav3 on GPU 1 in one gateway: each alone, then both at once."""
    count = args.mixed_streams
    models = [registry_entry("v2", "exllamav2", args.model, [0], args),
              registry_entry("v3", "exllamav3", args.mixed_model, [1], args)]  # fmt: skip
    config = write_registry(args.out_dir / "bench-mixed.yaml", models)
    with gateway(config, args.out_dir / "bench-mixed.log") as gw:
        texts = prompts(count)
        for name in ("v2", "v3"):
            http_round(gw.url, name, texts, args.new_tokens, None)
        alone: dict[str, list[Round]] = {"v2": [], "v3": []}
        both: dict[str, list[Round]] = {"v2": [], "v3": []}
        for _ in range(args.rounds):  # alone and together alternate
            for name in ("v2", "v3"):
                alone[name].append(http_round(gw.url, name, texts, args.new_tokens, None))
            with ThreadPoolExecutor(2) as pool:
                rounds = pool.map(lambda n: http_round(gw.url, n, texts, args.new_tokens, None), ("v2", "v3"))
                for name, done in zip(("v2", "v3"), rounds, strict=True):
                    both[name].append(done)
    for name in ("v2", "v3"):
        row_alone, row_both = summarize(alone[name]), summarize(both[name])
        report["mixed"].append({"model": name, "streams": count, "alone": row_alone, "together": row_both,
                                "ratio": row_both["tok_s_total"] / row_alone["tok_s_total"]})  # fmt: skip


# ---- report ------------------------------------------------------------------------------------


def _ratio(raw: dict[str, Any], gw: dict[str, Any]) -> tuple[float, str]:
    """The median of the per-turn ratios where the run has them (bench.streams.paired), with their
    spread and the plain ratio of the two medians beside it."""
    of_medians = gw["tok_s_total"] / raw["tok_s_total"]
    if "paired_ratio" not in gw:
        return of_medians, f"{of_medians:.3f}"
    ratio = gw["paired_ratio"]
    spread = f"{gw['paired_ratio_min']:.3f}-{gw['paired_ratio_max']:.3f}"
    return (
        ratio,
        f"{ratio:.3f} (turns {spread}{_interval(gw.get('paired_ratio_ci95'), '.3f', '-')}; "
        f"ratio of medians {of_medians:.3f})",
    )


def _interval(bounds: list[float] | None, fmt: str, sep: str) -> str:
    """'; median within A-B (95 %)': how far the turns place the median (bench.streams.median_interval)."""
    if not bounds:
        return ""
    return f"; median within {bounds[0]:{fmt}}{sep}{bounds[1]:{fmt}} (95 %)"


def _paired_spread(r: dict[str, Any], prefix: str) -> str:
    """'0.894 (turns 0.619-1.174; median within ...)': one paired tok/s ratio of a row, with its spread."""
    within = _interval(r.get(f"{prefix}_paired_ratio_ci95"), ".3f", "-")
    low, high = r[f"{prefix}_paired_ratio_min"], r[f"{prefix}_paired_ratio_max"]
    return f"{r[f'{prefix}_paired_ratio']:.3f} (turns {low:.3f}-{high:.3f}{within})"


def _ttft_added(raw: dict[str, Any], gw: dict[str, Any]) -> tuple[float, str]:
    of_medians = gw["ttft_ms_p50"] - raw["ttft_ms_p50"]
    if "paired_ttft_added_ms" not in gw:
        return of_medians, f"{of_medians:+.1f} ms"
    added = gw["paired_ttft_added_ms"]
    spread = f"{gw['paired_ttft_added_ms_min']:+.1f} to {gw['paired_ttft_added_ms_max']:+.1f}"
    within = _interval(gw.get("paired_ttft_added_ms_ci95"), "+.1f", " to ")
    return added, f"{added:+.1f} ms (turns {spread}{within}; of medians {of_medians:+.1f})"


def targets(rows: list[dict[str, Any]]) -> list[tuple[str, str, bool]]:
    """(target, measured, met) for each target of the paging and exllamav3 issues."""
    by = {(r["path"], r["streams"]): r for r in rows}
    out = []

    def pair(count: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
        raw, gw = by.get(("raw", count)), by.get(("gateway", count))
        return (raw, gw) if raw and gw else None

    for count, least in ((1, 0.98), (16, 0.95), (64, 0.95)):
        if p := pair(count):
            ratio, text = _ratio(*p)
            what = "1 stream: gateway tok/s" if count == 1 else f"{count} streams: total tok/s"
            out.append((f"{what} >= {least} x raw", text, ratio >= least))
    for count, most in ((1, 5), (64, 20)):
        if p := pair(count):
            added, text = _ttft_added(*p)
            out.append(
                (f"{count} stream{'s' if count > 1 else ''}: TTFT p50 + <= {most} ms", text, added <= most)
            )
    for count in sorted({r["streams"] for r in rows}):
        gw = by.get(("gateway", count))
        if gw and "gateway_cpu_us_per_token" in gw and gw.get("tokens_per_chunk") == 1.0:
            cpu = gw["gateway_cpu_us_per_token"]
            target = f"{count} streams: gateway CPU per streamed token <= 50 us"
            out.append((target, f"{cpu:.1f} us", cpu <= 50))
    for count in sorted({r["streams"] for r in rows}):
        if p := pair(count):
            limit, gap = p[0]["step_ms_p99"] + 5, p[1]["gap_ms_p99"]
            target = f"{count} streams: token gap p99 <= raw step p99 + 5 ms"
            out.append((target, f"{gap:.1f} vs {limit:.1f} ms", gap <= limit))
    return out


HEADER = (
    "| path | streams | tok/s total (min-max) | tok/s per stream | TTFT p50 / p99 ms "
    "| token gap p50 / p99 ms | step p50 / p99 ms | tokens per chunk | client CPU us/token | worker CPU % "
    "| gateway CPU us/token | engine core shared |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def row_line(r: dict[str, Any]) -> str:
    steps = f"{r['step_ms_p50']:.1f} / {r['step_ms_p99']:.1f}" if r["step_ms_p50"] is not None else "-"
    spread = f" ({r['tok_s_total_min']:.0f}-{r['tok_s_total_max']:.0f})" if "tok_s_total_min" in r else ""
    # The gateway's own view (routing to the first output from the worker), where its log has it.
    at_gateway = f" (at the gateway {r['gateway_ttft_ms_p50']:.1f})" if "gateway_ttft_ms_p50" in r else ""
    return (
        f"| {r['path']} | {r['streams']} | {r['tok_s_total']:.1f}{spread} | {r['tok_s_per_stream']:.1f} "
        f"| {r['ttft_ms_p50']:.1f} / {r['ttft_ms_p99']:.1f}{at_gateway} "
        f"| {r['gap_ms_p50']:.1f} / {r['gap_ms_p99']:.1f} "
        f"| {steps} | {r['tokens_per_chunk'] or '-'} | {r.get('client_cpu_us_per_token') or '-'} "
        f"| {r.get('worker_cpu_pct', '-')} | {r.get('gateway_cpu_us_per_token', '-')} "
        f"| {r.get('engine_core_shared', '-')} |"
    )


def thread_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The engine thread's table: where the process that drives the engine spent each round's wall
    time (the worker's, or this process's on the in-process paths); medians over the rounds."""
    rows = [r for r in rows if r.get("threads")]
    if not rows:
        return []
    lines = [
        "| path | streams | engine thread on a CPU % | waiting for a CPU % | sleeps per s | preempted per s "
        "| other threads CPU % | host steal % | other threads by name (last round) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["threads"]
        lines.append(
            f"| {r['path']} | {r['streams']} | {t.get('main_on_cpu_pct', '-')} "
            f"| {t.get('main_runqueue_pct', '-')} "
            f"| {t.get('main_sleeps_per_s', '-')} | {t.get('main_preempted_per_s', '-')} "
            f"| {t.get('others_cpu_pct', '-')} | {_or_dash(r.get('host_steal_pct'))} "
            f"| {t.get('others_by_name', '-')} |"
        )
    return [*lines, ""]


def cpu_round_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Each round's rate beside the CPU its engine thread ran on most (and the share of the
    samples it ran there), GPU 0's mean SM clock and its least free memory: whether one path's
    rounds were fast or slow by the core they got, by the clocks the GPU ran at, or with the GPU's
    memory all but taken."""
    rows = [r for r in rows if r.get("engine_cpu_rounds") and r.get("tok_s_rounds")]
    if not rows:
        return []
    lines = [
        "| path | streams | tok/s of each round @ the engine thread's CPU (share), GPU SM clock, "
        "least GPU memory free |",
        "|---|---|---|",
    ]
    for r in rows:
        gpus = r.get("gpu_rounds") or [None] * len(r["tok_s_rounds"])
        cells = [
            (f"{rate:.0f} @ {cpu[0]} ({cpu[1]:.2f})" if cpu else f"{rate:.0f} @ -")
            + (f", {gpu['sm_mhz']:.0f} MHz" if gpu else "")
            + (f", {gpu['free_mib_min'] / 1024:.1f} GiB free" if gpu and "free_mib_min" in gpu else "")
            for rate, cpu, gpu in zip(r["tok_s_rounds"], r["engine_cpu_rounds"], gpus, strict=False)
        ]
        lines.append(f"| {r['path']} | {r['streams']} | {', '.join(cells)} |")
    return [*lines, ""]


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def logprobs_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The logprobs target: each turn's logprobs round against its plain round (reports written
    before the rounds were paired give the ratio of the medians)."""
    by = {(r["path"], r["streams"]): r for r in rows}
    lines = []
    for count in sorted({r["streams"] for r in rows}):
        plain, with_lp = by.get(("gateway", count)), by.get((LOGPROBS_PATH, count))
        if not (plain and with_lp):
            continue
        ratio = with_lp.get("paired_ratio", with_lp["tok_s_total"] / plain["tok_s_total"])
        measured = f"{ratio:.3f}"
        if "paired_ratio" in with_lp:
            measured += f" (turns {with_lp['paired_ratio_min']:.3f}-{with_lp['paired_ratio_max']:.3f})"
        met = "yes" if ratio >= 0.90 else "**no**"
        lines.append(f"| {count} streams: logprobs 1 total tok/s >= 0.90 x without | {measured} | {met} |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    versions = report["versions"]
    lines = [
        f"{report['device']} | {report['date']} | {report['engine']} {versions['engine']} | "
        f"torch {versions['torch']} | {Path(report['model']).name} | greedy, {report['new_tokens']} new "
        f"tokens, median of {report['rounds']} interleaved rounds (spread: min-max of the rounds)"
        + (", every engine thread on one core" if report["settings"].get("engine_threads_pinned") else ""),
        "",
        HEADER,
        *(row_line(r) for r in report["rows"] + report["logprobs"]),
        "",
        *thread_lines(report["rows"]),
        *cpu_round_lines(report["rows"]),
        "| target | measured | met |",
        "|---|---|---|",
    ]
    for name, measured, met in targets(report["rows"]):
        lines.append(f"| {name} | {measured} | {'yes' if met else '**no**'} |")
    lines += logprobs_lines(report["logprobs"])
    for r in report["rows"]:
        if "default_paired_ratio" in r:
            spread = f"turns {r['default_paired_ratio_min']:.3f}-{r['default_paired_ratio_max']:.3f}"
            env = {**report["settings"]["compare_env"], **report["settings"].get("compare_limits", {})}
            lines.append(f"| {r['streams']} streams: gateway / {r['path']} {env}, paired | "
                         f"{r['default_paired_ratio']:.3f} ({spread}); TTFT "
                         f"{r['default_paired_ttft_added_ms']:+.1f} ms | - |")  # fmt: skip
        if "processes_paired_ratio" in r:
            within = _interval(r.get("processes_paired_ttft_added_ms_ci95"), "+.1f", " to ")
            lines.append(f"| {r['streams']} streams: {r['path']} on one port / gateway, paired | tok/s "
                         f"{r['processes_paired_ratio']:.3f}; TTFT "
                         f"{r['processes_paired_ttft_added_ms']:+.1f} ms{within} | - |")  # fmt: skip
        if "one_process_paired_ratio" in r:
            within = _interval(r.get("one_process_paired_ttft_added_ms_ci95"), "+.1f", " to ")
            lines.append(f"| {r['streams']} streams: {r['path']} / {processes_path(1)}, on one port each, "
                         f"paired | tok/s {r['one_process_paired_ratio']:.3f}; TTFT "
                         f"{r['one_process_paired_ttft_added_ms']:+.1f} ms{within} | - |")  # fmt: skip
        if "window_paired_ratio" in r:
            within = _interval(r.get("window_paired_ttft_added_ms_ci95"), "+.1f", " to ")
            window_ms = report["settings"]["admission_window_ms"]
            lines.append(f"| {r['streams']} streams: {r['path']} {window_ms} ms / "
                         f"gateway, paired | tok/s {r['window_paired_ratio']:.3f}; TTFT "
                         f"{r['window_paired_ttft_added_ms']:+.1f} ms{within} | - |")  # fmt: skip
        if "beside_paired_ratio" in r:
            lines.append(f"| {r['streams']} streams: {r['path']} / gateway, paired | tok/s "
                         f"{_paired_spread(r, 'beside')}; TTFT "
                         f"{r['beside_paired_ttft_added_ms']:+.1f} ms | - |")  # fmt: skip
        if "neighbours_paired_ratio" in r:
            lines.append(f"| {r['streams']} streams: gateway / raw beside neighbours "
                         f"{report['settings']['neighbours']}, paired | "
                         f"{_paired_spread(r, 'neighbours')} | - |")  # fmt: skip
        if "neighbour_cpu_pct" in r:
            lines.append(f"| {r['path']}, {r['streams']} streams: the neighbours' CPU, % of one core | "
                         f"{r['neighbour_cpu_pct']} | - |")  # fmt: skip
        if "engine_paired_ratio" in r:
            sleeps = r.get("threads", {}).get("main_sleeps_per_s")
            lines.append(f"| {r['streams']} streams: {r['path']} / engine, paired | tok/s "
                         f"{_paired_spread(r, 'engine')}; engine thread sleeps per s "
                         f"{'-' if sleeps is None else round(sleeps, 1)} | - |")  # fmt: skip
        if "one_gpu_paired_ratio" in r:
            spread = f"turns {r['one_gpu_paired_ratio_min']:.3f}-{r['one_gpu_paired_ratio_max']:.3f}"
            lines.append(f"| {r['path']}, {r['streams']} streams: tok/s / one GPU's | "
                         f"{r['one_gpu_paired_ratio']:.3f} ({spread}) | - |")  # fmt: skip
    for m in report["mixed"]:
        met = "yes" if m["ratio"] >= 0.95 else "**no**"
        target = f"mixed registry: {m['model']}, {m['streams']} streams, other model busy >= 0.95 x alone"
        measured = f"{m['together']['tok_s_total']:.1f} vs {m['alone']['tok_s_total']:.1f}: {m['ratio']:.3f}"
        lines.append(f"| {target} | {measured} | {met} |")
    if "cpu" in report:
        lines.append(f"| CPU (pinned rounds: the engine's CPUs, the others') | {report['cpu']} | - |")
    if "worker_threads" in report:
        lines.append(f"| worker threads (model: count) | {report['worker_threads']} | - |")
    for name, summary in report.get("traces", {}).items():
        lines.append(f"| step trace {name} | {summary} | - |")
    for label, summary in report.get("profiles", {}).items():
        busy = summary.get("samples", 0) - summary.get("idle", 0)
        top = "; ".join(f"{frame.split(' (')[0]} {pct}%" for frame, pct in summary.get("self_pct", [])[:6])
        lines.append(f"| profile {label}: {busy} busy samples, most self time | {top or summary} | - |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="exllamav2", choices=["exllamav2", "exllamav3"])
    parser.add_argument("--model", required=True, help="model folder (an 8B-shape demo model in gpu_run.sh)")
    parser.add_argument("--streams", default="1,4,16,64", help="concurrency levels")
    parser.add_argument("--logprob-streams", default="64", help="levels for logprobs vs none ('' to skip)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per level and path")
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--cache-size", type=int, default=65536, help="KV cache tokens, both paths")
    parser.add_argument("--fresh-prompts", action="store_true",
                        help="new prompts in every round, none found in the engines' caches from an "
                        "earlier one (default: the same prompts every round)")  # fmt: skip
    parser.add_argument(
        "--mixed-model", help="two GPUs: an exllamav3 model for GPU 1 (exllamav2 --model on 0)"
    )
    parser.add_argument("--mixed-streams", type=int, default=16)
    parser.add_argument("--skip-overhead", action="store_true", help="only the mixed-registry scenario")
    parser.add_argument(
        "--unpaged", action="store_true", help="exllamav2 with paged: false (as without flash-attn)"
    )
    parser.add_argument("--paths", default="raw,gateway", help="raw, engine (ours, in-process), gateway")
    parser.add_argument(
        "--raw-threads", type=int, default=1, help="torch CPU threads of the raw path (GPU workers run 1)"
    )
    parser.add_argument(
        "--compare-threads",
        action="store_true",
        help="also run raw and a second gateway worker with torch's default CPU threads (as shipped before)",
    )
    parser.add_argument(
        "--compare-env",
        type=env_assignments,
        default={},
        metavar="NAME=VALUE[,NAME=VALUE]",
        help="also run a second worker of the same model with these environment variables (path 'gateway, "
        "env'), interleaved with the default one, and report the default against it per round",
    )
    parser.add_argument(
        "--compare-limits",
        type=env_assignments,
        default={},
        metavar="NAME=VALUE[,NAME=VALUE]",
        help="the same second worker as --compare-env (path 'gateway, env'), with these `limits` of its "
        "registry entry (say burst_gather_ms=0); the two options combine",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="also raw and gateway rounds with the engine's thread pinned to one physical core of its own "
        "(the same core on both paths) and every other thread of the benchmark, gateway and worker elsewhere",
    )
    parser.add_argument(
        "--pin-all",
        action="store_true",
        help="as --pin, but for the raw, engine and gateway rounds themselves (no extra paths): on a host "
        "whose cores change speed independently, it makes the two rounds of a turn share one core's luck",
    )
    parser.add_argument(
        "--split",
        action="store_true",
        help="exllamav3 on two GPUs: also the gateway with the model split by layers and tensor-parallel",
    )
    parser.add_argument(
        "--gateway-processes",
        type=gateway_process_sizes,
        default=[],
        metavar="N[,N...]",
        help="also the same model behind N gateway processes on one port, for each N (cluster mode with "
        "server.reuse_port, every group in front of one listening worker; paths 'gateway, N processes'), "
        "interleaved with the default gateway and paired against it per round, and against one process "
        "when 1 is among them (the same worker and transport)",
    )
    parser.add_argument(
        "--processes-window-ms",
        type=float,
        default=0.0,
        help="with --gateway-processes: limits.admission_window_ms of the groups' listening worker, so "
        "that N processes against one are compared with the worker gathering bursts (the default "
        "gateway's worker keeps no window)",
    )
    parser.add_argument(
        "--admission-window-ms",
        type=float,
        default=0.0,
        help="also a second worker of the same model with limits.admission_window_ms set to this (path "
        "'gateway, admission window'), interleaved with the default one and paired against it per round",
    )
    parser.add_argument(
        "--neighbours",
        type=parse_loads,
        default=[],
        metavar="PERIOD_MS:BUSY_US[,...]",
        help="also raw rounds beside synthetic processes that wake every PERIOD_MS and then keep a CPU "
        "busy for BUSY_US (path 'raw, neighbours'; e.g. 27:600,27:340, as the gateway and the client at "
        "one stream)",
    )
    parser.add_argument(
        "--link-paths",
        action="store_true",
        help="also our engine in-process with each step's Step frame sent to a sink process: by the "
        "worker's link thread ('engine, link') and by the engine thread itself ('engine, direct'), each "
        "paired against 'engine' per round (bench/link_sink.py; needs 'engine' in --paths)",
    )
    parser.add_argument(
        "--link-modes",
        default="link,direct",
        help=f"with --link-paths, which senders ({', '.join(LINK_MODES)}); 'take' and 'take-send' are the "
        "floors of any second thread that takes, or takes and sends, each frame",
    )
    parser.add_argument(
        "--link-beside",
        action="store_true",
        help=f"with --pin-all, also the default worker's rounds with its link thread on the engine thread's "
        f"core (path '{LINK_BESIDE_PATH}'), paired against 'gateway' per round",
    )
    parser.add_argument("--peer", help="another OpenAI-compatible server's URL, driven by the same client")
    parser.add_argument("--peer-model", default="m", help="the model name to send to --peer")
    parser.add_argument("--trace", action="store_true", help="per-step traces of raw, engine and gateway")
    parser.add_argument(
        "--py-spy", help="py-spy binary: profile one round of each path at the first and last level"
    )
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    if args.unpaged and args.engine != "exllamav2":
        parser.error("--unpaged is exllamav2's paged: false")
    if args.split and args.engine != "exllamav3":
        parser.error("--split is exllamav3's layer split and tensor parallelism")
    if args.link_paths and "engine" not in args.paths.split(","):
        parser.error("--link-paths pairs its paths against 'engine': add it to --paths")
    if unknown := set(args.link_modes.split(",")) - set(LINK_MODES):
        parser.error(f"--link-modes: no such sender {', '.join(sorted(unknown))}")
    args.link_modes = args.link_modes.split(",") if args.link_paths else []
    if (args.link_beside or "link-beside" in args.link_modes) and not args.pin_all:
        parser.error("--link-beside puts the link thread beside the pinned engine thread: add --pin-all")
    if args.processes_window_ms and not args.gateway_processes:
        parser.error("--processes-window-ms sets the window of --gateway-processes' worker")
    args.streams = [int(s) for s in args.streams.split(",") if s]
    args.paths = args.paths.split(",")
    args.logprob_streams = [int(s) for s in args.logprob_streams.split(",") if s]
    args.out_dir.mkdir(parents=True, exist_ok=True)

    import importlib.metadata

    import torch

    engine_for_version = "exllamav2" if args.skip_overhead else args.engine
    report: dict[str, Any] = {
        "engine": args.engine, "model": args.model, "new_tokens": args.new_tokens, "rounds": args.rounds,
        "device": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {"engine": importlib.metadata.version(engine_for_version), "torch": torch.__version__,
                     "cuda": torch.version.cuda, "python": platform.python_version()},
        "settings": {**settings(args), "max_seq_len": args.max_seq_len, "greedy": True},
        "rows": [], "logprobs": [], "mixed": [], "errors": [],
    }  # fmt: skip
    stem = f"bench_{args.engine if not args.skip_overhead else 'mixed'}{'-unpaged' if args.unpaged else ''}"
    stem += "-split" if args.split else ""

    def save() -> str:
        report["targets"] = [
            {"target": t, "measured": m, "met": met} for t, m, met in targets(report["rows"])
        ]
        (args.out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1))
        table = markdown(report)
        (args.out_dir / f"{stem}.md").write_text(table + "\n")
        return table

    args.save = save
    scenarios = [] if args.skip_overhead else [run_overhead]
    if args.mixed_model and torch.cuda.device_count() >= 2:
        scenarios.append(run_mixed)
    for scenario in scenarios:
        try:
            scenario(args, report)
        except Exception as exc:  # one broken scenario must not lose the others' numbers
            print(f"bench: {scenario.__name__} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            report["errors"].append(f"{scenario.__name__}: {type(exc).__name__}: {str(exc)[:2000]}")
    print(save())
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
