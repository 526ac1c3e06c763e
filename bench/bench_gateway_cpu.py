"""Gateway overhead on CPU: the transformers engine in-process versus the same model over HTTP.

Runs as a standalone process (the bench process) on a CPU-only host. It drives the
`TransformersEngine` in this process (raw) and, through a gateway it starts (`python -m gateway
serve`, which spawns one worker process), `/v1/completions` streams read over httpx (gateway).
Both use the same demo model, prompt and settings (greedy, ignore_eos, fixed max_tokens,
threads=1); raw and gateway runs alternate, never overlapping. It measures tokens/s and time to
first token on both paths (median over repeats after one warm-up each) and their ratio; the
gateway's and worker's CPU time per streamed token over a burst of concurrent streams (utime +
stime from /proc/<pid>/stat); client inter-chunk gaps against the raw engine's step intervals;
and how much CPU other processes on the host used meanwhile, since that skews everything else.
Last, a concurrency sweep (`--concurrency 1,2,4,8`): at each level the same number of jobs at once
on each path (raw: submitted together to the engine; gateway: concurrent streams), total tokens/s
and median time to first token, plotted per path into a PNG next to the table (bench/plots.py).

`--compare CHECKOUT` measures only the gateway's CPU per streamed token, this tree against another
checkout (say a `git worktree` of the commit before a change), in one run: both gateways run side
by side, each with its own worker, and at each level of `--cpu-levels` their bursts alternate
(the order swapped every round) for `--rounds` rounds; each round's this ÷ compare is a paired
ratio. Gateway CPU there is read from /proc/<pid>/task/*/schedstat (nanoseconds on a CPU, every
thread), precise enough for one stream; utime and stime (10 ms ticks) are kept beside it.

`--request-levels 64` adds, in each round, bursts of 1-token streamed requests that many at a
time, and the gateway's CPU per request, this tree against the other, the same way.

    python bench/bench_gateway_cpu.py --model-preset medium --tokens 256 --repeats 5 --out bench/results
    python bench/bench_gateway_cpu.py --compare /tmp/before --rounds 5 --cpu-levels 1,8,32
    python bench/bench_gateway_cpu.py --compare /tmp/before --rounds 8 --cpu-levels 32 --request-levels 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import yaml  # noqa: E402

from bench.proc_cpu import busy_seconds, cpu_seconds, run_seconds, user_system_seconds  # noqa: E402
from tests.harness import GatewayProcess  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village, " * 2
MODEL_NAME = "bench"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values) or [0.0]
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


class CpuWatch:
    """CPU seconds of named processes over a window, plus what the rest of the machine used."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.start = {name: cpu_seconds(pid) for name, pid in pids.items()}
        self.busy, self.wall = busy_seconds(), time.perf_counter()

    def stop(self) -> dict[str, float]:
        used = {name: cpu_seconds(pid) - self.start[name] for name, pid in self.pids.items()}
        wall = time.perf_counter() - self.wall
        # Other processes, plus kernel time no process is charged for (loopback softirq).
        used["other_core_share"] = (busy_seconds() - self.busy - sum(used.values())) / wall
        used["wall_s"] = wall
        return used


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    all_gaps = [g for run in runs for g in gaps(run["times"])]
    return {
        "tok_s": statistics.median(r["tokens"] / (r["times"][-1] - r["started"]) for r in runs),
        "ttft_ms": 1000 * statistics.median(r["times"][0] - r["started"] for r in runs),
        "gap_ms_p50": 1000 * pct(all_gaps, 0.50),
        "gap_ms_p99": 1000 * pct(all_gaps, 0.99),
        "chunks_per_run": statistics.median(len(r["times"]) for r in runs),
        "tokens_per_run": statistics.median(r["tokens"] for r in runs),
        "tok_s_runs": [r["tokens"] / (r["times"][-1] - r["started"]) for r in runs],
    }


def raw_run(engine: Any, tokens: int) -> dict[str, Any]:
    """One greedy job in this process. Encoding is timed because the worker encodes inside the
    gateway path; "times" are outputs that carry text (what a client would receive as a chunk)."""
    from wire.params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    engine.submit(f"raw-{started}", engine.encode(PROMPT, add_special_tokens=True), params)
    steps: list[float] = []
    times: list[float] = []
    count = 0
    while engine.has_work():
        for output in engine.step():
            now = time.perf_counter()
            steps.append(now)
            count += len(output.token_ids)
            if output.text:
                times.append(now)
    return {"started": started, "times": times, "steps": steps, "tokens": count}


def http_run(client: httpx.Client, tokens: int, choices: int = 1) -> dict[str, Any]:
    """One streamed completion; a chunk's arrival time is when its SSE data line was read."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "n": choices,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    started = time.perf_counter()
    times: list[float] = []
    usage: dict[str, Any] = {}
    with client.stream("POST", "/v1/completions", json=body, timeout=300) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode()[:500]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if any(choice.get("text") for choice in event.get("choices", [])):
                times.append(time.perf_counter())
            usage = event.get("usage") or usage
    return {"started": started, "times": times, "tokens": usage.get("completion_tokens", len(times))}


def raw_level(engine: Any, count: int, tokens: int) -> dict[str, float]:
    """`count` greedy jobs submitted together: total tokens/s and median time to first token."""
    from wire.params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompt = engine.encode(PROMPT, add_special_tokens=True)
    started = time.perf_counter()
    first: dict[str, float] = {}
    for i in range(count):
        engine.submit(f"level-{started}-{i}", prompt, params)
    total = 0
    while engine.has_work():
        for output in engine.step():
            total += len(output.token_ids)
            if output.text and output.rid not in first:
                first[output.rid] = time.perf_counter() - started
    wall = time.perf_counter() - started
    return {"concurrency": count, "tok_s": total / wall, "ttft_ms": 1000 * statistics.median(first.values())}


def http_level(url: str, count: int, tokens: int) -> dict[str, float]:
    """`count` concurrent streams, each on its own connection, started together."""
    clients = [httpx.Client(base_url=url) for _ in range(count)]
    try:
        started = time.perf_counter()
        with ThreadPoolExecutor(count) as pool:
            runs = list(pool.map(lambda c: http_run(c, tokens), clients))
        wall = max(r["times"][-1] for r in runs) - started
    finally:
        for client in clients:
            client.close()
    return {
        "concurrency": count,
        "tok_s": sum(r["tokens"] for r in runs) / wall,
        "ttft_ms": 1000 * statistics.median(r["times"][0] - r["started"] for r in runs),
    }


def sweep(engine: Any, url: str, args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    """Each level on both paths, alternating, `--repeats` times; the median run of each is kept."""
    levels = [int(c) for c in args.concurrency.split(",")]
    series: dict[str, list[dict[str, float]]] = {"raw engine, in-process": [], "gateway, HTTP streams": []}
    for count in levels:
        raws, https = [], []
        for _ in range(max(args.repeats // 2, 1)):
            raws.append(raw_level(engine, count, args.tokens))
            https.append(http_level(url, count, args.tokens))
        for name, runs in (("raw engine, in-process", raws), ("gateway, HTTP streams", https)):
            runs.sort(key=lambda r: r["tok_s"])
            series[name].append(runs[len(runs) // 2])
    return series


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"threads": 1, "max_batch_size": args.streams * args.choices, "max_chunk_size": 2048}


def measure(model_dir: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Raw and gateway runs alternate (never overlap), so slow drift in background load hits both."""
    from model_worker.engines.registry import create_engine

    engine = create_engine("transformers", str(model_dir), 2048, engine_settings(args))
    engine.load(lambda detail, progress: None)
    entry = {"name": MODEL_NAME, "engine": "transformers", "path": str(model_dir), "max_seq_len": 2048,
             "engine_settings": engine_settings(args),
             "limits": {"max_concurrent_jobs": args.streams * args.choices,
                        "max_queued_requests": 64}}  # fmt: skip
    config = work / "models.yaml"
    config.write_text(yaml.safe_dump({"models": [entry]}))
    with GatewayProcess(config, ready_timeout=300, log_path=work / "gateway.log") as gw:
        pids = {"bench": os.getpid(), "gateway": gw.pid, "worker": int(gw.workers()[0]["pid"])}
        with httpx.Client(base_url=gw.url) as client:
            raw_run(engine, args.tokens)  # one warm-up each
            http_run(client, args.tokens)
            raw_runs, http_runs = [], []
            watch = CpuWatch(pids)
            for _ in range(args.repeats):
                raw_runs.append(raw_run(engine, args.tokens))
                http_runs.append(http_run(client, args.tokens))
            single_cpu = watch.stop()
        levels = sweep(engine, gw.url, args)
        engine.close()
        watch = CpuWatch(pids)  # idle: heartbeats and timers only
        time.sleep(args.idle_s)
        idle_cpu = watch.stop()
        clients = [httpx.Client(base_url=gw.url) for _ in range(args.streams)]
        watch = CpuWatch(pids)
        with ThreadPoolExecutor(args.streams) as pool:
            burst = list(
                pool.map(lambda c: http_run(c, args.burst_tokens or args.tokens, args.choices), clients)
            )
        burst_cpu = watch.stop()
        for client in clients:
            client.close()
    steps = [g for run in raw_runs for g in gaps(run["steps"])]
    streamed = sum(r["tokens"] for r in burst)
    return {
        "raw": {**summarize(raw_runs), "step_ms_p50": 1000 * pct(steps, 0.5),
                "step_ms_p99": 1000 * pct(steps, 0.99)},
        "gateway": summarize(http_runs),
        "burst": {"streams": args.streams, "choices": args.choices, "tokens": streamed,
                  "tok_s": streamed / burst_cpu["wall_s"],
                  "chunks": sum(len(r["times"]) for r in burst),
                  **{f"{k}_us_per_token": 1e6 * burst_cpu[k] / streamed for k in pids}},
        "cpu_s": {"single_stream_phase": single_cpu, "idle": idle_cpu, "burst": burst_cpu},
        "concurrency": levels,
    }  # fmt: skip


# ---- report -----------------------------------------------------------------------------------


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "preset": args.model_preset, "tokens": args.tokens, "repeats": args.repeats,
        "prompt_chars": len(PROMPT),
    }  # fmt: skip


def markdown(report: dict[str, Any]) -> str:
    env, raw, gw = report["env"], report["raw"], report["gateway"]
    burst, cpu = report["burst"], report["cpu_s"]
    lines = [
        f"{env['cpu']}, {env['cores']} cores | {env['date']} | python {env['python']} | "
        f"torch {env['torch']} | transformers {env['transformers']}",
        f"demo model `{env['preset']}`, greedy, ignore_eos, {env['tokens']} tokens, threads=1, "
        f"median of {env['repeats']} (raw and gateway alternating) after 1 warm-up each",
        "",
        "| path | tok/s | TTFT ms | chunk gap p50 ms | chunk gap p99 ms | chunks/run |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in (("raw engine, in-process", raw), ("gateway, HTTP stream at client", gw)):
        lines.append(f"| {name} | {r['tok_s']:.1f} | {r['ttft_ms']:.2f} | {r['gap_ms_p50']:.3f} | "
                     f"{r['gap_ms_p99']:.3f} | {r['chunks_per_run']:.0f} |")  # fmt: skip
    share = cpu["single_stream_phase"]["other_core_share"], cpu["burst"]["other_core_share"]
    lines += [
        "",
        "| metric | value |",
        "|---|---|",
        f"| gateway tok/s ÷ raw tok/s | {report['ratios']['tok_s_ratio']:.3f} |",
        f"| TTFT added by the gateway | {report['ratios']['ttft_added_ms']:.2f} ms |",
        f"| raw engine step interval p50 / p99 | {raw['step_ms_p50']:.3f} / {raw['step_ms_p99']:.3f} ms |",
        f"| burst | {burst['streams']} streams × {burst['choices']} choices, {burst['tokens']} tokens, "
        f"{burst['tok_s']:.1f} tok/s total, {burst['chunks']} chunks |",
        f"| gateway CPU per streamed token | {burst['gateway_us_per_token']:.1f} µs |",
        f"| worker CPU per streamed token | {burst['worker_us_per_token']:.1f} µs |",
        f"| bench client CPU per streamed token | {burst['bench_us_per_token']:.1f} µs |",
        f"| idle CPU gateway / worker | {1000 * cpu['idle']['gateway'] / cpu['idle']['wall_s']:.2f} / "
        f"{1000 * cpu['idle']['worker'] / cpu['idle']['wall_s']:.2f} ms/s |",
        f"| other load on the host (single-stream phase / burst) | {share[0]:.2f} / {share[1]:.2f} cores |",
        "",
        "| concurrent requests | raw tok/s | gateway tok/s | raw TTFT ms | gateway TTFT ms |",
        "|---|---|---|---|---|",
    ]
    raw_levels, gw_levels = report["concurrency"].values()
    for r, g in zip(raw_levels, gw_levels, strict=True):
        lines.append(f"| {r['concurrency']} | {r['tok_s']:.1f} | {g['tok_s']:.1f} | {r['ttft_ms']:.1f} | "
                     f"{g['ttft_ms']:.1f} |")  # fmt: skip
    return "\n".join(lines)


# ---- this tree against another checkout: gateway CPU per streamed token ----------------------


def cpu_burst(url: str, pid: int, streams: int, tokens: int, requests: int = 1) -> dict[str, float]:
    """`streams` concurrent streams of `tokens` tokens, `requests` one after another on each; the
    gateway's CPU per token streamed."""
    clients = [httpx.Client(base_url=url) for _ in range(streams)]
    try:
        user0, sys0 = user_system_seconds(pid)
        run0, busy0, wall0 = run_seconds(pid), busy_seconds(), time.perf_counter()
        with ThreadPoolExecutor(streams) as pool:
            per_client = list(pool.map(lambda c: [http_run(c, tokens) for _ in range(requests)], clients))
        runs = [run for each in per_client for run in each]
        run1, busy1, wall = run_seconds(pid), busy_seconds(), time.perf_counter() - wall0
        user1, sys1 = user_system_seconds(pid)
    finally:
        for client in clients:
            client.close()
    streamed = sum(r["tokens"] for r in runs)
    chunks = sum(len(r["times"]) for r in runs)
    return {
        "us_per_token": 1e6 * (run1 - run0) / streamed,
        "user_us_per_token": 1e6 * (user1 - user0) / streamed,
        "sys_us_per_token": 1e6 * (sys1 - sys0) / streamed,
        "tokens": streamed,
        "chunks": chunks,
        "tok_s": streamed / wall,
        # Every core's busy time but this gateway's: the worker and the client are most of it.
        "rest_cores": (busy1 - busy0 - (run1 - run0)) / wall,
    }


def request_burst(url: str, pid: int, concurrency: int, requests: int) -> dict[str, float]:
    """`requests` streamed 1-token completions, `concurrency` at a time on kept-alive connections,
    from one asyncio client (threads of a sync client would take the cores the gateway needs): the
    gateway's CPU per request (parsing, routing, admission, the worker's round trip, the access
    line), which sets how long a burst of new requests queues before its first tokens."""
    import aiohttp

    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    per_client = -(-requests // concurrency)

    async def client(session: aiohttp.ClientSession) -> None:
        for _ in range(per_client):
            async with session.post("/v1/completions", json=body) as response:
                text = await response.text()
                if response.status != 200 or not text.rstrip().endswith("data: [DONE]"):
                    raise RuntimeError(f"HTTP {response.status}: {text[:300]}")

    async def connect(session: aiohttp.ClientSession) -> None:
        async with session.get("/v1/models") as response:  # opens one kept-alive connection
            await response.read()

    async def burst() -> tuple[float, float, float]:
        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(url, connector=connector) as session:
            await asyncio.gather(*(connect(session) for _ in range(concurrency)))
            run0, busy0, wall0 = run_seconds(pid), busy_seconds(), time.perf_counter()
            await asyncio.gather(*(client(session) for _ in range(concurrency)))
            return run_seconds(pid) - run0, busy_seconds() - busy0, time.perf_counter() - wall0

    used, busy, wall = asyncio.run(burst())
    done = per_client * concurrency
    return {"us_per_request": 1e6 * used / done, "requests": done, "rest_cores": (busy - used) / wall}


def compare_checkouts(model_dir: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    levels = [int(c) for c in args.cpu_levels.split(",") if c]
    streams = max(levels, default=8)
    settings = {"threads": 1, "max_batch_size": streams, "max_chunk_size": 2048}
    entry = {"name": MODEL_NAME, "engine": "transformers", "path": str(model_dir), "max_seq_len": 2048,
             "engine_settings": settings,
             "limits": {"max_concurrent_jobs": streams, "max_queued_requests": 64}}  # fmt: skip
    config = work / "models.yaml"
    config.write_text(yaml.safe_dump({"models": [entry]}))
    other = args.compare.resolve()
    # PYTHONSAFEPATH: `python -m gateway` must not import this tree's package from its cwd.
    envs = {"this": {"PYTHONPATH": str(REPO_ROOT), "PYTHONSAFEPATH": "1"},
            "compare": {"PYTHONPATH": str(other), "PYTHONSAFEPATH": "1"}}  # fmt: skip
    rows: dict[str, dict[int, list[dict[str, float]]]] = {n: {c: [] for c in levels} for n in envs}
    request_levels = [int(c) for c in args.request_levels.split(",") if c]
    request_rows: dict[str, dict[int, list[dict[str, float]]]] = {
        n: {c: [] for c in request_levels} for n in envs
    }
    with (
        GatewayProcess(config, env=envs["this"], ready_timeout=300, log_path=work / "this.log") as this,
        GatewayProcess(config, env=envs["compare"], ready_timeout=300, log_path=work / "compare.log") as cmp,
    ):
        gateways = {"this": this, "compare": cmp}
        for gw in gateways.values():  # warm-up
            cpu_burst(gw.url, gw.pid, 2, 64)
        for round_no in range(args.rounds):
            for count in levels:
                # A request stays within the demo model's context (2048): fewer streams take turns.
                tokens = max(args.cpu_tokens // count, 64)
                requests = -(-tokens // 1900)
                tokens = -(-tokens // requests)
                order = ["this", "compare"] if round_no % 2 == 0 else ["compare", "this"]
                for name in order:
                    gw = gateways[name]
                    result = cpu_burst(gw.url, gw.pid, count, tokens, requests)
                    result["round"], result["started"] = round_no, time.time()
                    rows[name][count].append(result)
                    user, system = result["user_us_per_token"], result["sys_us_per_token"]
                    print(f"round {round_no} streams {count:>3} {name:>7}: {result['us_per_token']:.1f} "
                          f"us/token (user {user:.1f}, sys {system:.1f}), {result['chunks']} chunks / "
                          f"{result['tokens']} tokens", flush=True)  # fmt: skip
            for count in request_levels:
                order = ["this", "compare"] if round_no % 2 == 0 else ["compare", "this"]
                for name in order:
                    gw = gateways[name]
                    result = request_burst(gw.url, gw.pid, count, args.burst_requests)
                    result["round"], result["started"] = round_no, time.time()
                    request_rows[name][count].append(result)
                    print(f"round {round_no} requests {count:>3} at once {name:>7}: "
                          f"{result['us_per_request']:.0f} us/request", flush=True)  # fmt: skip
    commit = {name: _commit(path) for name, path in (("this", REPO_ROOT), ("compare", other))}
    return {"levels": levels, "rounds": rows, "commits": commit, "cpu_tokens": args.cpu_tokens,
            "request_levels": request_levels, "request_rounds": request_rows,
            "burst_requests": args.burst_requests, "rounds_run": args.rounds}  # fmt: skip


def _commit(path: Path) -> str:
    import subprocess

    head = subprocess.run(
        ["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    # What the gateway runs: changes elsewhere in the tree (tests, docs) do not make it another build.
    dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no", "--",
                            "gateway", "wire"], capture_output=True, text=True)  # fmt: skip
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def compare_markdown(report: dict[str, Any]) -> str:
    env, rows, commits = report["env"], report["rounds"], report["commits"]

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"

    lines = [
        f"{env['cpu']}, {env['cores']} cores | {env['date']} | python {env['python']} | "
        f"torch {env['torch']} | transformers {env['transformers']}",
        f"demo model `{env['preset']}`, greedy, ignore_eos, /v1/completions streams with include_usage; "
        f"about {report['cpu_tokens']} tokens per burst; this = {commits['this']}, compare = "
        f"{commits['compare']}; {report['rounds_run']} rounds, bursts alternating",
        "",
        "| streams | this µs/token (min-max) | user / sys | compare µs/token (min-max) | user / sys | "
        "this ÷ compare, paired (min-max) | rounds lower | chunks = tokens | rest of host (cores) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for count in report["levels"]:
        mine, theirs = rows["this"][count], rows["compare"][count]
        ratios = [a["us_per_token"] / b["us_per_token"] for a, b in zip(mine, theirs, strict=True)]
        lower = sum(r < 1 for r in ratios)
        one_per_chunk = all(r["chunks"] == r["tokens"] for r in mine + theirs)
        rest = [r["rest_cores"] for r in mine + theirs]

        def parts(rs: list[dict[str, float]]) -> str:
            user = statistics.median(r["user_us_per_token"] for r in rs)
            return f"{user:.1f} / {statistics.median(r['sys_us_per_token'] for r in rs):.1f}"

        lines.append(
            f"| {count} | {spread([r['us_per_token'] for r in mine])} | {parts(mine)} | "
            f"{spread([r['us_per_token'] for r in theirs])} | {parts(theirs)} | "
            f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) | "
            f"{lower} of {len(ratios)} | {one_per_chunk} | {min(rest):.2f}-{max(rest):.2f} |"
        )
    if report.get("request_levels"):
        lines += [
            "",
            f"Per request: {report['burst_requests']} streamed completions of one token per burst "
            "(max_tokens 1, include_usage), the given number at a time on kept-alive connections.",
            "",
            "| at once | this µs/request (min-max) | compare µs/request (min-max) | "
            "this ÷ compare, paired (min-max) | rounds lower | rest of host (cores) |",
            "|---|---|---|---|---|---|",
        ]
    for count in report.get("request_levels", []):
        mine, theirs = report["request_rounds"]["this"][count], report["request_rounds"]["compare"][count]
        ratios = [a["us_per_request"] / b["us_per_request"] for a, b in zip(mine, theirs, strict=True)]
        rest = [r["rest_cores"] for r in mine + theirs]
        lines.append(
            f"| {count} | {spread([r['us_per_request'] for r in mine])} | "
            f"{spread([r['us_per_request'] for r in theirs])} | "
            f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) | "
            f"{sum(r < 1 for r in ratios)} of {len(ratios)} | {min(rest):.2f}-{max(rest):.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-preset", default="medium", choices=["small", "medium"])
    parser.add_argument("--tokens", type=int, default=256, help="max_tokens per single-stream run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams in the CPU burst")
    parser.add_argument("--burst-tokens", type=int, help="max_tokens per burst stream (default: --tokens)")
    parser.add_argument(
        "--choices",
        type=int,
        default=1,
        help="n per burst request: one step then queues n outputs per stream",
    )
    parser.add_argument("--idle-s", type=float, default=2.0, help="idle window for the baseline CPU rate")
    parser.add_argument("--concurrency", default="1,2,4,8", help="levels of the sweep (at most --streams)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--compare", type=Path, help="another checkout: gateway CPU per token, this vs it")
    parser.add_argument("--rounds", type=int, default=5, help="with --compare: rounds per level")
    parser.add_argument("--cpu-levels", default="1,8,32", help="with --compare: concurrent streams per burst")
    parser.add_argument(
        "--cpu-tokens", type=int, default=4096, help="with --compare: tokens per burst, all streams"
    )
    parser.add_argument(
        "--request-levels",
        default="",
        help="with --compare: also CPU per 1-token request, this many at a time (e.g. 64)",
    )
    parser.add_argument(
        "--burst-requests", type=int, default=384, help="with --request-levels: requests per burst"
    )
    args = parser.parse_args(argv)

    from gateway.demo.model import make_demo_model

    if args.compare is not None:
        return compare_main(args)

    report: dict[str, Any] = {"env": environment(args)}
    with tempfile.TemporaryDirectory(prefix="bench-gw-cpu-") as tmp:
        work = Path(tmp)
        model_dir = make_demo_model(work / "model", preset=args.model_preset, seed=0)
        report.update(measure(model_dir, work, args))
    raw, gw = report["raw"], report["gateway"]
    report["ratios"] = {
        "tok_s_ratio": gw["tok_s"] / raw["tok_s"],
        "ttft_added_ms": gw["ttft_ms"] - raw["ttft_ms"],
    }
    table = markdown(report)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_gateway_cpu_{report['env']['date'].replace(':', '')}"
    (args.out / f"{stem}.md").write_text(table + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    from bench.plots import concurrency_plot

    env = report["env"]
    concurrency_plot(
        report["concurrency"],
        f"Gateway overhead on the CPU engine (demo model {env['preset']}, {env['tokens']} tokens, greedy)",
        f"{env['cpu']}, {env['cores']} cores, {env['date']}, torch {env['torch']}",
        args.out / f"{stem}.png",
    )
    print(table)
    print(f"\nwrote {args.out / stem}.md, .json and .png")
    return 0


def compare_main(args: argparse.Namespace) -> int:
    from gateway.demo.model import make_demo_model

    report: dict[str, Any] = {"env": environment(args)}
    with tempfile.TemporaryDirectory(prefix="bench-gw-cpu-") as tmp:
        work = Path(tmp)
        model_dir = make_demo_model(work / "model", preset=args.model_preset, seed=0)
        report.update(compare_checkouts(model_dir, work, args))
    table = compare_markdown(report)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"gateway_cpu_compare_{report['env']['date'].replace(':', '')}"
    (args.out / f"{stem}.md").write_text(table + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table)
    print(f"\nwrote {args.out / stem}.md and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
