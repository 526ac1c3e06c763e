"""What a fresh worker pays the first time it meets a burst of a new shape, after its warm-up.

Runs in one process on a GPU host. Loads a model with the benchmark's engine settings, runs the
worker's own warm-up (model_worker.warmup) or none, then bursts of jobs submitted together (N jobs of
L prompt tokens, greedy, a few new tokens each) twice over: a first sweep through every shape, then a
second. A shape whose first burst takes much longer than its second met a one-time cost the warm-up
did not pay (exllamav3 compiles its Triton attention kernels per specialization of their shape
arguments, and captures its decode graphs per batch size), and a user's first requests of that shape
pay it instead. Prompts are text, distinct from their first tokens in every burst, so no prefix is
found in the cache. The heap is frozen after the warm-up, as the worker freezes it.

Triton keeps what it compiled on disk (~/.triton/cache) for the next process; this runs with a
fresh, empty cache directory, so that it measures a fresh host, unless --triton-cache names one to
use and keep: a second run with the same directory measures a worker restarted on the same host
(or one whose cache directory is a kept volume), which loads those kernels instead of compiling.

    python bench/bench_first_bursts.py --engine exllamav3 --model /tmp/models/llama3-8b \\
        --warm-up worker --out /tmp/bench/first_bursts.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# One intra-op CPU thread for torch, as a GPU worker runs (model_worker.main); before torch is imported.
for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

from bench.bench_engines import PROMPT  # noqa: E402
from bench.bench_engines import prompts as engines_prompts  # noqa: E402
from model_worker.engines.registry import create_engine  # noqa: E402
from model_worker.warmup import warm_up  # noqa: E402
from wire.params import SamplingParams  # noqa: E402

DEFAULT_SHAPES = "1x151,3x151,9x151,25x151,63x151,64x151,64x33,17x100,1x600,25x600"


def burst_shapes(text: str) -> list[tuple[int, int]]:
    """`25x151,64x33`: (jobs, prompt tokens) pairs, each at least 1."""
    shapes = []
    for item in text.split(","):
        jobs, sep, length = item.strip().partition("x")
        if not sep or not jobs.isdigit() or not length.isdigit() or int(jobs) < 1 or int(length) < 2:
            raise argparse.ArgumentTypeError(f"expected JOBSxTOKENS[,JOBSxTOKENS], like 25x151; got {text!r}")
        shapes.append((int(jobs), int(length)))
    return shapes


def compiled_kernels(cache_dir: str, seen: set[Path]) -> list[str]:
    """Kernels Triton compiled since the last call: the metadata files new in its cache directory,
    as `name (warps, stages, shared bytes)`."""
    found = []
    for meta in sorted(Path(cache_dir).glob("*/*.json")):
        if meta in seen or meta.name.startswith("__grp__"):
            continue
        seen.add(meta)
        try:
            info = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
        found.append(f"{info.get('name', meta.stem)} ({info.get('num_warps')}, {info.get('num_stages')}, "
                     f"{info.get('shared')})")  # fmt: skip
    return found


def run_burst(engine: Any, prompts: list[list[int]], new_tokens: int, tag: str) -> dict[str, Any]:
    """Submit every prompt, step until all are done: the first step's and the whole burst's time."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.submit(f"{tag}-{index}", prompt, params)
    step_ms: list[float] = []
    while engine.has_work():
        before = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - before) * 1000)
    burst_ms = (time.perf_counter() - started) * 1000
    lengths = [len(prompt) for prompt in prompts]
    return {"prompt_tokens": [min(lengths), max(lengths)],
            "first_step_ms": round(step_ms[0], 2), "burst_ms": round(burst_ms, 2),
            "steps": len(step_ms), "slowest_step_ms": round(max(step_ms), 2)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("exllamav2", "exllamav3", "transformers"), default="exllamav3")
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--cache-size", type=int, default=65536)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-chunk-size", type=int, default=2048)
    parser.add_argument("--warm-up", choices=("worker", "none"), default="worker")
    parser.add_argument("--shapes", type=burst_shapes, default=burst_shapes(DEFAULT_SHAPES))
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--prompts", choices=("fresh", "engines"), default="fresh",
                        help="fresh: new text in every burst; engines: bench_engines.py's prompts, the same "
                        "in every sweep (as its rounds send them)")  # fmt: skip
    parser.add_argument(
        "--repeat-prompts", action="store_true", help="the second sweep repeats the first's prompts"
    )
    parser.add_argument(
        "--triton-cache", type=Path, default=None, help="Triton's cache directory, used and kept"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    if max(jobs for jobs, _ in args.shapes) > args.max_batch_size:
        parser.error("a shape has more jobs than --max-batch-size")
    if args.triton_cache is None:
        cache_dir = tempfile.mkdtemp(prefix="triton-fresh-")
    else:
        args.triton_cache.mkdir(parents=True, exist_ok=True)
        cache_dir = str(args.triton_cache)
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    seen: set[Path] = set()
    kept_kernels = len(compiled_kernels(cache_dir, seen))  # what an earlier run left: not new here

    settings: dict[str, Any] = {}  # the transformers engine (a CPU smoke run) takes its defaults
    if args.engine != "transformers":
        settings = {"max_batch_size": args.max_batch_size, "max_chunk_size": args.max_chunk_size,
                    "cache_size": args.cache_size}  # fmt: skip
    engine = create_engine(args.engine, args.model, args.max_seq_len, settings)
    loaded = time.monotonic()
    engine.load(lambda detail, progress: None)
    load_s = time.monotonic() - loaded
    warm_s = warm_up(engine, args.max_seq_len, 2) if args.warm_up == "worker" else 0.0
    before_bursts = compiled_kernels(cache_dir, seen)
    # As the worker does once warm (model_worker.serve_loop): full collections then skip the model's
    # objects; without it they walk them in the middle of the bursts.
    gc.collect()
    gc.freeze()
    unit = engine.encode(PROMPT, False)
    filler = unit * (max(length for _, length in args.shapes) // len(unit) + 1)  # longer than any prompt
    sweeps: list[dict[str, dict[str, Any]]] = []
    for sweep in range(2):
        figures = {}
        for jobs, length in args.shapes:
            round_tag = 0 if args.repeat_prompts else sweep
            if args.prompts == "engines":  # bench_engines.py's own prompts, cut to the length
                prompts = [engine.encode(text, True)[:length] for text in engines_prompts(jobs)]
            else:  # text, each prompt with its own start: no prefix is shared with another
                starts = [
                    engine.encode(f"Burst {round_tag}-{jobs}x{length}, job {i}. ", True) for i in range(jobs)
                ]
                prompts = [(start + filler)[:length] for start in starts]
            shape = f"{jobs}x{length}"
            figures[shape] = run_burst(engine, prompts, args.new_tokens, f"s{sweep}-{shape}")
            figures[shape]["compiled"] = compiled_kernels(cache_dir, seen)
        sweeps.append(figures)
    engine.close()

    first, second = sweeps
    rows = []
    print(
        f"{args.engine}, warm-up {args.warm_up} ({warm_s:.1f} s), load {load_s:.1f} s, "
        f"{kept_kernels} kernels in the cache at start, {len(before_bursts)} compiled before the bursts"
    )
    print("shape      first burst ms  second ms  first / second  first step ms (second)")
    for shape in first:
        ratio = first[shape]["burst_ms"] / second[shape]["burst_ms"]
        once, again = first[shape], second[shape]
        rows.append({"shape": shape, "first": once, "second": again, "ratio": round(ratio, 3)})
        print(f"{shape:<10} {once['burst_ms']:>14.1f} {again['burst_ms']:>10.1f} {ratio:>15.2f}"
              f"  {once['first_step_ms']:.1f} ({again['first_step_ms']:.1f})")  # fmt: skip
        for kernel in once["compiled"] + again["compiled"]:
            print(f"    compiled: {kernel}")
    if args.out is not None:
        report = {"engine": args.engine, "warm_up": args.warm_up, "warm_up_s": round(warm_s, 2),
                  "load_s": round(load_s, 2), "compiled_before_bursts": before_bursts,
                  "settings": settings, "max_seq_len": args.max_seq_len,
                  "new_tokens": args.new_tokens, "prompts": args.prompts,
                  "repeat_prompts": args.repeat_prompts, "fresh_triton_cache": args.triton_cache is None,
                  "kernels_in_cache_at_start": kept_kernels,
                  "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "shapes": rows}  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
