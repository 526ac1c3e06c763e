"""Time to first token of short requests sent while a worker prepares a long prompt, on one or two
checkouts.

Runs as a standalone process (the bench process) on a CPU host, against gateways it starts
(`python -m gateway serve` from each checkout, each spawning one transformers worker on the same
demo model: bench_prompt_stall.Gateway). In each round, on each checkout (their order alternates
from round to round), `--shorts` short greedy streamed completions are sent together `--repeats`
times with nothing else on the worker ("quiet"), and as often just after a long request ("behind a
long prompt"): a prompt of `--prompt-chars` characters that the worker tokenizes and then refuses as
longer than the context. The short ones are sent once the gateway has sent the long one's Generate
(its slot on the worker is taken: /admin/workers), so the worker reads them behind it. Each short
request's time to first token counts from its send. A worker that prepares prompts one at a time in
arrival order makes them wait for the whole tokenization; one that prepares them side by side does
not. Reported per checkout: the median time to first token quiet and behind a long prompt (each
round's median, their median and spread), their ratio, how many short requests streamed their first
token before the long one was answered, and, with `--compare`, the behind-a-long-prompt figure of
this checkout over the other's, paired by round.

    git archive HEAD | tar -x -C /tmp/before
    python bench/bench_short_behind_long.py --rounds 7 --compare /tmp/before --compare-commit REV
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
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import yaml  # noqa: E402

from bench.bench_prompt_stall import (  # noqa: E402
    MODEL,
    Gateway,
    commit_of,
    paired_by_round,
    repeated_corpus,
    round_order,
    save,
    spread,
)
from tests.harness import async_wait_until  # noqa: E402

SHORT = {"model": MODEL, "prompt": "The history of", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
         "stream": True}  # fmt: skip


async def first_token(client: httpx.AsyncClient) -> tuple[float, float]:
    """One short streamed request: (when it was sent, when its first token arrived)."""
    sent = time.perf_counter()
    first: float | None = None
    async with client.stream("POST", "/v1/completions", json=SHORT) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                if any(choice.get("text") for choice in json.loads(line[6:]).get("choices", [])):
                    first = time.perf_counter()
    if first is None:
        raise RuntimeError("a short request streamed no token")
    return sent, first


async def in_flight(client: httpx.AsyncClient) -> int:
    return sum(worker["in_flight"] for worker in (await client.get("/admin/workers")).json()["workers"])


async def one_burst(client: httpx.AsyncClient, shorts: int, long_text: str | None) -> dict[str, Any]:
    """`shorts` short requests at once, alone or just behind a long one."""

    async def idle() -> bool:
        return await in_flight(client) == 0

    await async_wait_until(idle, "the worker's slots to be free", poll_s=0.005)
    long_task = None
    if long_text is not None:

        async def long_request() -> tuple[float, float]:
            sent = time.perf_counter()
            body = {"model": MODEL, "prompt": long_text, "max_tokens": 1}
            response = await client.post("/v1/completions", json=body)
            if response.status_code != 400 or "context" not in response.text:
                raise RuntimeError(f"expected a 400 for the context length: {response.text[:300]}")
            return sent, time.perf_counter()

        long_task = asyncio.create_task(long_request())

        async def long_one_sent() -> bool:
            if long_task.done():
                raise RuntimeError("the long request was answered before it was seen in flight")
            return await in_flight(client) > 0

        await async_wait_until(long_one_sent, "the long request's Generate to go out", poll_s=0.002)
    times = await asyncio.gather(*(first_token(client) for _ in range(shorts)))
    result: dict[str, Any] = {"ttft_ms": [1000 * (first - sent) for sent, first in times]}
    if long_task is not None:
        long_sent, long_answered = await long_task
        result["long_ms"] = 1000 * (long_answered - long_sent)
        result["before_long_answer"] = sum(first < long_answered for _, first in times)
    return result


async def one_phase(url: str, args: argparse.Namespace, long_text: str | None) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        bursts = [await one_burst(client, args.shorts, long_text) for _ in range(args.repeats)]
    ttft = [t for burst in bursts for t in burst["ttft_ms"]]
    phase: dict[str, Any] = {"ttft_ms": ttft, "ttft_ms_p50": statistics.median(ttft)}
    if long_text is not None:
        phase["long_ms"] = [burst["long_ms"] for burst in bursts]
        phase["before_long_answer"] = sum(burst["before_long_answer"] for burst in bursts)
    return phase


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from gateway.demo.model import make_demo_model

    model_dir = make_demo_model(work / "model", preset="small", seed=0)
    entry = {"name": MODEL, "engine": "transformers", "path": str(model_dir), "max_seq_len": 4096,
             "engine_settings": {"threads": 1}}  # fmt: skip
    config = work / "models.yaml"
    config.write_text(yaml.safe_dump({"models": [entry], "server": {"max_body_bytes": 64 * 1024 * 1024}}))
    long_prompt = repeated_corpus(args.prompt_chars)
    checkouts = {"this": REPO_ROOT, **({"compare": args.compare.resolve()} if args.compare else {})}
    gateways = {name: Gateway(path, config, work / f"{name}.log") for name, path in checkouts.items()}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in checkouts}
    try:
        for gw in gateways.values():  # a warm-up of each: one burst of each kind
            asyncio.run(one_burst_pair(gw.url, args, long_prompt))
        for round_index in range(args.rounds):
            for name in round_order(list(checkouts), round_index):
                url = gateways[name].url
                quiet = asyncio.run(one_phase(url, args, None))
                behind = asyncio.run(one_phase(url, args, long_prompt))
                ratio = behind["ttft_ms_p50"] / quiet["ttft_ms_p50"]
                results[name].append({"quiet": quiet, "behind_long": behind, "ratio": ratio})
                print(f"round {round_index + 1} {name}: first token quiet {quiet['ttft_ms_p50']:.1f} ms, "
                      f"behind a long prompt {behind['ttft_ms_p50']:.1f} ms ({ratio:.2f}x); "
                      f"{behind['before_long_answer']}/{len(behind['ttft_ms'])} before the long answer, "
                      f"long request {statistics.median(behind['long_ms']):.0f} ms", flush=True)  # fmt: skip
    finally:
        for gw in gateways.values():
            gw.stop()
    commits = {name: commit_of(path) for name, path in checkouts.items()}
    if args.compare_commit:  # a copy made with git archive is no git checkout
        commits["compare"] = args.compare_commit
    return {"checkouts": commits, "rounds": results}


async def one_burst_pair(url: str, args: argparse.Namespace, long_text: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await one_burst(client, args.shorts, None)
        await one_burst(client, args.shorts, long_text)


def summary(report: dict[str, Any]) -> str:
    env = report["env"]
    lines = [f"```\n{env['cpu']}, {env['cores']} cores | {env['date']} | load average {env['load_before']} "
             f"before, {env['load_after']} after | demo model (small), transformers engine, threads 1 | "
             f"{env['shorts']} short streamed completions at once, {env['repeats']} times per phase, alone "
             f"and behind one request whose prompt of {env['prompt_chars']} characters is tokenized, then "
             f"refused as too long | {env['rounds']} interleaved rounds\n```", "",
             "| checkout | first token quiet ms (min-max) | behind a long prompt ms (min-max) | "
             "behind / quiet (min-max) | first tokens before the long answer | long request ms p50 |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, rounds in report["rounds"].items():
        quiet = [r["quiet"]["ttft_ms_p50"] for r in rounds]
        behind = [r["behind_long"]["ttft_ms_p50"] for r in rounds]
        before = sum(r["behind_long"]["before_long_answer"] for r in rounds)
        shorts = sum(len(r["behind_long"]["ttft_ms"]) for r in rounds)
        long_ms = statistics.median(t for r in rounds for t in r["behind_long"]["long_ms"])
        ratios = spread([r["ratio"] for r in rounds], 2)
        lines.append(f"| {name} ({report['checkouts'][name]}) | {spread(quiet)} | {spread(behind)} "
                     f"| {ratios} | {before}/{shorts} | {long_ms:.0f} |")  # fmt: skip
    lines += paired_by_round(
        report, lambda r: r["behind_long"]["ttft_ms_p50"], "First token behind a long prompt"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", type=Path, help="a second checkout to measure in the same rounds")
    parser.add_argument("--compare-commit", help="the commit --compare holds, when it is no git checkout")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="bursts of short requests per phase")
    parser.add_argument("--shorts", type=int, default=4, help="short requests sent together")
    parser.add_argument("--prompt-chars", type=int, default=400_000)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    date = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H%MZ")
    env = {"cpu": cpu, "cores": os.cpu_count(), "date": date, "shorts": args.shorts, "repeats": args.repeats,
           "prompt_chars": args.prompt_chars, "rounds": args.rounds,
           "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg())}  # fmt: skip
    report: dict[str, Any] = {"env": env}
    with tempfile.TemporaryDirectory(prefix="bench-short-") as tmp:
        report.update(run(args, Path(tmp)))
    env["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    save(args.out / f"bench_short_behind_long_{date}", report, summary(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
