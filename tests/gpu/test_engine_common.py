"""Every GPU engine mode on a real GPU, driven directly the way the serve loop drives it.

Runs in the pytest process on the GPU machine, once per engine mode (exllamav2 paged, exllamav2
unpaged, exllamav3; see conftest). The warm-up test comes first on purpose: it should see a
process in which the model has not generated yet.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from model_worker.warmup import warm_up
from tests.gpu.support import SKIP_REASON, assert_same_tokens, greedy, record, run_job, run_jobs

if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import torch  # noqa: E402

from model_worker.engines.base import RequestRejected  # noqa: E402
from model_worker.engines.validation import check_job  # noqa: E402
from tests.gpu.conftest import load_engine  # noqa: E402
from tests.gpu.support import BIG_SETTINGS, ENGINE_MODES, PAGED_MODES, TINY_SETTINGS  # noqa: E402
from wire.params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village,"
WARMUP_PROMPT = "Warm-up: kernels, allocators and caches are initialised before the first request. " * 3
ATTENTION = {"exllamav2-paged": "flash-attn", "exllamav3": "triton-paged"}


@pytest.mark.parametrize("which", ["tiny", "big"])
@pytest.mark.parametrize("mode", list(ENGINE_MODES))
def test_warm_up_effect(mode: str, which: str, request: pytest.FixtureRequest) -> None:
    """The first generation after loading is slow; after the serve loop's warm-up it is not."""
    if which == "big" and mode not in PAGED_MODES:
        pytest.skip("the 8B shape runs in the batching modes")
    path: Path = request.getfixturevalue("tiny_model" if which == "tiny" else "big_model")
    engine = load_engine(mode, path, **(TINY_SETTINGS if which == "tiny" else BIG_SETTINGS))
    try:
        # The first short job shows the cold cost; then exactly the serve loop's own warm-up runs.
        warm_ids = engine.encode(WARMUP_PROMPT, True)
        warm = [run_job(engine, warm_ids, greedy(32)).seconds]
        warm.append(warm_up(engine, engine.max_seq_len, 2))
        ids = engine.encode(PROMPT, True)
        seconds = [run_job(engine, ids, greedy(64)).seconds for _ in range(5)]
    finally:
        engine.close()
    steady = statistics.median(seconds[2:])
    record(f"warm-up {which} {mode}", cold_tok_s=32 / warm[0], serve_loop_warmup_s=warm[1],
           first_after_warmup_s=seconds[0], steady_s=steady,
           first_over_steady=seconds[0] / steady)  # fmt: skip
    # New prompt lengths still cost a little once (attention shapes); 0.1 s covers that on the tiny
    # model, whose whole job takes 0.09 s. On the 8B shape exllamav3's first two jobs after warm-up
    # measured 1.2 to 1.7 x steady over three runs on one host; a cold start adds about 2 s to a job
    # of 1.1 s, which 2 x still catches.
    assert seconds[0] <= 2 * steady + 0.1, (warm, seconds)


@pytest.mark.parametrize("mode", PAGED_MODES)
def test_warm_up_covers_batches_of_jobs_that_arrive_together(mode: str, big_model: Path) -> None:
    """After the serve loop's warm-up, the first batch of each size the engine warms (exllamav3:
    2 to 8 jobs, its graphed decode sizes, then its largest batch) runs about as fast as the next
    batch of that size. Before the batch warm-up, exllamav3's first 2 jobs at once took 1.6 s on the
    8B shape against 0.2 s the next time. Each pass has prompts of its own: a prompt the engine has
    run before is found in its cache and skips its prefill (exllamav3: 64 repeated prompts of 151
    tokens took 190 ms against 1.8 s new), which would make every second pass look fast."""
    engine = load_engine(mode, big_model, **BIG_SETTINGS)
    try:
        warm_up(engine, engine.max_seq_len, 2)
        passes: list[dict[int, float]] = [{}, {}]
        for number, seconds in enumerate(passes):
            ids = engine.encode(f"Pass {number}. {PROMPT}", True)
            for size in engine.warmup_batches():
                jobs = {f"p{number}-b{size}-{i}": (ids[i:] + ids[:i], greedy(8)) for i in range(size)}
                started = time.monotonic()
                run_jobs(engine, jobs)
                seconds[size] = time.monotonic() - started
    finally:
        engine.close()
    first, second = passes
    record(f"batch warm-up {mode}", first_s=first, second_s=second)
    assert first, "the engine warms no batch size"
    for size, took in first.items():
        assert took <= 2 * second[size] + 0.1, (size, first, second)


def test_greedy_completion_is_repeatable(engine: Any) -> None:
    ids = engine.encode(PROMPT, True)
    first = run_job(engine, ids, greedy(48))
    second = run_job(engine, ids, greedy(48))
    assert first.final.finish_reason == "length"
    assert len(first.token_ids) == 48
    assert first.token_ids == second.token_ids
    assert first.text and first.text == second.text
    assert first.text == engine.decode(first.token_ids)


def test_prompt_thread_codec_matches_the_engine_and_lets_the_gil_go(engine: Any) -> None:
    from model_worker.engines.prompt_tokenizer import ReleasingTokenizer

    codec = engine.text_codec()
    # Found where the library keeps its Hugging Face tokenizer, so long prompts do not hold the GIL.
    wrapped = [value for value in vars(codec.tokenizer).values() if isinstance(value, ReleasingTokenizer)]
    wrapped += [
        value
        for holder in vars(codec.tokenizer).values()
        if hasattr(holder, "__dict__")
        for value in vars(holder).values()
        if isinstance(value, ReleasingTokenizer)
    ]
    assert wrapped, type(codec.tokenizer)
    bos = getattr(engine.tokenizer, "bos_token", None) or ""  # a special token in the text (both libraries)
    for text in (PROMPT, "Ça va? 東京 " * 40, f"{bos}text after a special token", ""):
        for special in (True, False):
            assert codec.encode(text, special) == engine.encode(text, special), (text, special)
    ids = engine.encode(PROMPT, True)
    assert codec.decode(ids) == engine.decode(ids)


def test_streaming_outputs_arrive_step_by_step(engine: Any, mode: str) -> None:
    run = run_job(engine, engine.encode(PROMPT, True), greedy(64))
    # Not always one output per token: an engine holds text back while it ends in an unfinished
    # UTF-8 sequence or could be the start of a stop string.
    assert len(run.outputs) >= 32, "tokens must stream out over many steps, not in one lump"
    assert all(o.finish_reason is None and o.usage is None for o in run.outputs[:-1])
    assert run.final.usage is not None
    gaps = sorted(b - a for a, b in zip(run.times, run.times[1:], strict=False))
    record(f"engine stream tiny {mode}", outputs=len(run.outputs), tok_s=64 / run.seconds,
           gap_p50_ms=1000 * gaps[len(gaps) // 2], gap_max_ms=1000 * gaps[-1])  # fmt: skip


def test_usage_counts_and_timings(engine: Any, mode: str) -> None:
    ids = engine.encode(PROMPT, True)
    run = run_job(engine, ids, greedy(40))
    usage = run.final.usage
    assert usage.prompt_tokens == len(ids)
    assert usage.completion_tokens == 40 == len(run.token_ids)
    for key in ("queue_s", "prefill_s", "decode_s"):
        assert 0.0 <= getattr(usage, key) <= run.seconds + 0.01, (key, usage)
    again = run_job(engine, ids, greedy(40)).final.usage
    record(f"engine usage tiny {mode}", cached_first=usage.cached_tokens, cached_again=again.cached_tokens)


def test_concurrent_jobs_match_solo_runs(engine: Any, mode: str) -> None:
    prompts = {f"job{i}": engine.encode(f"Story {i}: {PROMPT}", True) for i in range(4)}
    solo = {rid: run_job(engine, ids, greedy(32, logprobs=2)) for rid, ids in prompts.items()}
    for rid, ids in prompts.items():
        engine.submit(rid, ids, greedy(32))
    most_active, outputs = 0, {rid: [] for rid in prompts}
    while engine.has_work():
        most_active = max(most_active, engine.stats().active_jobs)
        for output in engine.step():
            outputs[output.rid].extend(output.token_ids)
    if mode == "exllamav2-unpaged":
        assert most_active == 1  # the generator holds one job at a time, so each runs as if alone
        assert outputs == {rid: run.token_ids for rid, run in solo.items()}
    else:
        assert 1 < most_active <= 4
        for rid, run in solo.items():
            assert_same_tokens(run.token_ids, run.logprobs, outputs[rid], rid)
    record(f"engine 4 concurrent tiny {mode}", most_active=most_active)


def test_cancel_leaves_generator_empty_and_frees_the_cache(engine: Any) -> None:
    ids = engine.encode(PROMPT, True)
    engine.submit("a", ids, greedy(1000))
    engine.submit("b", ids, greedy(1000))
    for _ in range(5):
        engine.step()
    generator = engine.generator
    assert len(generator.active_jobs) + len(generator.pending_jobs) == 2
    assert engine.cancel("a") and engine.cancel("b")
    assert generator.pending_jobs == [] and generator.active_jobs == []
    assert not engine.has_work()
    stats = engine.stats()
    assert stats.cache_pages_total > 0 and stats.cache_pages_free == stats.cache_pages_total, stats
    assert not engine.cancel("a"), "a second cancel is a no-op"
    assert not engine.cancel("never-submitted")
    # The cache pages came back: a long job still fits and gives the usual result.
    assert run_job(engine, ids, greedy(16)).token_ids == run_job(engine, ids, greedy(16)).token_ids


def test_cancel_races_with_finish(engine: Any) -> None:
    ids = engine.encode(PROMPT, True)
    run_job(engine, ids, greedy(3), rid="done")
    assert not engine.cancel("done"), "a finished job is not cancelled"
    engine.submit("pending", ids, greedy(3))
    assert engine.cancel("pending"), "a job not yet started is cancelled"
    assert engine.generator.pending_jobs == [] and engine.generator.active_jobs == []


def test_stop_string(engine: Any) -> None:
    ids = engine.encode(PROMPT, True)
    base = run_job(engine, ids, greedy(48)).text
    middle = len(base) // 2
    needle = base[middle : middle + 3]
    assert needle.strip(), f"no usable stop string in {base!r}"
    run = run_job(engine, ids, greedy(48, stop=[needle]))
    assert run.final.finish_reason == "stop"
    assert run.text == base[: base.index(needle)]


def test_stop_token_id(engine: Any) -> None:
    ids = engine.encode(PROMPT, True)
    base = run_job(engine, ids, greedy(32)).token_ids
    stop_id = base[10]
    run = run_job(engine, ids, greedy(32, stop_token_ids=[stop_id]))
    assert run.final.finish_reason == "stop"
    assert run.token_ids == base[: base.index(stop_id)]


def test_eos_min_tokens_and_logit_bias(engine: Any) -> None:
    ids = engine.encode(PROMPT, True)
    eos = engine._eos_ids[0]
    bias = {eos: 100.0}
    run = run_job(engine, ids, greedy(16, ignore_eos=False, logit_bias=bias))
    assert run.final.finish_reason == "stop" and run.token_ids == [] and run.text == ""
    run = run_job(engine, ids, greedy(16, ignore_eos=False, logit_bias=bias, min_tokens=5))
    assert run.final.finish_reason == "stop" and len(run.token_ids) == 5 and eos not in run.token_ids
    run = run_job(engine, ids, greedy(6, ignore_eos=True, logit_bias=bias))
    assert run.final.finish_reason == "length" and run.token_ids == [eos] * 6


def test_seed_and_sampling_overrides(engine: Any) -> None:
    ids = engine.encode(PROMPT, True)

    def sampled(seed: int, **kw: Any) -> list[int]:
        params = SamplingParams(max_tokens=24, temperature=1.2, top_p=0.95, seed=seed, ignore_eos=True, **kw)
        return run_job(engine, ids, params).token_ids

    assert sampled(1) == sampled(1), "the same seed gives the same sample"
    assert sampled(1) != sampled(2), "another seed gives another sample"
    # top_k=1 leaves one candidate: whatever the temperature, that is greedy decoding.
    assert sampled(3, top_k=1) == run_job(engine, ids, greedy(24)).token_ids


def test_logprobs(engine: Any) -> None:
    run = run_job(engine, engine.encode(PROMPT, True), greedy(8, logprobs=3))
    entries = run.logprobs
    assert len(entries) == len(run.token_ids) == 8
    for entry, token_id in zip(entries, run.token_ids, strict=True):
        assert entry.token_id == token_id and entry.token == engine.decode([token_id])
        assert len(entry.top) == 3 and all(t.token == engine.decode([t.token_id]) for t in entry.top)
        values = [t.logprob for t in entry.top]
        assert values == sorted(values, reverse=True) and values[0] <= 0.0
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-3
        # Greedy picks the most likely token: it is the first alternative, with the same logprob.
        assert entry.top[0].token_id == token_id and abs(entry.top[0].logprob - entry.logprob) < 1e-4
    sampled = run_job(engine, engine.encode(PROMPT, True), SamplingParams(max_tokens=8, seed=4, logprobs=0))
    assert len(sampled.logprobs) == 8 and all(e.top == [] and e.logprob <= 0.0 for e in sampled.logprobs)


def test_logprobs_carry_the_bytes_of_a_token_that_is_part_of_a_character(engine: Any) -> None:
    emoji = "\U0001f60a"  # the demo vocabulary (byte-level BPE) splits it; each piece's text is U+FFFD
    pieces = engine.encode(emoji, False)
    assert len(pieces) > 1, pieces
    run = run_job(engine, engine.encode(PROMPT, True), greedy(1, logprobs=2, logit_bias={pieces[0]: 100.0}))
    entry = run.logprobs[0]
    assert entry.token_id == pieces[0] and entry.token == "\ufffd", entry
    assert entry.raw and emoji.encode().startswith(entry.raw), entry
    for alternative in entry.top:  # the model's own top two, whole tokens or pieces
        expected = alternative.token.encode() if alternative.token != "\ufffd" else alternative.raw
        assert expected and (alternative.raw or alternative.token.encode()) == expected, alternative


def test_context_length(engine: Any) -> None:
    max_seq_len = engine.max_seq_len
    unit = engine.encode(PROMPT, False)
    too_long = (unit * (max_seq_len // len(unit) + 1))[:max_seq_len]
    with pytest.raises(RequestRejected) as rejected:  # the worker's shared check, before the engine
        check_job(too_long, greedy(4), max_seq_len, engine.info().vocab_size)
    assert rejected.value.code == "context_length_exceeded"
    assert not engine.has_work()
    run = run_job(engine, too_long[:-5], greedy(100))
    assert run.final.finish_reason == "length" and len(run.token_ids) == 5


def test_info_reports_mode_and_devices(engine: Any, mode: str) -> None:
    info = engine.info()
    assert info.engine == ENGINE_MODES[mode][0] and info.max_seq_len == TINY_SETTINGS["max_seq_len"]
    assert info.paged == (mode != "exllamav2-unpaged")
    assert info.max_batch_size == (1 if mode == "exllamav2-unpaged" else TINY_SETTINGS["max_batch_size"])
    assert info.attention == ATTENTION.get(mode, info.attention) and info.attention != "sdpa"
    assert info.cache_size % 256 == 0 and info.cache_size >= info.max_seq_len
    assert len(info.devices) == torch.cuda.device_count()
    for device in info.devices:
        assert device.name and device.uuid.startswith("GPU-")
        assert 0 < device.memory_used_mib < device.memory_total_mib
    record(f"engine info {mode}", paged=info.paged, attention=info.attention, cache_size=info.cache_size,
           device=info.devices[0].name, version=info.engine_version)  # fmt: skip


@pytest.mark.parametrize("drafting", ["draft model", "ngram"])
def test_speculative_decoding_matches_plain_greedy(
    engine: Any, mode: str, tiny_model: Path, drafting: str
) -> None:
    # A draft model: the model drafting for itself, so drafts are accepted and the text is unchanged.
    # n-gram: a repetitive prompt gives the n-gram drafter something to propose.
    ids = engine.encode(PROMPT * (1 if drafting == "draft model" else 4), True)
    setting = {"draft_path": str(tiny_model)} if drafting == "draft model" else {"ngram_draft": True}
    drafting_engine = load_engine(mode, tiny_model, **setting, **TINY_SETTINGS)
    try:
        assert drafting_engine.info().draft == ("ngram" if drafting == "ngram" else tiny_model.name)
        run = run_job(drafting_engine, ids, greedy(48))
    finally:
        drafting_engine.close()
    plain = run_job(engine, ids, greedy(48, logprobs=2))
    same = assert_same_tokens(plain.token_ids, plain.logprobs, run.token_ids, drafting)
    usage = run.final.usage
    record(f"engine speculative {drafting} {mode}", identical_tokens=same,
           accepted=usage.accepted_draft_tokens, rejected=usage.rejected_draft_tokens)  # fmt: skip
    assert usage.completion_tokens == 48 == len(run.token_ids)
    if drafting == "draft model":
        assert usage.accepted_draft_tokens > 0


def test_prefill_chunking_and_cache_history_do_not_change_output(
    engine: Any, mode: str, tiny_model: Path
) -> None:
    """Causal prefill: a prompt read in small chunks, or after other jobs, gives the same tokens."""
    chunk = 16 if mode == "exllamav2-unpaged" else 256  # paged prefill works in whole 256-token pages
    ids = engine.encode(PROMPT * 50, True)[:700]
    reference = run_job(engine, ids, greedy(32, logprobs=2))
    small_chunks = load_engine(mode, tiny_model, **{**TINY_SETTINGS, "max_chunk_size": chunk})
    try:
        run_job(small_chunks, small_chunks.encode(WARMUP_PROMPT, True), greedy(32))
        chunked = run_job(small_chunks, ids, greedy(32)).token_ids
    finally:
        small_chunks.close()
    same = assert_same_tokens(reference.token_ids, reference.logprobs, chunked, f"chunks of {chunk}")
    record(f"engine chunking tiny {mode}", chunk=chunk, identical_tokens=same)


def test_big_model_throughput(big_engine: Any, mode: str) -> None:
    ids = big_engine.encode(PROMPT, True)
    runs = [run_job(big_engine, ids, greedy(128)) for _ in range(3)]
    tok_s = statistics.median(128 / r.seconds for r in runs)
    ttft = statistics.median(r.times[0] - r.submitted for r in runs)
    record(f"engine 8B single stream {mode}", tok_s=tok_s, ttft_ms=1000 * ttft)
    assert tok_s > 20, f"{tok_s:.1f} tok/s on an 8B FP16 model is far below the ~50-90 expected"
