"""The longest legitimate generator step: one full prefill chunk, on the exllamav2 engine.

Runs in one process on a GPU host. The supervisor's wedge watchdog (`limits.wedge_timeout_s`)
kills a worker whose jobs see no step for that long, so its default must sit far above the
slowest real step. This loads a model with the registry's engine settings, submits a prompt that
fills most of the context, and times every `step()`: the prefill chunks and the decode steps.

    python bench/bench_prefill_step.py --model /tmp/models/llama3-8b --max-seq-len 8192
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from model_worker.engines.registry import create_engine
from wire.codec import as_dict
from wire.params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-seq-len", type=int, default=8192)
    parser.add_argument("--max-chunk-size", type=int, default=2048)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    settings = {"max_batch_size": 1, "max_chunk_size": args.max_chunk_size}
    engine = create_engine("exllamav2", args.model, args.max_seq_len, settings)
    engine.load(lambda detail, progress: None)
    words = Path(__file__).read_text().split()
    prompt_ids: list[int] = []
    while len(prompt_ids) < args.max_seq_len - 64:
        prompt_ids += engine.encode(" ".join(words), add_special_tokens=False)
    prompt_ids = prompt_ids[: args.max_seq_len - 64]
    figures = {}
    for run in ("warm-up", "measured"):
        engine.submit(run, prompt_ids, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
        steps = []
        while engine.has_work():
            started = time.perf_counter()
            outputs = engine.step()
            steps.append((time.perf_counter() - started, sum(len(o.token_ids) for o in outputs)))
        prefill = [s for s, tokens in steps if tokens == 0] or [steps[0][0]]
        decode = [s for s, tokens in steps if tokens > 0]
        figures = {
            "prompt_tokens": len(prompt_ids),
            "max_chunk_size": args.max_chunk_size,
            "longest_step_s": round(max(s for s, _ in steps), 4),
            "prefill_steps": len(prefill),
            "prefill_step_max_s": round(max(prefill), 4),
            "decode_step_p50_s": round(statistics.median(decode), 4) if decode else None,
            "info": {k: v for k, v in as_dict(engine.info()).items() if k != "devices"},
        }
    print(json.dumps(figures, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    engine.close()


if __name__ == "__main__":
    main()
