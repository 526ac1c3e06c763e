"""Speculative decoding's effect on exllamav2 or exllamav3: plain vs a draft model vs n-gram drafts.

Runs in one process on a GPU host (scripts/gpu_run.sh stage `spec`), one engine per run
(`--engine`). Same target model, prompt and greedy settings for every mode; reports tokens/s,
accepted draft tokens per completion token, and the ratio to plain decoding. With random-weight
test models a draft model agrees with the target only by chance, so expect it to cost more than it
saves; n-gram drafts help when the text repeats.

    python bench/bench_speculative.py --model /tmp/models/llama3-8b --draft /tmp/models/draft-8b-vocab
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Any

from model_worker.engines.registry import create_engine
from wire.params import SamplingParams

PROMPT = "List the steps of making bread, then list them again in the same words. " * 8


def measure(engine: Any, prompt_ids: list[int], tokens: int, repeats: int) -> dict[str, float]:
    rates, accepted = [], []
    for run in range(repeats + 1):  # the first run is a warm-up
        engine.submit(
            f"r{run}", prompt_ids, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        )
        started, accepted_tokens = time.perf_counter(), 0
        while engine.has_work():
            for output in engine.step():
                if output.usage is not None:
                    accepted_tokens = output.usage.accepted_draft_tokens
        elapsed = time.perf_counter() - started
        if run:
            rates.append(tokens / elapsed)
            accepted.append(accepted_tokens / tokens)
    return {"tok_s": statistics.median(rates), "accepted_per_token": statistics.median(accepted)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--engine", default="exllamav2", choices=["exllamav2", "exllamav3"])
    parser.add_argument("--draft", default=None, help="a draft model with the target's vocabulary")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    modes: dict[str, dict[str, Any]] = {"plain": {}, "ngram": {"ngram_draft": True}}
    if args.draft:
        modes["draft model"] = {"draft_path": args.draft}
    rows = {}
    for name, extra in modes.items():
        engine = create_engine(args.engine, args.model, 4096, {"max_batch_size": 1, **extra})
        engine.load(lambda detail, progress: None)
        rows[name] = measure(engine, engine.encode(PROMPT, True), args.tokens, args.repeats)
        device = engine.info().devices[0].name
        engine.close()
    plain = rows["plain"]["tok_s"]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    lines = [
        f"{device} | {date} | {args.engine} | {Path(args.model).name} | greedy, {args.tokens} tokens, "
        f"median of {args.repeats}",
        "",
        "| mode | tok/s | vs plain | accepted draft tokens per token |",
        "|---|---|---|---|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['tok_s']:.1f} | {row['tok_s'] / plain:.2f} | {row['accepted_per_token']:.2f} |"
        )
    print("\n".join(lines))
    if args.out:
        report = {"device": device, "date": date, "engine": args.engine, "rows": rows}
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
