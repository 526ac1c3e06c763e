"""A soak of the gateway: random load, client disconnects, worker kills and reloads for 30 minutes.

Runs as a standalone process (the soak process) on any Linux CPU host. It makes two demo models in
a temp dir, starts a gateway with both (`python -m gateway serve` via tests.harness, transformers
engine, threads=1, one worker process each) and, for `--minutes`, drives it from `--clients`
concurrent asyncio httpx clients looping over random requests (chat or completions, streamed or
not, max_tokens 16-200, either model); about 20% of streams are dropped by the client mid-stream.
Every `--kill-every` seconds it SIGKILLs one worker process (alternating models), and every
`--reload-every` seconds it rewrites the registry and reloads it (POST /admin/reload: a model
changed, a model added, the other changed, the added one removed; bench/soak_chaos.py).

It measures: requests started / succeeded / failed with a clean error (HTTP 503 or an SSE `error`
event, expected around kills and reloads) / failed uncleanly (anything else: reset without an
error event, other 5xx, timeouts, malformed SSE), client disconnects, recovery per kill and per
reload, the gateway's RSS and open file descriptors every `--sample-every` seconds (with the host's
load; bench/soak_resources.py), RSS growth after `--baseline-after-s`, leaked jobs once clients
stop (active + queued + in_flight over workers, after up to 5 s), and throughput. Exits non-zero
on leaked jobs, unclean failures, a worker or reload that never recovered, RSS growth of 5% or
more after the baseline, or a descriptor count that did not stay flat.

    python bench/soak.py --minutes 30 --clients 8 --kill-every 120 --reload-every 120 --out bench/results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402

from bench import soak_resources  # noqa: E402
from bench.soak_chaos import EXTRA_MODEL, Chaos  # noqa: E402
from tests.harness import GatewayProcess  # noqa: E402
from tests.integration.conftest import demo_entry, write_registry  # noqa: E402

MODELS = ("soak-small", "soak-medium")
REQUEST_TIMEOUT_S = 60.0  # per request, client side; the whole request is also bounded by wait_for
WORDS = "the quick brown fox jumps over a lazy dog once upon a time in small village".split()


def random_body(rng: random.Random) -> tuple[str, dict[str, Any]]:
    text = " ".join(rng.choices(WORDS, k=rng.randint(3, 40)))
    body: dict[str, Any] = {
        "model": rng.choice(MODELS),
        "max_tokens": rng.randint(16, 200),
        "ignore_eos": True,
    }
    body["temperature"] = rng.choice([0.0, 0.7, 1.0])
    body["stream"] = rng.random() < 0.6
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**body, "prompt": text}


# (finished at, monotonic; outcome; latency in seconds): one per request, for the timeline plot.
Event = tuple[float, str, float]


async def one_request(
    client: httpx.AsyncClient, rng: random.Random, stats: Counter[str], events: list[Event]
) -> None:
    """Send one random request and count how it ended: ok, clean, unclean:<why> or disconnect."""
    path, body = random_body(rng)
    leave_after = rng.randint(1, body["max_tokens"]) if body["stream"] and rng.random() < 0.2 else None
    stats["started"] += 1
    started = time.monotonic()
    try:
        outcome, tokens = await asyncio.wait_for(
            _exchange(client, path, body, leave_after), REQUEST_TIMEOUT_S + 5
        )
    except (asyncio.TimeoutError, httpx.TimeoutException):
        outcome, tokens = "unclean:timeout", 0
    except httpx.HTTPError as exc:
        outcome, tokens = f"unclean:{type(exc).__name__}", 0
    stats[outcome] += 1
    stats["tokens"] += tokens
    finished = time.monotonic()
    events.append((finished, outcome, finished - started))


async def _exchange(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], leave_after: int | None
) -> tuple[str, int]:
    async with client.stream("POST", path, json=body) as response:
        if response.status_code == 503:
            await response.aread()
            return "clean", 0
        if response.status_code != 200:
            return f"unclean:http_{response.status_code}", 0
        if not body["stream"]:
            reply = json.loads(await response.aread())
            ok = reply.get("choices") and reply["choices"][0].get("finish_reason")
            return ("ok", int(reply["usage"]["completion_tokens"])) if ok else ("unclean:bad_body", 0)
        event, chunks, tokens, finished = None, 0, 0, False
        async for line in response.aiter_lines():
            if not line or line.startswith(":"):
                continue
            if line.startswith("event: "):
                event = line[7:]
                continue
            if not line.startswith("data: "):
                return "unclean:malformed_sse", 0
            data = line[6:]
            if event == "error":
                ok = isinstance(json.loads(data).get("error"), dict)
                return ("clean", 0) if ok else ("unclean:bad_error_event", 0)
            if data == "[DONE]":
                return ("ok", tokens) if finished else ("unclean:done_without_finish", 0)
            chunk = json.loads(data)
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            finished = finished or any(c.get("finish_reason") for c in chunk.get("choices", []))
            chunks += 1
            if leave_after is not None and chunks >= leave_after and not finished:
                return "disconnect", 0  # leaving the context manager closes the connection mid-stream
        return "unclean:eof_without_done", 0


async def client_loop(url: str, seed: int, stop_at: float, stats: Counter[str], events: list[Event]) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        while time.monotonic() < stop_at:
            try:
                await one_request(client, rng, stats, events)
            except (ValueError, KeyError, TypeError) as exc:  # malformed JSON or missing fields
                stats[f"unclean:malformed_{type(exc).__name__}"] += 1


async def workers_of(admin: httpx.AsyncClient) -> list[dict[str, Any]]:
    return (await admin.get("/admin/workers")).json()["workers"]  # type: ignore[no-any-return]


async def soak(gw: GatewayProcess, chaos: Chaos, args: argparse.Namespace, report: dict[str, Any]) -> None:
    started, stop_at = chaos.started, chaos.stop_at
    stats: Counter[str] = Counter()
    events: list[Event] = []
    samples: list[dict[str, float]] = []
    sampler = asyncio.create_task(soak_resources.sample_forever(gw.pid, started, args.sample_every, samples))
    clients = [
        asyncio.create_task(client_loop(gw.url, args.seed + i, stop_at, stats, events))
        for i in range(args.clients)
    ]
    faults = [asyncio.create_task(chaos.kill_every(args.kill_every))]
    if args.reload_every > 0:
        faults.append(asyncio.create_task(chaos.reload_every(args.reload_every, args.reload_every / 2)))
    await asyncio.gather(*clients, *faults)
    wall = time.monotonic() - started
    async with httpx.AsyncClient(base_url=gw.url, timeout=5) as admin:
        deadline = time.monotonic() + 5
        while True:
            workers = await workers_of(admin)
            leaked = sum(w["active_jobs"] + w["queued_jobs"] + w["in_flight"] for w in workers)
            if leaked == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
    sampler.cancel()
    samples.append(soak_resources.sample(gw.pid, started))  # at the end, after the leak check
    unclean = {k.split(":", 1)[1]: v for k, v in stats.items() if k.startswith("unclean:")}
    report.update(
        wall_s=round(wall, 1), started=stats["started"], succeeded=stats["ok"], failed_clean=stats["clean"],
        failed_unclean=sum(unclean.values()), unclean_kinds=unclean, disconnects=stats["disconnect"],
        leaked_jobs=leaked, workers_at_end=workers, kills=chaos.kills, reloads=chaos.reloads,
        completion_tokens=stats["tokens"], requests_per_s=round(stats["ok"] / wall, 2),
        tokens_per_s=round(stats["tokens"] / wall, 1), timeline=timeline(events, started, args.interval_s),
        resources=samples, resources_summary=soak_resources.summary(samples, args.baseline_after_s),
    )  # fmt: skip


def timeline(events: list[Event], started: float, interval_s: float) -> list[dict[str, float]]:
    """Requests finished per interval by outcome, with latency percentiles (disconnects left out)."""
    bins: dict[int, list[Event]] = {}
    for event in events:
        bins.setdefault(int((event[0] - started) // interval_s), []).append(event)
    rows = []
    for index in range(max(bins) + 1 if bins else 0):
        done = bins.get(index, [])
        latencies = sorted(1000 * latency for _, outcome, latency in done if outcome != "disconnect")
        rows.append({
            "t_s": (index + 0.5) * interval_s,
            "ok": sum(1 for _, outcome, _ in done if outcome == "ok"),
            "clean_errors": sum(1 for _, outcome, _ in done if outcome == "clean"),
            "unclean_errors": sum(1 for _, outcome, _ in done if outcome.startswith("unclean")),
            "p50_ms": pct(latencies, 0.5), "p99_ms": pct(latencies, 0.99),
        })  # fmt: skip
    return rows


def pct(ordered: list[float], q: float) -> float:
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else 0.0


def environment(args: argparse.Namespace) -> dict[str, Any]:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "unknown")
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "cpu": cpu,
        "cores": os.cpu_count(), "python": platform.python_version(), "minutes": args.minutes,
        "clients": args.clients, "kill_every_s": args.kill_every, "reload_every_s": args.reload_every,
        "sample_every_s": args.sample_every, "baseline_after_s": args.baseline_after_s, "seed": args.seed,
        "load1_at_start": soak_resources.load_average(),
    }  # fmt: skip


def _recoveries(records: list[dict[str, Any]], label: str, key: str) -> str:
    times = [r[key] for r in records if r[key] is not None]
    missing = len(records) - len(times)
    if not records:
        return "none"
    text = f"{len(records)} {label}"
    if times:
        text += f": median {statistics.median(times):.2f} s, max {max(times):.2f} s"
    return text + (f"; {missing} NOT RECOVERED" if missing else "")


def markdown(r: dict[str, Any]) -> str:
    env, res = r["env"], r["resources_summary"]
    ended = sum(x["requests_ended"] or 0 for x in r["reloads"])
    rows = [
        ("requests started", r["started"]),
        ("succeeded", r["succeeded"]),
        ("failed, clean error (503 / SSE error event)", r["failed_clean"]),
        ("failed, unclean", f"{r['failed_unclean']} {r['unclean_kinds'] or ''}".strip()),
        ("client-initiated disconnects", r["disconnects"]),
        ("leaked jobs (5 s after clients stop)", r["leaked_jobs"]),
        ("worker kills: until ready again", _recoveries(r["kills"], "kills", "recovery_s")),
        ("reloads: until every model serves", _recoveries(r["reloads"], "reloads", "ready_s")),
        ("requests the reloads ended (drain grace over)", ended),
        (f"gateway RSS at {res['baseline_t_s']:g} s / at the end",
         f"{res['rss_mib_baseline']:.1f} / {res['rss_mib_end']:.1f} MiB "
         f"({res['rss_growth_pct_after_baseline']:+.2f}%; first sample {res['rss_mib_first']:.1f}, "
         f"max {res['rss_mib_max']:.1f})"),
        ("gateway open fds: min / max (first / end)",
         f"{res['fds_min']} / {res['fds_max']} ({res['fds_first']} / {res['fds_end']})"),
        ("host load (1-min average): mean / max", f"{res['load1_mean']} / {res['load1_max']}"),
        ("throughput", f"{r['requests_per_s']} req/s, {r['tokens_per_s']} completion tok/s (succeeded only)"),
        ("targets: RSS growth < 5% after baseline; fds flat",
         f"{'met' if res['rss_target_met'] else 'MISSED'}; {'met' if res['fds_flat'] else 'MISSED'}"),
    ]  # fmt: skip
    head = (
        f"{env['cpu']}, {env['cores']} cores | {env['date']} | python {env['python']} | "
        f"{env['minutes']:g} min ({r['wall_s']} s wall), {env['clients']} clients, "
        f"kill every {env['kill_every_s']:g} s, reload every {env['reload_every_s']:g} s"
    )
    every = max(1, round(300 / env["sample_every_s"]))  # one row per 5 minutes
    shown = r["resources"][::every] + ([r["resources"][-1]] if len(r["resources"]) % every != 1 else [])
    resources = [f"| {x['t_s']:g} | {x['rss_mib']:.1f} | {x['fds']} | {x['load1']:.2f} |" for x in shown]
    return "\n".join([
        head, "", "| metric | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), "",
        "| t (s) | gateway RSS (MiB) | open fds | host load |", "|---|---|---|---|", *resources,
    ])  # fmt: skip


def failures(report: dict[str, Any]) -> list[str]:
    res = report["resources_summary"]
    checks = {
        "leaked jobs": report["leaked_jobs"] > 0,
        "unclean failures": report["failed_unclean"] > 0,
        "a worker kill never recovered": any(k["recovery_s"] is None for k in report["kills"]),
        "a reload never finished": any(r["ready_s"] is None for r in report["reloads"]),
        "RSS grew 5% or more after the baseline": not res["rss_target_met"],
        "open fds not flat": not res["fds_flat"],
    }
    return [what for what, failed in checks.items() if failed]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--kill-every", type=float, default=120.0, help="seconds between worker SIGKILLs")
    parser.add_argument("--reload-every", type=float, default=120.0, help="seconds between reloads; 0: none")
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds between RSS/fd samples")
    parser.add_argument("--baseline-after-s", type=float, default=300.0, help="RSS growth counts from then")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--interval-s", type=float, default=10.0, help="bins of the timeline plot")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)

    from gateway.demo.model import make_demo_model

    report: dict[str, Any] = {"env": environment(args)}
    stem = f"soak_{report['env']['date'].replace(':', '')}"
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        work = Path(tmp)
        small = make_demo_model(work / "small", preset="small", seed=0)
        medium = make_demo_model(work / "medium", preset="medium", seed=1)
        models = [demo_entry(MODELS[0], small), demo_entry(MODELS[1], medium)]
        config = write_registry(work / "models.yaml", models)
        gw = GatewayProcess(config)
        try:
            with gw:
                started = time.monotonic()
                chaos = Chaos(gw.url, config, models, demo_entry(EXTRA_MODEL, small), started,
                              started + args.minutes * 60)  # fmt: skip
                asyncio.run(soak(gw, chaos, args, report))
        finally:
            if gw.log_path.exists():
                shutil.copyfile(gw.log_path, args.out / f"{stem}.gateway.log")
    failed = failures(report)
    report["failures"] = failed
    if not failed:
        (args.out / f"{stem}.gateway.log").unlink(missing_ok=True)  # kept only to investigate failures
    table = markdown(report)
    (args.out / f"{stem}.md").write_text(table + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    from bench.plots import timeline_plot

    env = report["env"]
    timeline_plot(
        report["timeline"],
        f"Soak: {env['clients']} clients, two demo models, a worker killed every {env['kill_every_s']:g} s, "
        f"a reload every {env['reload_every_s']:g} s",
        f"{env['cpu']}, {env['cores']} cores, {env['date']}",
        args.out / f"{stem}.png",
        events=[(k["at_s"], f"kill {k['model']}") for k in report["kills"]]
        + [(r["at_s"], f"reload: {r['what']}") for r in report["reloads"]],
        resources=report["resources"],
    )
    print(table)
    print(f"\nwrote {args.out / stem}.md, .json and .png")
    if failed:
        print(f"FAILED: {'; '.join(failed)} (gateway log: {stem}.gateway.log)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
