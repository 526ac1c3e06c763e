"""What asking for logprobs costs a GPU engine's steps, in-process, and against another StepLogprobs.

Runs in one process on a GPU host, with the engine's tests' model (`scripts/gpu_run.sh` writes the
8B shape). Loads one engine as a worker does (one torch CPU thread, frozen heap), then at each
concurrency runs interleaved rounds of greedy jobs through our engine's submit/step: without
logprobs, with `--top` alternatives per token, and, with `--baseline FILE`, with the StepLogprobs
class of that file in place of the engine's own (say the previous commit's, from `git show`), so a
change to how logprobs are captured is measured against what it replaces in the same run. Each
logprobs path is paired per round with the plain round of the same turn.

    python bench/bench_logprobs_step.py --engine exllamav3 --model /tmp/models/llama3-8b \\
        --streams 16,64 --rounds 8 --baseline /tmp/gpu_logprobs_before.py
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench.bench_engines import PromptSource  # noqa: E402
from bench.streams import Round, engine_round, paired, summarize  # noqa: E402
from model_worker.engines.registry import create_engine  # noqa: E402

# The forward pass each engine's StepLogprobs wraps (as the engines' load() attach it).
FORWARD_NAMES = {"exllamav2": "forward_chunk", "exllamav3": "forward"}
PLAIN, OURS, BASELINE = "no logprobs", "logprobs", "logprobs, baseline"


def load_baseline(path: Path, engine: Any, engine_name: str) -> Any:
    """The file's StepLogprobs, attached to the engine's generator beside its own: each wrapper
    captures only while its own jobs are active, so whichever instance the engine holds works."""
    spec = importlib.util.spec_from_file_location("baseline_logprobs", path)
    assert spec is not None and spec.loader is not None, f"cannot import {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    baseline = module.StepLogprobs(engine._logprobs.vocab_size)
    baseline.attach(engine.generator, engine.model, FORWARD_NAMES[engine_name])
    return baseline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=sorted(FORWARD_NAMES), default="exllamav3")
    parser.add_argument("--model", required=True)
    parser.add_argument("--streams", default="16,64")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--top", type=int, default=1, help="alternatives per token (OpenAI's logprobs)")
    parser.add_argument("--baseline", type=Path, help="a module file with another StepLogprobs")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    levels = [int(s) for s in args.streams.split(",")]

    import torch

    torch.set_num_threads(1)  # as a GPU worker runs (model_worker.main)
    settings = {"max_batch_size": max(levels), "max_chunk_size": 2048, "cache_size": 65536}
    engine = create_engine(args.engine, args.model, 4096, settings)
    engine.load(lambda detail, progress: None)
    ours = engine._logprobs
    baseline = load_baseline(args.baseline, engine, args.engine) if args.baseline else None
    gc.collect()
    gc.freeze()

    def run(path: str, ids: list[list[int]]) -> Round:
        engine._logprobs = baseline if path == BASELINE else ours
        try:
            return engine_round(engine, ids, args.new_tokens, logprobs=None if path == PLAIN else args.top)
        finally:
            engine._logprobs = ours

    paths = [PLAIN, OURS, *([BASELINE] if baseline is not None else [])]
    stamp = datetime.now(timezone.utc)
    report: dict[str, Any] = {
        "engine": args.engine,
        "date": stamp.isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0),
        "settings": vars(args) | {"streams": levels},
        "rows": [],
    }
    for count in levels:
        source = PromptSource(count, fresh=True)

        def ids(source: PromptSource = source) -> list[list[int]]:
            return [engine.encode(text, True) for text in source.texts()]

        for path in paths:  # warm-up: this batch shape, once each
            run(path, ids())
        rounds: dict[str, list[Round]] = {path: [] for path in paths}
        for turn in range(args.rounds):
            for path in paths if turn % 2 == 0 else paths[::-1]:
                rounds[path].append(run(path, ids()))
        for path, done in rounds.items():
            row = {"path": path, "streams": count, **summarize(done)}
            if path != PLAIN:
                row.update(paired(done, rounds[PLAIN]))
            report["rows"].append(row)
        print(f"bench: {count} streams done", flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = f"logprobs_step_{args.engine}_{stamp:%Y-%m-%dT%H%MZ}"
    (args.out_dir / f"{name}.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out_dir / f"{name}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def markdown(report: dict[str, Any]) -> str:
    lines = [f"{report['gpu']} | {report['date']} | {report['engine']} | our engine in-process, greedy, "
             f"{report['settings']['new_tokens']} new tokens, top {report['settings']['top']} alternatives, "
             f"new prompts every round, median of {report['settings']['rounds']} interleaved rounds",
             "", "| path | streams | tok/s (min-max) | step p50 / p99 ms | against no logprobs, paired |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in report["rows"]:
        against = "-"
        if "paired_ratio" in r:
            against = f"{r['paired_ratio']:.3f} ({r['paired_ratio_min']:.3f}-{r['paired_ratio_max']:.3f})"
        rate = f"{r['tok_s_total']:.1f} ({r['tok_s_total_min']:.0f}-{r['tok_s_total_max']:.0f})"
        step = f"{r['step_ms_p50']:.2f} / {r['step_ms_p99']:.2f}"
        lines.append(f"| {r['path']} | {r['streams']} | {rate} | {step} | {against} |")
    by_level: dict[int, dict[str, list[float]]] = {}
    for r in report["rows"]:
        if "paired_ratio_turns" in r:
            by_level.setdefault(r["streams"], {})[r["path"]] = r["paired_ratio_turns"]
    for count, turns in by_level.items():
        if OURS in turns and BASELINE in turns:  # ours against the baseline, turn by turn
            ratios = sorted(a / b for a, b in zip(turns[OURS], turns[BASELINE], strict=True))
            lines.append(f"\n{count} streams: logprobs as captured now / baseline, paired by turn: "
                         f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
