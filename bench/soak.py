"""A bounded soak of the gateway: random load, client disconnects and worker kills for a few minutes.

Runs as a standalone process (the soak process) on any CPU host. It makes two demo models in a temp
dir, starts a gateway with both (`python -m gateway serve` via tests.harness, transformers engine,
threads=1, one worker process each) and, for `--minutes`, drives it from `--clients` concurrent
asyncio httpx clients looping over random requests (chat or completions, streamed or not,
max_tokens 16-200, either model); about 20% of streams are dropped by the client mid-stream.
Every `--kill-every` seconds it SIGKILLs one worker process (alternating models).

It measures: requests started / succeeded / failed with a clean error (HTTP 503 or an SSE `error`
event, expected around kills) / failed uncleanly (anything else: reset without an error event, other
5xx, timeouts, malformed SSE), client disconnects, worker recovery time per kill (until
/admin/workers shows the model ready with a new pid), the gateway's RSS after warm-up and at the end
(VmRSS), leaked jobs once clients stop (active + queued + in_flight over workers, after up to 5 s),
and throughput. Exits non-zero on leaked jobs, unclean failures or a worker that never recovered.

    python bench/soak.py --minutes 3 --clients 8 --kill-every 60 --out bench/results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import signal
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

from tests.harness import GatewayProcess  # noqa: E402
from tests.integration.conftest import demo_entry, write_registry  # noqa: E402

MODELS = ("soak-small", "soak-medium")
REQUEST_TIMEOUT_S = 60.0  # per request, client side; the whole request is also bounded by wait_for
RECOVERY_TIMEOUT_S = 60.0
WORDS = "the quick brown fox jumps over a lazy dog once upon a time in small village".split()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


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


async def killer(url: str, every: float, started: float, stop_at: float, kills: list[dict[str, Any]]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=5) as admin:
        index = 0
        while started + (index + 1) * every < stop_at:
            await asyncio.sleep(started + (index + 1) * every - time.monotonic())
            model = MODELS[index % len(MODELS)]
            index += 1
            old = next(w for w in await workers_of(admin) if w["model"] == model)
            if old["state"] != "ready" or not old["pid"]:
                continue  # still recovering from something else: skip this kill rather than stack two
            os.kill(old["pid"], signal.SIGKILL)
            killed_at = time.monotonic()
            at_s = round(killed_at - started, 1)
            record: dict[str, Any] = {"model": model, "at_s": at_s, "old_pid": old["pid"], "recovery_s": None}
            kills.append(record)
            while time.monotonic() - killed_at < RECOVERY_TIMEOUT_S:
                now = next(w for w in await workers_of(admin) if w["model"] == model)
                if now["state"] == "ready" and now["pid"] != old["pid"]:
                    record.update(recovery_s=round(time.monotonic() - killed_at, 2), new_pid=now["pid"])
                    break
                await asyncio.sleep(0.05)


async def soak(gw: GatewayProcess, args: argparse.Namespace, report: dict[str, Any]) -> None:
    duration = args.minutes * 60
    started = time.monotonic()
    stop_at = started + duration
    stats: Counter[str] = Counter()
    kills: list[dict[str, Any]] = []
    events: list[Event] = []
    clients = [
        asyncio.create_task(client_loop(gw.url, args.seed + i, stop_at, stats, events))
        for i in range(args.clients)
    ]
    kill_task = asyncio.create_task(killer(gw.url, args.kill_every, started, stop_at, kills))
    await asyncio.sleep(min(args.warmup_s, duration / 2))
    report["rss_kib_start"] = rss_kib(gw.pid)
    await asyncio.gather(*clients, kill_task)
    wall = time.monotonic() - started
    async with httpx.AsyncClient(base_url=gw.url, timeout=5) as admin:
        deadline = time.monotonic() + 5
        while True:
            workers = await workers_of(admin)
            leaked = sum(w["active_jobs"] + w["queued_jobs"] + w["in_flight"] for w in workers)
            if leaked == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
    report["rss_kib_end"] = rss_kib(gw.pid)
    unclean = {k.split(":", 1)[1]: v for k, v in stats.items() if k.startswith("unclean:")}
    report.update(
        wall_s=round(wall, 1), started=stats["started"], succeeded=stats["ok"], failed_clean=stats["clean"],
        failed_unclean=sum(unclean.values()), unclean_kinds=unclean, disconnects=stats["disconnect"],
        leaked_jobs=leaked, workers_at_end=workers, kills=kills, completion_tokens=stats["tokens"],
        requests_per_s=round(stats["ok"] / wall, 2), tokens_per_s=round(stats["tokens"] / wall, 1),
        timeline=timeline(events, started, args.interval_s),
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
        "clients": args.clients, "kill_every_s": args.kill_every, "warmup_s": args.warmup_s,
        "seed": args.seed,
    }  # fmt: skip


def markdown(r: dict[str, Any]) -> str:
    env = r["env"]
    recov = ", ".join(
        f"{k['model']} @{k['at_s']:g}s: "
        + (f"{k['recovery_s']:.2f} s" if k["recovery_s"] is not None else "NOT RECOVERED")
        for k in r["kills"]
    )
    rss = f"{r['rss_kib_start'] / 1024:.1f} / {r['rss_kib_end'] / 1024:.1f} MiB"
    rows = [
        ("requests started", r["started"]),
        ("succeeded", r["succeeded"]),
        ("failed, clean error (503 / SSE error event)", r["failed_clean"]),
        ("failed, unclean", f"{r['failed_unclean']} {r['unclean_kinds'] or ''}".strip()),
        ("client-initiated disconnects", r["disconnects"]),
        ("leaked jobs (5 s after clients stop)", r["leaked_jobs"]),
        ("gateway RSS after warm-up / end", rss),
        ("worker kills: recovery time", recov or "none"),
        ("throughput", f"{r['requests_per_s']} req/s, {r['tokens_per_s']} completion tok/s (succeeded only)"),
    ]  # fmt: skip
    head = (
        f"{env['cpu']}, {env['cores']} cores | {env['date']} | python {env['python']} | "
        f"{env['minutes']:g} min ({r['wall_s']} s wall), {env['clients']} clients, "
        f"kill every {env['kill_every_s']:g} s"
    )
    return "\n".join([head, "", "| metric | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds between worker SIGKILLs")
    parser.add_argument("--warmup-s", type=float, default=15.0, help="load before the first RSS sample")
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
        config = write_registry(
            work / "models.yaml", [demo_entry(MODELS[0], small), demo_entry(MODELS[1], medium)]
        )
        gw = GatewayProcess(config)
        try:
            with gw:
                asyncio.run(soak(gw, args, report))
        finally:
            if gw.log_path.exists():
                shutil.copyfile(gw.log_path, args.out / f"{stem}.gateway.log")
    failed = report["leaked_jobs"] > 0 or report["failed_unclean"] > 0
    failed = failed or any(k["recovery_s"] is None for k in report["kills"])
    if not failed:
        (args.out / f"{stem}.gateway.log").unlink(missing_ok=True)  # kept only to investigate failures
    table = markdown(report)
    (args.out / f"{stem}.md").write_text(table + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    from bench.plots import timeline_plot

    env = report["env"]
    timeline_plot(
        report["timeline"],
        f"Soak: {env['clients']} clients, two demo models, a worker killed every {env['kill_every_s']:g} s",
        f"{env['cpu']}, {env['cores']} cores, {env['date']}",
        args.out / f"{stem}.png",
        events=[(k["at_s"], f"kill {k['model']}") for k in report["kills"]],
    )
    print(table)
    print(
        f"\nwrote {args.out / stem}.md, .json and .png"
        + (f" (gateway log: {stem}.gateway.log)" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
