"""The warm-up a worker runs after loading and before it reports ready.

Runs in the worker process, on the serve loop's thread, through the engine's own submit/step. Owns
the warm-up plan: one-time costs (kernel selection, allocator growth, sampling paths, longer
sequence shapes, and for an engine that declares them, batch sizes) are paid here, so the first
user request is as fast as the tenth, and so are the first requests that arrive together.
"""

from __future__ import annotations

import math
import time

from model_worker.engines.base import Engine, WarmsBatches
from wire.params import SamplingParams

BATCH_WARMUP_TOKENS = 4  # new tokens per job of a batch warm-up: a few steps at that batch size

WARMUP_PROMPT = (
    "Warm-up: the worker runs this once after loading so that kernels, allocators and caches "
    "are initialised before the first user request arrives. " * 3
)


def warm_up(engine: Engine, max_seq_len: int, runs: int) -> float:
    """A short greedy run (`runs` times), a longer prompt and completion, and a sampled run;
    returns the seconds it took. Prompts and completions always fit the context."""
    started = time.monotonic()
    short = engine.encode(WARMUP_PROMPT, add_special_tokens=True)[: max(max_seq_len // 4, 1)]
    long_len = max(min(512, max_seq_len // 2), len(short))
    long = (short * (long_len // len(short) + 1))[:long_len]

    def params(
        prompt: list[int], tokens: int, temperature: float = 0.0, top_p: float = 1.0
    ) -> SamplingParams:
        room = max(min(tokens, max_seq_len - len(prompt) - 1), 1)
        return SamplingParams(max_tokens=room, ignore_eos=True, temperature=temperature, top_p=top_p, seed=0)

    plan = [(short, params(short, 32))] * max(runs - 1, 1)
    plan.append((long, params(long, 128)))
    plan.append((short, params(short, 32, temperature=0.8, top_p=0.9)))
    for run, (prompt_ids, job_params) in enumerate(plan):
        engine.submit(f"__warmup-{run}", prompt_ids, job_params)
        while engine.has_work():
            engine.step()
    if isinstance(engine, WarmsBatches):
        chunk, sizes = engine.prefill_chunk_tokens(), engine.warmup_batches()
        for size in sizes:
            prompts = batch_prompts(short, size, chunk, max_seq_len, fill_chunk=size == sizes[-1])
            for job, prompt_ids in enumerate(prompts):
                job_params = params(prompt_ids, BATCH_WARMUP_TOKENS)
                engine.submit(f"__warmup-batch{size}-{job}", prompt_ids, job_params)
            while engine.has_work():
                engine.step()
    return time.monotonic() - started


def batch_prompts(
    short: list[int], size: int, chunk: int, max_seq_len: int, fill_chunk: bool
) -> list[list[int]]:
    """`size` prompts, each a rotation of `short`: prompts that start alike would share cache pages
    and skip their prefill. With `fill_chunk`, long enough together to fill more than one prefill
    chunk, as a burst of requests does, within a quarter of the context each."""
    length = len(short)
    if fill_chunk:
        length = min(max(math.ceil((chunk + 1) / size), length), max(max_seq_len // 4, 1))
    repeated = short * (length // len(short) + 2)
    return [repeated[job % len(short) :][:length] for job in range(size)]


def warm_up_embeddings(engine: Engine) -> float:
    """An embedding model's warm-up: one short and one longer batch through `embed`."""
    started = time.monotonic()
    ids = engine.encode(WARMUP_PROMPT, add_special_tokens=True)
    engine.embed([ids[:8], ids[:64], ids[:512]])  # type: ignore[attr-defined]
    return time.monotonic() - started
