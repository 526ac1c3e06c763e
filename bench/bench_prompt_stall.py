"""How long a running stream stalls while a worker tokenizes long prompts, on one or two checkouts.

Runs as a standalone process (the bench process) on a CPU host, against gateways it starts
(`python -m gateway serve` from each checkout, each spawning one transformers worker on the same
demo model). In each round, on each checkout (their order alternates from round to round), one
greedy stream runs twice: once alone ("quiet"), and once while this process sends long
requests one after another from the stream's 16th token on ("long prompts"), each a prompt longer
than the model's context, which the worker tokenizes and then refuses (a 400). Every
token's arrival is timed (with `logprobs`, each chunk says how many tokens it holds), so the gaps
are counted by tokens. The figure that matters is the longest gap while the long prompts were
being tokenized, against the quiet stream's median gap: a worker that tokenizes on its engine
thread stops every stream for the whole tokenization; one that tokenizes beside it does not.

    python bench/bench_prompt_stall.py --compare ../old-checkout --rounds 5 --out bench/results
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
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import yaml  # noqa: E402

from tests.harness import free_port, wait_until  # noqa: E402

MODEL = "m"
OTHER_MODEL = "other"  # the same files in a second worker
START_AFTER_TOKENS = 16


class Gateway:
    """`python -m gateway serve` run from one checkout (its own code on PYTHONPATH)."""

    def __init__(self, checkout: Path, config: Path, log: Path) -> None:
        self.checkout, self.port = checkout, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        command = [sys.executable, "-m", "gateway", "serve", "--config", str(config),
                   "--port", str(self.port)]  # fmt: skip
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            command, cwd=checkout, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

        def ready() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"the gateway of {checkout} exited; see {log}")
            return httpx.get(self.url + "/health/ready", timeout=2).status_code == 200

        wait_until(ready, f"the gateway of {checkout} to be ready", 300, retry_on=(httpx.HTTPError,))

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)
        self._log.close()


async def one_phase(
    url: str, tokens: int, long_text: str | None, prompts: int, long_model: str = MODEL
) -> dict[str, Any]:
    """One stream; with long_text, `prompts` requests of it from the stream's 16th token, to
    `long_model` (the stream's own model, or a second worker's to measure the gateway alone)."""
    body = {"model": MODEL, "prompt": "The history of", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 1}  # fmt: skip
    times: list[float] = []
    started = asyncio.Event()
    window: list[float] = []
    tokenize_s: list[float] = []

    async def stream(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                for choice in json.loads(line[6:]).get("choices", []):
                    times.extend([now] * len((choice.get("logprobs") or {}).get("tokens") or []))
                if len(times) >= START_AFTER_TOKENS:
                    started.set()

    async def tokenize(client: httpx.AsyncClient) -> None:
        await started.wait()
        window.append(time.perf_counter())
        for _ in range(prompts):
            sent = time.perf_counter()
            # Longer than the model's context: the worker tokenizes it and refuses it (400), so the
            # gateway's own share of the work stays small (no long reply to encode).
            response = await client.post("/v1/completions", json={"model": long_model, "prompt": long_text,
                                                                   "max_tokens": 1})  # fmt: skip
            if response.status_code != 400 or "context" not in response.text:
                raise RuntimeError(f"expected a 400 for the context length: {response.text[:300]}")
            tokenize_s.append(time.perf_counter() - sent)
        window.append(time.perf_counter())

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        tasks = [stream(client)] + ([tokenize(client)] if long_text is not None else [])
        await asyncio.gather(*tasks)
    if len(times) != tokens:
        raise RuntimeError(f"the stream gave {len(times)} tokens, not {tokens}")
    gaps = [(b, b - a) for a, b in zip(times, times[1:], strict=False)]
    if window:
        if window[1] > times[-1]:
            raise RuntimeError("the stream ended before the long prompts were tokenized; raise --tokens")
        inside = [g for end, g in gaps if window[0] <= end <= window[1] + 0.5]
    else:
        inside = [g for _, g in gaps]
    return {"gap_ms_p50": 1000 * statistics.median(g for _, g in gaps), "gap_ms_max": 1000 * max(inside),
            "tokenize_ms": [1000 * s for s in tokenize_s]}  # fmt: skip


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from gateway.demo.model import make_demo_model

    model_dir = make_demo_model(work / "model", preset="small", seed=0)
    trace = (
        {"env": {"GATEWAY_STEP_TRACE": os.environ["STALL_STEP_TRACE"]}}
        if "STALL_STEP_TRACE" in os.environ
        else {}
    )
    entries = [{"name": name, "engine": "transformers", "path": str(model_dir), "max_seq_len": 4096,
                "engine_settings": {"threads": 1}, **(trace if name == MODEL else {})}
               for name in (MODEL, OTHER_MODEL)]  # fmt: skip
    config = work / "models.yaml"
    config.write_text(yaml.safe_dump({"models": entries, "server": {"max_body_bytes": 64 * 1024 * 1024}}))
    long_model = OTHER_MODEL if args.long_prompts_to_other_model else MODEL
    long_prompt = repeated_corpus(args.prompt_chars)
    checkouts = {"this": REPO_ROOT, **({"compare": args.compare.resolve()} if args.compare else {})}
    gateways = {name: Gateway(path, config, work / f"{name}.log") for name, path in checkouts.items()}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in checkouts}
    try:
        for gw in gateways.values():  # a warm-up of each
            asyncio.run(one_phase(gw.url, args.tokens, long_prompt, 1))
        for round_index in range(args.rounds):
            for name in round_order(list(checkouts), round_index):
                url = gateways[name].url
                quiet = asyncio.run(one_phase(url, args.tokens, None, 0))
                loaded = asyncio.run(one_phase(url, args.tokens, long_prompt, args.prompts, long_model))
                results[name].append({"quiet": quiet, "long_prompts": loaded,
                                      "stall_ratio": loaded["gap_ms_max"] / quiet["gap_ms_p50"]})  # fmt: skip
                print(f"round {round_index + 1} {name}: quiet gap p50 {quiet['gap_ms_p50']:.1f} ms, "
                      f"longest gap under long prompts {loaded['gap_ms_max']:.1f} ms, "
                      f"long request {statistics.median(loaded['tokenize_ms']):.0f} ms",
                      flush=True)  # fmt: skip
    finally:
        for gw in gateways.values():
            gw.stop()
    return {"checkouts": {name: commit_of(path) for name, path in checkouts.items()}, "rounds": results}


def commit_of(checkout: Path) -> str:
    """The checkout's commit, and "+changes" when its tree differs from it (names no local path)."""
    git = ["git", "-C", str(checkout)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    changes = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True).stdout  # fmt: skip
    return commit.strip() + ("+changes" if changes.strip() else "")


def repeated_corpus(chars: int) -> str:
    """The demo corpus repeated to `chars` characters: a prompt that takes long to tokenize."""
    corpus = (REPO_ROOT / "gateway" / "demo" / "corpus.txt").read_text()
    return (corpus * (chars // len(corpus) + 1))[:chars]


def round_order(names: list[str], round_index: int) -> list[str]:
    """The checkouts in this round's order: reversed every other round, so neither always goes first."""
    return names if round_index % 2 == 0 else list(reversed(names))


def spread(values: list[float], digits: int = 1) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def paired_by_round(
    report: dict[str, Any], value: Callable[[dict[str, Any]], float], label: str
) -> list[str]:
    """The summary's last line when two checkouts ran: `value` of this / compare, paired by round."""
    if "compare" not in report["rounds"]:
        return []
    this, other = report["rounds"]["this"], report["rounds"]["compare"]
    pairs = [value(a) / value(b) for a, b in zip(this, other, strict=True)]
    return ["", f"{label}, this / compare, paired by round: median {spread(pairs, 3)}."]


def save(stem: Path, report: dict[str, Any], text: str) -> None:
    """The table as stem.md and the report as stem.json; the table printed too."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(text + "\n")
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    print(text)


def summary(report: dict[str, Any]) -> str:
    env = report["env"]
    lines = [f"```\n{env['cpu']}, {env['cores']} cores | {env['date']} | demo model (small), "
             f"transformers engine, threads 1 | one stream of {env['tokens']} tokens; {env['prompts']} "
             f"requests whose prompts of {env['prompt_chars']} characters are tokenized, then refused "
             f"as too long, by {env['long_prompts_to']} | {env['rounds']} interleaved rounds\n```", "",
             "| checkout | quiet gap p50 ms | longest gap under long prompts ms (min-max) | "
             "that / quiet p50 (min-max) | long request ms p50 |", "|---|---|---|---|---|"]  # fmt: skip
    for name, rounds in report["rounds"].items():
        longest = [r["long_prompts"]["gap_ms_max"] for r in rounds]
        ratios = [r["stall_ratio"] for r in rounds]
        quiet = statistics.median(r["quiet"]["gap_ms_p50"] for r in rounds)
        tok = statistics.median(t for r in rounds for t in r["long_prompts"]["tokenize_ms"])
        lines.append(f"| {name} ({report['checkouts'][name]}) | {quiet:.1f} | {spread(longest)} "
                     f"| {spread(ratios)} | {tok:.0f} |")  # fmt: skip
    lines += paired_by_round(report, lambda r: r["long_prompts"]["gap_ms_max"], "Longest gap")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", type=Path, help="a second checkout to measure in the same rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2000, help="the stream's length")
    parser.add_argument("--prompts", type=int, default=3, help="long tokenize requests per phase")
    parser.add_argument("--prompt-chars", type=int, default=200_000)
    parser.add_argument(
        "--long-prompts-to-other-model",
        action="store_true",
        help="send the long prompts to a second worker: what is left is the gateway's own stall",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    date = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H%MZ")
    env = {"cpu": cpu, "cores": os.cpu_count(), "date": date, "tokens": args.tokens,
           "prompts": args.prompts, "prompt_chars": args.prompt_chars, "rounds": args.rounds,
           "long_prompts_to": "a second worker" if args.long_prompts_to_other_model
           else "the same worker"}  # fmt: skip
    report: dict[str, Any] = {"env": env}
    with tempfile.TemporaryDirectory(prefix="bench-stall-") as tmp:
        report.update(run(args, Path(tmp)))
    save(args.out / f"bench_prompt_stall_{date}", report, summary(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
