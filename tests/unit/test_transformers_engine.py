"""Unit tests for the transformers engine, run against a real random-weight demo model on CPU, and for
the job checks every engine shares (model_worker.engines.validation)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from model_worker.engines.base import RequestRejected
from model_worker.engines.registry import create_engine
from model_worker.engines.transformers.engine import TransformersEngine
from model_worker.engines.validation import check_job
from wire.params import SamplingParams
from wire.results import FinishReason, JobOutput, RejectCode

PROMPT = "The river carries stones downhill and"
MAX_SEQ_LEN = 256


def _load(model_dir: Path, **settings: int) -> TransformersEngine:
    engine: TransformersEngine = create_engine(
        "transformers", str(model_dir), MAX_SEQ_LEN, {"threads": 2, **settings}
    )
    engine.load(lambda detail, progress: None)
    return engine


@pytest.fixture(scope="module")
def engine(demo_model_dir: Path) -> Iterator[TransformersEngine]:
    engine = _load(demo_model_dir, max_batch_size=8, max_chunk_size=16)
    yield engine
    engine.close()


@dataclass
class Result:
    outputs: list[JobOutput] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outputs)

    @property
    def token_ids(self) -> list[int]:
        return [t for o in self.outputs for t in o.token_ids]

    @property
    def last(self) -> JobOutput:
        return self.outputs[-1]


def _drain(engine: TransformersEngine) -> dict[str, Result]:
    results: dict[str, Result] = {}
    while engine.has_work():
        for output in engine.step():
            results.setdefault(output.rid, Result()).outputs.append(output)
    return results


def _run(engine: TransformersEngine, params: SamplingParams, prompt: str = PROMPT) -> Result:
    engine.submit("solo", engine.encode(prompt, add_special_tokens=True), params)
    return _drain(engine)["solo"]


def _eos_id(engine: TransformersEngine) -> int:
    return int(engine._tokenizer.eos_token_id)


def test_greedy_is_deterministic_and_varied(engine: TransformersEngine) -> None:
    first = _run(engine, SamplingParams(max_tokens=24, temperature=0.0))
    second = _run(engine, SamplingParams(max_tokens=24, temperature=0.0))
    assert first.token_ids == second.token_ids
    assert first.text == second.text
    assert len(set(first.token_ids)) > 5  # random weights, but not one token on repeat


def test_job_alone_equals_job_among_others(engine: TransformersEngine) -> None:
    target = SamplingParams(max_tokens=20, temperature=0.0, logprobs=2)
    alone = _run(engine, target)

    others = [
        ("Cooking begins long before the stove is lit, at the market where", SamplingParams(max_tokens=25)),
        ("A", SamplingParams(max_tokens=5, temperature=0.0)),
        (PROMPT, SamplingParams(max_tokens=30, temperature=0.9, seed=4, top_p=0.8)),
        ("Birds read the seasons " * 6, SamplingParams(max_tokens=12, repetition_penalty=1.3)),
    ]
    for i, (prompt, params) in enumerate(others):
        engine.submit(f"other-{i}", engine.encode(prompt, add_special_tokens=True), params)
    engine.submit("target", engine.encode(PROMPT, add_special_tokens=True), target)
    results: dict[str, Result] = {}
    for _ in range(3):
        for output in engine.step():
            results.setdefault(output.rid, Result()).outputs.append(output)
    # A late arrival with a long prompt: its prefill chunks interleave with the target's decoding.
    engine.submit(
        "late",
        engine.encode("Rivers carve the land with patience. " * 5, True),
        SamplingParams(max_tokens=30),
    )
    for rid, result in _drain(engine).items():
        results.setdefault(rid, Result()).outputs.extend(result.outputs)

    crowd = results["target"]
    assert crowd.token_ids == alone.token_ids
    assert crowd.text == alone.text
    assert [o.logprobs for o in crowd.outputs] == [o.logprobs for o in alone.outputs]
    assert len(results) == 6


def test_seed_reproducible_and_different_seeds_differ(engine: TransformersEngine) -> None:
    def sample(seed: int) -> Result:
        return _run(engine, SamplingParams(max_tokens=20, temperature=1.0, top_k=50, seed=seed))

    a, b, c = sample(7), sample(7), sample(8)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.token_ids != c.token_ids


def test_max_tokens_gives_length_with_exact_count(engine: TransformersEngine) -> None:
    result = _run(engine, SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
    assert result.last.finish_reason is FinishReason.LENGTH
    assert all(o.finish_reason is None and o.usage is None for o in result.outputs[:-1])
    assert len(result.token_ids) == 7
    assert result.last.usage is not None and result.last.usage.completion_tokens == 7


def test_max_tokens_clamped_to_context(engine: TransformersEngine) -> None:
    prompt_ids = engine.encode("word " * 200, add_special_tokens=True)
    prompt_ids = prompt_ids[: MAX_SEQ_LEN - 3]
    engine.submit("near-full", prompt_ids, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    result = _drain(engine)["near-full"]
    assert result.last.finish_reason is FinishReason.LENGTH
    assert len(result.token_ids) == 3


def test_stop_string_cuts_text(engine: TransformersEngine) -> None:
    free = _run(engine, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    stop = free.text[12:15]
    assert len(stop) == 3
    cut = free.text.find(stop)
    stopped = _run(engine, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop]))
    assert stopped.last.finish_reason is FinishReason.STOP
    assert stopped.text == free.text[:cut]
    assert stop not in stopped.text
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    assert stopped.last.usage is not None
    assert stopped.last.usage.completion_tokens == len(stopped.token_ids) < 30


def _assert_idle(engine: TransformersEngine) -> None:
    stats = engine.stats()
    assert stats.active_jobs == 0 and stats.queued_jobs == 0
    assert not engine.has_work()


def test_cancel_in_prefill_and_decode(engine: TransformersEngine) -> None:
    long_prompt = engine.encode("Travel changes the shape of time. " * 8, add_special_tokens=True)
    assert len(long_prompt) > 3 * 16  # several prefill chunks of 16
    engine.submit("prefilling", long_prompt, SamplingParams(max_tokens=10))
    assert engine.step() == []  # first chunk only: nothing to emit yet
    assert engine.stats().active_jobs == 1
    assert engine.cancel("prefilling") is True
    _assert_idle(engine)

    engine.submit("decoding", engine.encode(PROMPT, True), SamplingParams(max_tokens=50, ignore_eos=True))
    while not engine.step():
        pass
    engine.step()
    assert engine.cancel("decoding") is True
    _assert_idle(engine)
    assert engine.cancel("decoding") is False
    assert engine.cancel("never-submitted") is False
    assert engine.step() == []


def test_prefill_chunks_count_as_steps(engine: TransformersEngine) -> None:
    """The gateway's wedge watchdog judges a worker by stats().steps: a prefill chunk that outputs
    nothing (no Step frame leaves the worker) is a step all the same."""
    prompt = engine.encode("Travel changes the shape of time. " * 8, add_special_tokens=True)
    chunks = -(-len(prompt) // 16)
    assert chunks >= 4
    before = engine.stats().steps
    engine.submit("long", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    silent_steps = 0
    while not engine.step():
        silent_steps += 1
        assert engine.stats().steps == before + silent_steps
    assert silent_steps == chunks - 1  # the last chunk's logits give the first token
    assert engine.stats().steps == before + chunks
    _assert_idle(engine)


def test_queue_beyond_batch_size_and_cancel_queued(demo_model_dir: Path) -> None:
    small = _load(demo_model_dir, max_batch_size=2, max_chunk_size=64)
    try:
        ids = small.encode(PROMPT, add_special_tokens=True)
        for rid in ("a", "b", "c", "d"):
            small.submit(rid, ids, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        assert small.stats().active_jobs == 2 and small.stats().queued_jobs == 2
        assert small.cancel("c") is True
        assert small.stats().queued_jobs == 1
        results = _drain(small)
        assert sorted(results) == ["a", "b", "d"]
        assert results["a"].token_ids == results["b"].token_ids == results["d"].token_ids
        # FIFO: d waited in the queue for a batch slot, so it finished last.
        assert results["d"].last.usage is not None and results["d"].last.usage.queue_s > 0
        stats = small.stats()
        assert stats.generated_tokens == 9 and stats.steps == 6
        _assert_idle(small)
    finally:
        small.close()


def test_shared_job_checks() -> None:
    vocab = 1000
    with pytest.raises(RequestRejected) as too_long:
        check_job([5] * MAX_SEQ_LEN, SamplingParams(), MAX_SEQ_LEN, vocab)
    assert too_long.value.code is RejectCode.CONTEXT_LENGTH_EXCEEDED
    assert too_long.value.param == "messages"
    assert f"maximum context length is {MAX_SEQ_LEN} tokens" in too_long.value.message
    assert f"{MAX_SEQ_LEN} prompt tokens" in too_long.value.message
    with pytest.raises(RequestRejected) as too_long_text:  # a completion's prompt is its `prompt`
        check_job([5] * MAX_SEQ_LEN, SamplingParams(), MAX_SEQ_LEN, vocab, prompt_field="prompt")
    assert too_long_text.value.param == "prompt"

    for bad in ([], [1, 2, 10**6], [-1]):
        with pytest.raises(RequestRejected) as invalid:
            check_job(bad, SamplingParams(), MAX_SEQ_LEN, vocab)
        assert invalid.value.code is RejectCode.INVALID_PROMPT
    for params, name in ((SamplingParams(logit_bias={vocab: 1.0}), "logit_bias"),
                         (SamplingParams(stop_token_ids=[vocab]), "stop_token_ids"),
                         (SamplingParams(max_tokens=-1), "max_tokens")):  # fmt: skip
        with pytest.raises(RequestRejected) as rejected:
            check_job([1, 2], params, MAX_SEQ_LEN, vocab)
        assert rejected.value.code is RejectCode.INVALID_VALUE and rejected.value.param == name
    check_job([1, vocab - 1], SamplingParams(logit_bias={0: 1.0}), MAX_SEQ_LEN, vocab)
    check_job([1, 2], SamplingParams(max_tokens=0), MAX_SEQ_LEN, vocab)  # echo only: nothing generated


def test_logprobs_shape(engine: TransformersEngine) -> None:
    result = _run(engine, SamplingParams(max_tokens=5, temperature=0.0, logprobs=3))
    for output in result.outputs:
        assert output.logprobs is not None and len(output.logprobs) == len(output.token_ids) == 1
        entry = output.logprobs[0]
        assert entry.token_id == output.token_ids[0] and entry.token == engine.decode([entry.token_id])
        assert entry.logprob <= 0.0
        assert len(entry.top) == 3
        assert [t.logprob for t in entry.top] == sorted((t.logprob for t in entry.top), reverse=True)
        assert all(t.token == engine.decode([t.token_id]) for t in entry.top)
        # Greedy without processors picks the top alternative.
        assert (entry.top[0].token_id, entry.top[0].logprob) == (entry.token_id, entry.logprob)

    only_chosen = _run(engine, SamplingParams(max_tokens=2, temperature=0.0, logprobs=0))
    assert all(o.logprobs is not None and o.logprobs[0].top == [] for o in only_chosen.outputs)
    assert all(o.logprobs is None for o in _run(engine, SamplingParams(max_tokens=2)).outputs)


def test_min_tokens_ignore_eos_and_eos_text(engine: TransformersEngine) -> None:
    eos = _eos_id(engine)
    push_eos = {eos: 100.0}

    at_once = _run(engine, SamplingParams(max_tokens=10, temperature=0.0, logit_bias=push_eos))
    assert at_once.token_ids == [eos] and at_once.text == ""
    assert at_once.last.finish_reason is FinishReason.STOP

    ignored = _run(
        engine, SamplingParams(max_tokens=6, temperature=0.0, logit_bias=push_eos, ignore_eos=True)
    )
    assert ignored.token_ids == [eos] * 6 and ignored.text == ""
    assert ignored.last.finish_reason is FinishReason.LENGTH

    held = _run(
        engine, SamplingParams(max_tokens=20, temperature=0.8, seed=1, logit_bias=push_eos, min_tokens=5)
    )
    assert eos not in held.token_ids[:5]
    assert held.token_ids[5] == eos and len(held.token_ids) == 6
    assert held.last.finish_reason is FinishReason.STOP
    assert held.last.usage is not None and held.last.usage.completion_tokens == 6

    stop_token = _run(engine, SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[eos + 1],
                                             logit_bias={eos + 1: 100.0}, ignore_eos=True))  # fmt: skip
    assert stop_token.token_ids == [eos + 1] and stop_token.last.finish_reason is FinishReason.STOP


def test_usage_matches_tokenizer(engine: TransformersEngine, demo_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    prompt = "Soup is forgiving and generous. Start with something fragrant in a little fat"
    expected = len(tokenizer.encode(prompt))
    prompt_ids = engine.encode(prompt, add_special_tokens=True)
    assert len(prompt_ids) == expected
    engine.submit("usage", prompt_ids, SamplingParams(max_tokens=4, ignore_eos=True))
    result = _drain(engine)["usage"]
    usage = result.last.usage
    assert usage is not None
    assert usage.prompt_tokens == expected
    assert usage.completion_tokens == len(result.token_ids) == 4
    assert usage.cached_tokens == 0
    assert min(usage.queue_s, usage.prefill_s, usage.decode_s) >= 0


def test_info_and_medium_model(demo_model_dir_medium: Path) -> None:
    medium = _load(demo_model_dir_medium, max_batch_size=4)
    try:
        info = medium.info()
        assert info.engine == "transformers" and info.paged is False
        assert info.dtype == "float32"  # the preset's dtype; no float16 fallback needed
        if torch.cuda.is_available():
            assert info.devices[0].name == torch.cuda.get_device_name(0)
        else:
            assert info.devices == []
        assert info.max_seq_len == MAX_SEQ_LEN and info.max_batch_size == 4
        assert info.vocab_size > 0 and info.engine_version
        result = _run(medium, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert len(result.token_ids) == 8
    finally:
        medium.close()
