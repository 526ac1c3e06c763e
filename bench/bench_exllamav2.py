"""Gateway overhead on exllamav2: raw in-process generation versus the same model over HTTP.

Runs as a standalone process on a GPU machine (scripts/gpu_run.sh starts it). Owns the scenarios
and the report: the same model, settings and prompt are driven (1) in-process through exllamav2's
dynamic generator directly and (2) through a gateway started on a free port, as one stream and
as N concurrent streams; with two GPUs also (3) two models at once versus each alone, both as
threads of one process (the baseline) and as two workers of one gateway. Writes a markdown table
and a JSON file with the device, date and versions, and prints the table.

    python bench/bench_exllamav2.py --model /tmp/models/llama3-8b --out-dir $OUT
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402

from model_worker.engines.exllamav2.engine import ExLlamaV2Engine  # noqa: E402
from model_worker.engines.registry import create_engine  # noqa: E402
from tests.gpu.support import gateway_env, stream_completion, write_registry  # noqa: E402
from tests.harness import GatewayProcess  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village, " * 4


class Stream:
    """Arrival times of one stream's chunks, relative to its request."""

    def __init__(self, started: float, times: list[float], tokens: int) -> None:
        self.started, self.times, self.tokens = started, times, tokens

    @property
    def ttft(self) -> float:
        return self.times[0] - self.started

    @property
    def tok_s(self) -> float:
        return self.tokens / (self.times[-1] - self.started)

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]


def summarize(name: str, path: str, rounds: list[list[Stream]]) -> dict[str, Any]:
    """Per-stream medians over every stream of every round, plus the aggregate rate of a round."""
    streams = [s for r in rounds for s in r]
    gaps = sorted(g for s in streams for g in s.gaps) or [0.0]
    aggregate = [
        sum(s.tokens for s in r) / (max(s.times[-1] for s in r) - min(s.started for s in r)) for r in rounds
    ]
    return {
        "scenario": name,
        "path": path,
        "streams": len(rounds[0]),
        "tok_s_per_stream": statistics.median(s.tok_s for s in streams),
        "tok_s_aggregate": statistics.median(aggregate),
        "ttft_ms_p50": 1000 * statistics.median(s.ttft for s in streams),
        "gap_ms_p50": 1000 * gaps[len(gaps) // 2],
        "gap_ms_p99": 1000 * gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))],
    }


# ---- raw exllamav2, in process --------------------------------------------------------------------


def load(model: str, args: argparse.Namespace, gpu_split: list[float] | None = None) -> ExLlamaV2Engine:
    settings = {
        "max_batch_size": args.concurrency,
        "max_chunk_size": args.max_chunk_size,
        "gpu_split": gpu_split,
    }
    engine: ExLlamaV2Engine = create_engine("exllamav2", model, args.max_seq_len, settings)
    engine.load(lambda detail, progress: None)
    raw_round(engine, 32, 1)  # the same two warm-up jobs the worker runs before it reports ready
    raw_round(engine, 32, 1)
    return engine


def raw_round(engine: ExLlamaV2Engine, new_tokens: int, count: int) -> list[Stream]:
    """count greedy jobs straight through exllamav2's generator (the engine only built it)."""
    from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

    generator, torch = engine.generator, engine._torch
    ids = torch.tensor([engine.encode(PROMPT, True)], dtype=torch.long)
    times: dict[int, list[float]] = {i: [] for i in range(count)}
    tokens = dict.fromkeys(range(count), 0)
    started = time.perf_counter()
    for i in range(count):
        generator.enqueue(ExLlamaV2DynamicJob(input_ids=ids, max_new_tokens=new_tokens, identifier=i,
                                              gen_settings=ExLlamaV2Sampler.Settings.greedy()))  # fmt: skip
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result["stage"] == "streaming" and "token_ids" in result:
                times[result["identifier"]].append(time.perf_counter())
                tokens[result["identifier"]] += int(result["token_ids"].shape[-1])
    return [Stream(started, times[i], tokens[i]) for i in range(count)]


def run_raw(args: argparse.Namespace, report: dict[str, Any]) -> None:
    engine = load(args.model, args)
    report["paged"], report["devices"] = engine.paged, engine.info()["devices"]
    single = [raw_round(engine, args.new_tokens, 1) for _ in range(args.runs)]
    report["rows"].append(summarize("single stream", "raw", single))
    concurrent = [raw_round(engine, args.new_tokens, args.concurrency) for _ in range(args.rounds)]
    report["rows"].append(summarize(f"{args.concurrency} concurrent", "raw", concurrent))
    engine.close()


# ---- through the gateway ----------------------------------------------------------------------------


def http_round(url: str, model: str, new_tokens: int, count: int) -> list[Stream]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}

    def one(_: int) -> Stream:
        with httpx.Client(base_url=url) as client:
            result = stream_completion(client, "/v1/completions", body)
        tokens = (result.usage or {}).get("completion_tokens", len(result.chunk_times))
        return Stream(result.started, result.chunk_times, tokens)

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def registry_entry(name: str, model: str, gpus: list[int], args: argparse.Namespace) -> dict[str, Any]:
    settings = {"max_batch_size": args.concurrency, "max_chunk_size": args.max_chunk_size}
    return {"name": name, "engine": "exllamav2", "path": model, "gpus": gpus, "max_seq_len": args.max_seq_len,
            "engine_settings": settings}  # fmt: skip


def run_gateway(args: argparse.Namespace, report: dict[str, Any]) -> None:
    config = write_registry(args.out_dir / "bench-one.yaml", [registry_entry("m", args.model, [0], args)])
    log = args.out_dir / "bench-gateway-one.log"
    with GatewayProcess(config, env=gateway_env(), ready_timeout=600, log_path=log) as gw:
        single = [http_round(gw.url, "m", args.new_tokens, 1) for _ in range(args.runs)]
        report["rows"].append(summarize("single stream", "gateway", single))
        concurrent = [http_round(gw.url, "m", args.new_tokens, args.concurrency) for _ in range(args.rounds)]
        report["rows"].append(summarize(f"{args.concurrency} concurrent", "gateway", concurrent))


def run_two_gpus(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Two models on two GPUs at once versus each alone: threads of one process, then the gateway."""
    model_b = args.model_b or args.model
    engines = [load(args.model, args, [100.0, 0.0]), load(model_b, args, [0.0, 100.0])]
    for index, engine in enumerate(engines):
        alone = [raw_round(engine, args.new_tokens, 1)]
        report["rows"].append(summarize(f"model {'AB'[index]} alone", "raw threads", alone))
    results: list[list[Stream]] = [[], []]

    def drive(index: int) -> None:
        results[index].extend(raw_round(engines[index], args.new_tokens, 1))

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index in range(2):
        report["rows"].append(
            summarize(f"model {'AB'[index]} with the other", "raw threads", [results[index]])
        )
    for engine in engines:
        engine.close()
    models = [registry_entry("a", args.model, [0], args), registry_entry("b", model_b, [1], args)]
    config = write_registry(args.out_dir / "bench-two.yaml", models)
    log = args.out_dir / "bench-gateway-two.log"
    with GatewayProcess(config, env=gateway_env(), ready_timeout=600, log_path=log) as gw:
        for name in ("a", "b"):
            alone = [http_round(gw.url, name, args.new_tokens, 1)]
            report["rows"].append(summarize(f"model {name.upper()} alone", "gateway", alone))
        with ThreadPoolExecutor(2) as pool:
            both = list(pool.map(lambda n: http_round(gw.url, n, args.new_tokens, 1), ["a", "b"]))
        for name, streams in zip(("A", "B"), both, strict=True):
            report["rows"].append(summarize(f"model {name} with the other", "gateway", [streams]))


# ---- report ----------------------------------------------------------------------------------------


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row against its baseline in the same run: gateway vs raw, 'with the other' vs 'alone'."""
    by_key = {(r["scenario"], r["path"]): r for r in rows}
    for row in rows:
        base = None
        if row["path"] == "gateway" and (row["scenario"], "raw") in by_key:
            base = by_key[(row["scenario"], "raw")]
        elif row["scenario"].endswith("with the other"):
            base = by_key.get((row["scenario"].replace("with the other", "alone"), row["path"]))
        if base:
            row["tok_s_ratio"] = row["tok_s_per_stream"] / base["tok_s_per_stream"]
            row["ttft_ratio"] = row["ttft_ms_p50"] / base["ttft_ms_p50"]


def markdown(report: dict[str, Any]) -> str:
    head = ("| scenario | path | streams | tok/s per stream | tok/s total | TTFT p50 ms | gap p50 ms | "
            "gap p99 ms | tok/s ratio | TTFT ratio |\n|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    versions = report["versions"]
    lines = [f"{report['device']} | {report['date']} | exllamav2 {versions['exllamav2']} | "
             f"torch {versions['torch']} | paged={report.get('paged')} | {report['new_tokens']} new tokens",
             "", head]  # fmt: skip
    for r in report["rows"]:
        ratio = f"{r['tok_s_ratio']:.3f}" if "tok_s_ratio" in r else "-"
        ttft = f"{r['ttft_ratio']:.2f}" if "ttft_ratio" in r else "-"
        lines.append(f"| {r['scenario']} | {r['path']} | {r['streams']} | {r['tok_s_per_stream']:.1f} | "
                     f"{r['tok_s_aggregate']:.1f} | {r['ttft_ms_p50']:.1f} | {r['gap_ms_p50']:.2f} | "
                     f"{r['gap_ms_p99']:.2f} | {ratio} | {ttft} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model folder (an 8B-shape demo model in gpu_run.sh)")
    parser.add_argument("--model-b", help="second model for the two-GPU scenario (default: --model)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3, help="single-stream repetitions")
    parser.add_argument("--rounds", type=int, default=1, help="concurrent repetitions")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--max-chunk-size", type=int, default=2048)
    parser.add_argument("--modes", default="raw,gateway,two-gpus", help="comma-separated subset")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    import exllamav2
    import torch

    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "exllamav2": exllamav2.__version__,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
        },  # fmt: skip
        "model": args.model,
        "new_tokens": args.new_tokens,
        "settings": {
            "max_seq_len": args.max_seq_len,
            "max_chunk_size": args.max_chunk_size,
            "max_batch_size": args.concurrency,
            "greedy": True,
        },  # fmt: skip
        "rows": [],
    }
    modes = args.modes.split(",")
    scenarios = {"raw": run_raw, "gateway": run_gateway, "two-gpus": run_two_gpus}
    for mode in modes:
        if mode == "two-gpus" and torch.cuda.device_count() < 2:
            report.setdefault("skipped", []).append("two-gpus: needs two GPUs")
            continue
        try:
            scenarios[mode](args, report)
        except Exception as exc:  # one broken scenario must not lose the others' numbers
            print(f"bench: scenario {mode} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            report.setdefault("errors", []).append(f"{mode}: {type(exc).__name__}: {str(exc)[:2000]}")
    add_ratios(report["rows"])
    (args.out_dir / "bench_exllamav2.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (args.out_dir / "bench_exllamav2.md").write_text(table + "\n")
    print(table)
    return 1 if report.get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())
