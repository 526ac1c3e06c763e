"""Continuous batching on a paged cache, engine level: exllamav2 paged (flash-attn) and exllamav3.

Runs in the pytest process on the GPU machine, once per batching mode. What batching must not
change: each job's tokens (the same as alone, up to fp16 near-ties) and logprobs, stop strings,
drafting; what paging must give: queued jobs when the pages run out, every page back after a
cancel storm, and a reused prompt prefix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.gpu.support import SKIP_REASON, assert_same_tokens, greedy, record, run_job, run_jobs

if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from tests.gpu.conftest import load_engine  # noqa: E402
from tests.gpu.support import PAGED_MODES, TINY_SETTINGS  # noqa: E402

pytestmark = pytest.mark.gpu

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village,"


def prompts(engine: Any, count: int) -> dict[str, list[int]]:
    """Prompts of different lengths (so jobs sit at different cache positions) and contents."""
    return {f"job{i}": engine.encode(f"Story {i}: " + PROMPT * (1 + i % 3), True) for i in range(count)}


def test_concurrent_greedy_streams_match_solo_runs(paged_engine: Any, mode: str) -> None:
    """Eight streams of 300 tokens (each crossing cache pages), all in one batch, give each
    stream's solo tokens; their logprobs are their own, not a neighbour's."""
    jobs = prompts(paged_engine, 8)
    solo = {rid: run_job(paged_engine, ids, greedy(300, logprobs=2)) for rid, ids in jobs.items()}
    runs = run_jobs(paged_engine, {rid: (ids, greedy(300, logprobs=2)) for rid, ids in jobs.items()})
    matched = []
    for rid, run in runs.items():
        same = assert_same_tokens(solo[rid].token_ids, solo[rid].logprobs, run.token_ids, rid)
        matched.append(same)
        assert len(run.logprobs) == len(run.token_ids) == 300
        for alone, batched in zip(solo[rid].logprobs[:same], run.logprobs[:same], strict=True):
            assert batched.token_id == alone.token_id and abs(batched.logprob - alone.logprob) < 0.05
    record(f"batch 8x300 equals solo {mode}", identical_tokens=matched)


def test_logprobs_of_some_jobs_in_a_batch_are_their_own(paged_engine: Any) -> None:
    """Jobs asking for 3 alternatives, for 1, and for no logprobs, in one batch: the rows of those
    that ask are picked out of each step's logits, so each gets its solo run's entries (as many
    alternatives as it asked for) and the others none."""
    jobs = prompts(paged_engine, 6)
    asks = {rid: (3, 1, None)[i % 3] for i, rid in enumerate(jobs)}
    solo = {rid: run_job(paged_engine, ids, greedy(64, logprobs=3)) for rid, ids in jobs.items()}
    runs = run_jobs(paged_engine, {rid: (ids, greedy(64, logprobs=asks[rid])) for rid, ids in jobs.items()})
    for rid, run in runs.items():
        assert len(run.token_ids) == 64, rid
        if asks[rid] is None:
            assert run.logprobs == [], rid
            continue
        same = assert_same_tokens(solo[rid].token_ids, solo[rid].logprobs, run.token_ids, rid)
        assert len(run.logprobs) == 64, rid
        for alone, batched in zip(solo[rid].logprobs[:same], run.logprobs[:same], strict=True):
            assert batched.token_id == alone.token_id and abs(batched.logprob - alone.logprob) < 0.05
            assert len(batched.top) == asks[rid]
            assert abs(batched.top[0].logprob - alone.top[0].logprob) < 0.05


@pytest.mark.parametrize("mode", PAGED_MODES)
def test_more_jobs_than_cache_pages_wait_their_turn(mode: str, tiny_model: Path) -> None:
    """A cache of 2048 tokens (8 pages) holds two of these jobs at a time: each asks for as many
    tokens as fill three pages with its prompt (767 in all: exllamav3 reserves one token more than
    the job's length). The other six wait in the generator's queue, and all eight finish."""
    small = load_engine(
        mode, tiny_model, max_seq_len=1024, max_batch_size=8, max_chunk_size=256, cache_size=2048
    )
    try:
        jobs = prompts(small, 8)
        for rid, ids in jobs.items():
            small.submit(rid, ids, greedy(767 - len(ids)))
        most_active, most_queued, finished = 0, 0, set()
        while small.has_work():
            stats = small.stats()
            most_active, most_queued = (
                max(most_active, stats.active_jobs),
                max(most_queued, stats.queued_jobs),
            )
            finished |= {o.rid for o in small.step() if o.finish_reason is not None}
        stats = small.stats()
    finally:
        small.close()
    record(f"batch cache-bound {mode}", most_active=most_active, most_queued=most_queued)
    assert finished == set(jobs)
    assert most_active == 2 and most_queued == 8, (most_active, most_queued)
    assert stats.cache_pages_free == stats.cache_pages_total == 8


def test_cancel_storm_returns_every_page(paged_engine: Any, mode: str) -> None:
    jobs = prompts(paged_engine, 16)  # twice max_batch_size: half run, half wait
    for rid, ids in jobs.items():
        paged_engine.submit(rid, ids, greedy(1500))
    for _ in range(20):
        paged_engine.step()
    busy = paged_engine.stats()
    assert busy.active_jobs == TINY_SETTINGS["max_batch_size"] and busy.queued_jobs == 8
    assert busy.cache_pages_free < busy.cache_pages_total
    for rid in jobs:
        assert paged_engine.cancel(rid)
    idle = paged_engine.stats()
    record(f"batch cancel storm {mode}", pages_used_before=busy.cache_pages_total - busy.cache_pages_free,
           pages_free_after=idle.cache_pages_free, pages_total=idle.cache_pages_total)  # fmt: skip
    assert not paged_engine.has_work() and idle.active_jobs == idle.queued_jobs == 0
    assert idle.cache_pages_free == idle.cache_pages_total


def test_stop_strings_inside_a_batch(paged_engine: Any) -> None:
    jobs = prompts(paged_engine, 6)
    bases = {rid: run_job(paged_engine, ids, greedy(64)).text for rid, ids in jobs.items()}
    stops = {}
    for rid, text in bases.items():
        needle = text[len(text) // 2 : len(text) // 2 + 3]
        assert needle.strip(), f"no usable stop string in {text!r}"
        stops[rid] = needle
    runs = run_jobs(paged_engine, {rid: (ids, greedy(64, stop=[stops[rid]])) for rid, ids in jobs.items()})
    for rid, run in runs.items():
        assert run.final.finish_reason == "stop", rid
        assert run.text == bases[rid][: bases[rid].index(stops[rid])], rid


def test_ngram_speculation_inside_a_batch(paged_engine: Any, mode: str, tiny_model: Path) -> None:
    jobs = {
        rid: paged_engine.encode(f"Story {i}: " + PROMPT * 4, True)
        for i, rid in enumerate(["a", "b", "c", "d"])
    }
    plain = {rid: run_job(paged_engine, ids, greedy(64, logprobs=2)) for rid, ids in jobs.items()}
    drafting = load_engine(mode, tiny_model, ngram_draft=True, **TINY_SETTINGS)
    try:
        runs = run_jobs(drafting, {rid: (ids, greedy(64)) for rid, ids in jobs.items()})
    finally:
        drafting.close()
    accepted = {}
    for rid, run in runs.items():
        assert_same_tokens(plain[rid].token_ids, plain[rid].logprobs, run.token_ids, rid)
        assert run.final.usage.completion_tokens == 64
        accepted[rid] = run.final.usage.accepted_draft_tokens
    record(f"batch ngram 4 jobs {mode}", accepted=list(accepted.values()))


def test_repeated_long_prompt_reuses_its_cached_prefix(big_engine: Any, mode: str) -> None:
    """The second time a 3000-token prompt comes, its full pages are in the cache already: only the
    last page is computed, so the first token comes far sooner."""
    ids = big_engine.encode("A long shared system prompt about many things. " * 400, True)[:3000]
    counted_before = big_engine.cached_prompt_tokens()
    first = run_job(big_engine, ids, greedy(4))
    second = run_job(big_engine, ids, greedy(4))
    ttft = [run.times[0] - run.submitted for run in (first, second)]
    cached = second.final.usage.cached_tokens
    record(f"prefix reuse 8B {mode}", ttft_first_ms=1000 * ttft[0], ttft_second_ms=1000 * ttft[1],
           cached_first=first.final.usage.cached_tokens, cached_second=cached)  # fmt: skip
    assert first.final.usage.cached_tokens < 256
    assert cached >= 2816, f"only {cached} of 3000 prompt tokens came from the cache"
    assert ttft[1] < 0.5 * ttft[0], ttft
    # What the step trace reads: the same tokens, counted once per job when its first token came.
    counted = big_engine.cached_prompt_tokens() - counted_before
    assert counted == first.final.usage.cached_tokens + cached, counted
