"""Routing over replicas on the CPU engine: how evenly 8 replicas share a burst, and what routing costs.

Runs as a standalone process (the bench process) on a CPU-only host. It starts two gateways
(`tests.harness.GatewayProcess`) on the same tiny demo model (`make_demo_model(preset="small")`),
one with `replicas: 1` and one with `replicas: 8` (each replica `threads: 1`, `max_batch_size: 4`,
`limits.max_concurrent_jobs: 4`), and waits until every worker of both is ready. Then:

- evenness: bursts of K concurrent `/v1/completions` (default 5 bursts of 64, `max_tokens` 8,
  `ignore_eos`) to the 8-replica gateway; each replica's request count is its
  `stats.generated_tokens` delta in `/admin/workers` (read once the heartbeats carried every token)
  divided by the tokens per request; reported with the coefficient of variation (population stdev /
  mean) across replicas. Then the same with as many requests as the replicas take at once
  (8 x 4 = 32), which isolates the routing decision from how fast each replica drains its queue;
- routing overhead: the gateway-side time from a request's arrival to its Generate frame is not
  observable from outside, so the same sequence of single requests (one at a time, greedy) goes to
  both gateways in alternating blocks, and the end-to-end latencies are compared (8 replicas minus 1);
- gateway CPU per request: utime + stime of the gateway process (/proc/<pid>/stat) over the burst
  and over the sequential runs, idle time included; the idle rate (heartbeats, timers) is reported
  beside it so it can be judged.

- a concurrency sweep (`--concurrency 1,4,16,64`): at each level that many streamed requests at
  once (`--sweep-tokens` each) to each gateway, total tokens/s and median time to first token per
  gateway, plotted into a PNG next to the table (bench/plots.py).

On a 2-core machine the 8 workers, both gateways and this client compete for CPU, so latencies
and the burst's wall time say little about a GPU host; the counts, the CV and the gateway CPU per
request are the portable numbers. The output says so.

    python bench/bench_routing.py --requests 64 --bursts 5 --max-tokens 8 --sequential 200 --out bench/results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402

from bench.proc_cpu import TICK, busy_seconds, cpu_seconds  # noqa: E402
from tests.harness import GatewayProcess  # noqa: E402
from tests.integration.conftest import demo_entry, write_registry  # noqa: E402

MODEL = "m"
PROMPT = "Routing over replicas: the quick brown fox jumps over the lazy dog."
HEARTBEAT_S = 1.0  # the registry's default (tests use 0.2); routing never waits on heartbeats


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def replicas(gateway: GatewayProcess) -> list[dict[str, Any]]:
    workers = [w for w in gateway.workers() if w["model"] == MODEL]
    return sorted(workers, key=lambda w: int(w["replica"]))


def wait_all_ready(gateway: GatewayProcess, count: int, timeout: float) -> None:
    """/health/ready needs one ready replica; this waits for all, with their first heartbeat."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = replicas(gateway)
        if len(workers) == count and all(
            w["state"] == "ready" and "generated_tokens" in w["stats"] for w in workers
        ):
            return
        time.sleep(0.2)
    raise TimeoutError(f"not all {count} replicas ready after {timeout}s: {replicas(gateway)}")


def generated(gateway: GatewayProcess) -> dict[str, int]:
    return {w["id"]: int(w["stats"]["generated_tokens"]) for w in replicas(gateway)}


def settle(gateway: GatewayProcess, expected_total: int, before: dict[str, int], timeout: float = 10) -> None:
    """Wait until the heartbeats have carried every generated token into /admin/workers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        after = generated(gateway)
        if sum(after.values()) - sum(before.values()) >= expected_total:
            return
        time.sleep(0.2)
    carried = sum(generated(gateway).values()) - sum(before.values())
    raise RuntimeError(f"heartbeats carried {carried} of {expected_total} generated tokens in {timeout}s")


def body(max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


async def burst(url: str, count: int, max_tokens: int) -> tuple[list[int], float]:
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        started = time.perf_counter()
        replies = await asyncio.gather(
            *(client.post("/v1/completions", json=body(max_tokens)) for _ in range(count))
        )
        wall = time.perf_counter() - started
    return [r.status_code for r in replies], wall


async def stream_burst(url: str, count: int, max_tokens: int) -> dict[str, float]:
    """`count` streamed requests at once: total tokens/s and median time to first token."""
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    payload = {**body(max_tokens), "stream": True, "stream_options": {"include_usage": True}}

    async def one(client: httpx.AsyncClient, started: float) -> tuple[float, int, float]:
        first, tokens = 0.0, 0
        async with client.stream("POST", "/v1/completions", json=payload) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if not first and any(c.get("text") for c in chunk.get("choices", [])):
                    first = time.perf_counter() - started
                if chunk.get("usage"):
                    tokens = int(chunk["usage"]["completion_tokens"])
        return first, tokens, time.perf_counter()

    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        started = time.perf_counter()
        runs = await asyncio.gather(*(one(client, started) for _ in range(count)))
    wall = max(end for _, _, end in runs) - started
    return {
        "concurrency": count,
        "tok_s": sum(tokens for _, tokens, _ in runs) / wall,
        "ttft_ms": 1000 * statistics.median(first for first, _, _ in runs),
    }


def concurrency_sweep(gateways: dict[str, GatewayProcess], args: argparse.Namespace) -> dict[str, Any]:
    """Each level to each gateway in turn, `--bursts` times; the median run of each is kept."""
    series: dict[str, list[dict[str, float]]] = {name: [] for name in gateways}
    for count in (int(c) for c in args.concurrency.split(",")):
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in gateways}
        for _ in range(args.bursts):
            for name, gateway in gateways.items():
                runs[name].append(asyncio.run(stream_burst(gateway.url, count, args.sweep_tokens)))
        for name, measured in runs.items():
            measured.sort(key=lambda r: r["tok_s"])
            series[name].append(measured[len(measured) // 2])
    return series


def cv(values: list[float]) -> float:
    """Coefficient of variation: population standard deviation over the mean."""
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean else float("nan")


def evenness(gateway: GatewayProcess, count: int, bursts: int, max_tokens: int) -> dict[str, Any]:
    """`bursts` bursts of `count` concurrent requests; per-replica request counts of each burst."""
    per_burst: list[list[float]] = []
    walls: list[float] = []
    cpu = 0.0
    for _ in range(bursts):
        before = generated(gateway)
        cpu_before = cpu_seconds(gateway.pid)
        statuses, wall = asyncio.run(burst(gateway.url, count, max_tokens))
        cpu += cpu_seconds(gateway.pid) - cpu_before
        if any(s != 200 for s in statuses):
            raise RuntimeError(f"burst statuses: {sorted(set(statuses))}")
        settle(gateway, count * max_tokens, before)
        after = generated(gateway)
        per_burst.append([(after[wid] - before.get(wid, 0)) / max_tokens for wid in after])
        walls.append(wall)
    totals = [sum(column) for column in zip(*per_burst, strict=True)]
    cvs = [cv(counts) for counts in per_burst]
    return {
        "requests_per_burst": count,
        "bursts": bursts,
        "per_replica_each_burst": per_burst,
        "per_replica_total": totals,
        "cv_each_burst": cvs,
        "cv_median": statistics.median(cvs),
        "cv_total": cv(totals),
        "wall_s_each_burst": walls,
        "gateway_cpu_us_per_request": 1e6 * cpu / (count * bursts),
    }


def sequential(gateways: dict[str, GatewayProcess], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The same single requests, one at a time, to each gateway in alternating blocks."""
    clients = {name: httpx.Client(base_url=gw.url, timeout=120) for name, gw in gateways.items()}
    latencies: dict[str, list[float]] = {name: [] for name in gateways}
    cpu: dict[str, float] = dict.fromkeys(gateways, 0.0)
    try:
        for client in clients.values():  # one warm-up each (connection, first prefill)
            client.post("/v1/completions", json=body(args.max_tokens)).raise_for_status()
        blocks = -(-args.sequential // args.block)
        for block in range(blocks):
            order = list(gateways) if block % 2 == 0 else list(reversed(gateways))
            for name in order:
                start_cpu = cpu_seconds(gateways[name].pid)
                for _ in range(min(args.block, args.sequential - block * args.block)):
                    started = time.perf_counter()
                    clients[name].post("/v1/completions", json=body(args.max_tokens)).raise_for_status()
                    latencies[name].append(time.perf_counter() - started)
                cpu[name] += cpu_seconds(gateways[name].pid) - start_cpu
    finally:
        for client in clients.values():
            client.close()
    return {
        name: {
            "requests": len(values),
            "median_ms": 1000 * statistics.median(values),
            "p90_ms": 1000 * pct(values, 0.9),
            "gateway_cpu_us_per_request": 1e6 * cpu[name] / len(values),
        }
        for name, values in latencies.items()
    }


class OtherLoad:
    """Cores used by everything but this benchmark's processes (gateways, workers, this client)."""

    def __init__(self, gateways: dict[str, GatewayProcess]) -> None:
        self.pids = [os.getpid()] + [gw.pid for gw in gateways.values()]
        self.pids += [int(w["pid"]) for gw in gateways.values() for w in replicas(gw)]
        self.start = (busy_seconds(), sum(map(cpu_seconds, self.pids)), time.perf_counter())

    def cores(self) -> float:
        busy, ours, wall = self.start
        return (busy_seconds() - busy - (sum(map(cpu_seconds, self.pids)) - ours)) / (
            time.perf_counter() - wall
        )


def idle_cpu(gateways: dict[str, GatewayProcess], seconds: float) -> dict[str, float]:
    """Gateway CPU ms per second with no requests: heartbeats from its workers and its own timers."""
    start = {name: cpu_seconds(gw.pid) for name, gw in gateways.items()}
    time.sleep(seconds)
    return {name: 1000 * (cpu_seconds(gw.pid) - start[name]) / seconds for name, gw in gateways.items()}


# ---- report -----------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    import hypercorn
    import quart
    import torch
    import transformers
    import zmq

    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True
        )
        commit += "+uncommitted" if dirty.stdout.strip() else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"

    def version(module: Any) -> str:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            return dist_version(module.__name__)
        except PackageNotFoundError:
            return str(getattr(module, "__version__", "unknown"))

    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_kb / 2**20, 1),
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "pyzmq": zmq.__version__, "quart": version(quart),
        "hypercorn": version(hypercorn), "commit": commit,
    }  # fmt: skip


def markdown(report: dict[str, Any]) -> str:
    env, conf, seq, idle = (report[k] for k in ("env", "config", "sequential", "idle"))
    many = f"replicas_{conf['replicas']}"
    one, eight = seq["replicas_1"], seq[many]

    def counts(values: list[float]) -> str:
        return " / ".join(f"{v:.0f}" for v in values)

    lines = [
        f"{env['cpu']}, {env['cores']} cores, {env['memory_gib']} GiB | {env['date']} | "
        f"python {env['python']} | torch {env['torch']} | transformers {env['transformers']} | "
        f"pyzmq {env['pyzmq']} | quart {env['quart']} | hypercorn {env['hypercorn']} | "
        f"commit {env['commit']}",
        f"demo model `small` (transformers engine, CPU), {conf['replicas']} replicas × threads=1, "
        f"max_batch_size {conf['max_batch_size']}, max_concurrent_jobs {conf['max_concurrent_jobs']}, "
        f"heartbeat {conf['heartbeat_interval_s']} s; requests: max_tokens {conf['max_tokens']}, greedy, "
        "ignore_eos",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    for key, label in (("evenness", "K"), ("placement", "placement-only")):
        run = report[key]
        k, n = run["requests_per_burst"], run["bursts"]
        walls = run["wall_s_each_burst"]
        lines += [
            f"| {label} burst: {k} concurrent requests × {n}, all 200 | "
            f"wall {min(walls):.2f}–{max(walls):.2f} s |",
            f"| {label}: requests per replica, first burst (r0..r{conf['replicas'] - 1}) | "
            f"{counts(run['per_replica_each_burst'][0])} |",
            f"| {label}: requests per replica, all {n} bursts | {counts(run['per_replica_total'])} |",
            f"| {label}: CV across replicas, per burst (median, range) / all bursts | {run['cv_median']:.3f} "
            f"({min(run['cv_each_burst']):.3f}–{max(run['cv_each_burst']):.3f}) / {run['cv_total']:.3f} |",
            f"| {label}: gateway CPU per request | {run['gateway_cpu_us_per_request']:.0f} µs |",
        ]
    lines += [
        f"| single requests in sequence, median / p90 latency, 1 replica | "
        f"{one['median_ms']:.2f} / {one['p90_ms']:.2f} ms |",
        f"| same, {conf['replicas']} replicas | {eight['median_ms']:.2f} / {eight['p90_ms']:.2f} ms |",
        f"| median latency added by {conf['replicas']} replicas over 1 | "
        f"{eight['median_ms'] - one['median_ms']:+.2f} ms |",
        f"| gateway CPU per sequential request, 1 / {conf['replicas']} replicas | "
        f"{one['gateway_cpu_us_per_request']:.0f} / {eight['gateway_cpu_us_per_request']:.0f} µs |",
        f"| gateway idle CPU (heartbeats, timers), 1 / {conf['replicas']} replicas | "
        f"{idle['replicas_1']:.2f} / {idle[many]:.2f} ms/s |",
        "| other load on the host during idle / bursts / sequential | "
        + " / ".join(f"{report['other_load_cores'][k]:.2f}" for k in ("idle", "bursts", "sequential"))
        + " cores |",
        "",
        f"- K burst: {report['evenness']['requests_per_burst']} requests; {conf['replicas']} × "
        f"{conf['max_concurrent_jobs']} are placed on arrival, the rest wait in the gateway and go to "
        "whichever replica frees a slot first, so their spread follows each replica's speed.",
        f"- Placement-only burst: {report['placement']['requests_per_burst']} requests, as many as the "
        "replicas take at once, so every one is routed on arrival (least outstanding work) and none waits "
        "in the gateway; a replica that finishes one before the whole burst has arrived can take a fifth.",
        f"- Sequential: {one['requests']} requests per gateway, alternating blocks of {conf['block']}, both "
        "gateways up at once. Gateway CPU is utime + stime from /proc/<pid>/stat (clock tick "
        f"{conf['clock_tick_ms']:.0f} ms), idle rate included.",
        f"- Caveat: this machine has {env['cores']} cores; the {conf['replicas'] + 1} workers, both gateways "
        "and the client share them, so latencies and wall times measure CPU contention as much as "
        "routing, and replica speeds differ by scheduling luck. The per-replica counts, the CVs and the "
        "gateway CPU per request are the numbers that carry over to a GPU host.",
    ]
    sweep = report["concurrency"]
    one_replica, many = sweep["replicas_1"], sweep[f"replicas_{conf['replicas']}"]
    lines += [
        "",
        f"Streamed sweep ({report['other_load_cores']['sweep']:.2f} cores of other load): median of "
        f"{conf['bursts']} bursts per level",
        "",
        "| concurrent requests | 1 replica tok/s | "
        f"{conf['replicas']} replicas tok/s | 1 replica TTFT ms | {conf['replicas']} replicas TTFT ms |",
        "|---|---|---|---|---|",
        *(
            f"| {a['concurrency']} | {a['tok_s']:.1f} | {b['tok_s']:.1f} | "
            f"{a['ttft_ms']:.1f} | {b['ttft_ms']:.1f} |"
            for a, b in zip(one_replica, many, strict=True)
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, help="concurrent requests in the burst (K)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--bursts", type=int, default=5, help="bursts of K (and of placement) to repeat")
    parser.add_argument("--sequential", type=int, default=200, help="single requests per gateway")
    parser.add_argument("--block", type=int, default=10, help="sequential requests per alternating block")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--concurrency", default="1,4,16,64", help="levels of the streamed sweep")
    parser.add_argument("--sweep-tokens", type=int, default=32, help="max_tokens per request in the sweep")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args(argv)

    from gateway.demo.model import make_demo_model

    config = {
        "replicas": args.replicas, "max_batch_size": args.max_batch_size,
        "max_concurrent_jobs": args.max_batch_size, "max_tokens": args.max_tokens, "block": args.block,
        "heartbeat_interval_s": HEARTBEAT_S, "bursts": args.bursts, "clock_tick_ms": 1000 / TICK,
    }  # fmt: skip
    report: dict[str, Any] = {"env": environment(), "config": config}
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        model_dir = make_demo_model(work / "model", preset="small", seed=0)
        gateways: dict[str, GatewayProcess] = {}
        for count in (1, args.replicas):
            name = f"replicas_{count}"
            entry = demo_entry(
                MODEL, model_dir, replicas=count, threads=1, max_batch_size=args.max_batch_size,
                limits={"max_concurrent_jobs": args.max_batch_size, "max_queued_requests": 4 * args.requests},
            )  # fmt: skip
            registry = write_registry(work / f"{name}.yaml", [entry], heartbeat_interval_s=HEARTBEAT_S)
            gateway = GatewayProcess(registry, ready_timeout=300, log_path=work / f"{name}.log")
            gateways[name] = stack.enter_context(gateway)
        for name, gateway in gateways.items():
            wait_all_ready(gateway, int(name.split("_")[1]), timeout=300)
        load = OtherLoad(gateways)
        report["idle"] = idle_cpu(gateways, args.idle_s)
        report["other_load_cores"] = {"idle": load.cores()}
        load = OtherLoad(gateways)
        many = gateways[f"replicas_{args.replicas}"]
        report["evenness"] = evenness(many, args.requests, args.bursts, args.max_tokens)
        # As many requests as the replicas take at once: every one is placed on arrival, none waits
        # for a free slot, so the counts show the routing decisions alone.
        placed = args.replicas * args.max_batch_size
        report["placement"] = evenness(many, placed, args.bursts, args.max_tokens)
        report["other_load_cores"]["bursts"] = load.cores()
        load = OtherLoad(gateways)
        report["sequential"] = sequential(gateways, args)
        report["other_load_cores"]["sequential"] = load.cores()
        load = OtherLoad(gateways)
        report["concurrency"] = concurrency_sweep(gateways, args)
        report["other_load_cores"]["sweep"] = load.cores()
    table = markdown(report)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_routing_{report['env']['date'].replace(':', '')}"
    (args.out / f"{stem}.md").write_text(table + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    from bench.plots import concurrency_plot

    env = report["env"]
    names = {f"replicas_{n}": f"{n} replica{'s' if n > 1 else ''}" for n in (1, args.replicas)}
    concurrency_plot(
        {names[k]: v for k, v in report["concurrency"].items()},
        f"Routing over replicas, CPU engine (demo model small, {args.sweep_tokens} tokens each, streamed)",
        f"{env['cpu']}, {env['cores']} cores, {env['date']}",
        args.out / f"{stem}.png",
    )
    print(table)
    print(f"\nwrote {args.out / stem}.md, .json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
