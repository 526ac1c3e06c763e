"""Prompt logprobs and the optional parameters on the exllamav2 engine, against plain references.

Runs in the pytest process on the GPU machine (marker gpu). Prompt logprobs come from the engine's
own scoring pass (chunked, with a temporary cache); the references are a straightforward forward
pass of the same exllamav2 model over the whole prompt, and transformers on the same fp16 weights.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.support import SKIP_REASON, TINY_SETTINGS, greedy, run_job

if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import torch  # noqa: E402

pytestmark = pytest.mark.gpu

TEXT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village, "


@pytest.fixture(params=["exllamav2-paged", "exllamav2-unpaged"])
def engine(request: pytest.FixtureRequest, engine_pool: Any, tiny_model: Path) -> Iterator[Any]:
    """The session's tiny exllamav2 engine in both modes (exllamav3 refuses these parameters)."""
    engine = engine_pool.get(request.param, tiny_model, TINY_SETTINGS)
    assert not engine.has_work()
    yield engine
    assert not engine.has_work()


def test_prompt_logprobs_match_one_forward_pass(engine: Any) -> None:
    ids = engine.encode(TEXT * 4, True)[:300]  # one piece: the reference forward has no cache
    entries = engine.prompt_logprobs(ids, 3)
    assert len(entries) == len(ids) and entries[0].logprob is None
    with torch.inference_mode():
        logits = engine.model.forward(torch.tensor([ids]), last_id_only=False)[0, :, : engine.vocab_size]
    reference = torch.log_softmax(logits.float(), dim=-1)
    for position in range(1, len(ids)):
        expected = float(reference[position - 1, ids[position]])
        assert math.isclose(entries[position].logprob, expected, abs_tol=1e-3), position
        top = torch.topk(reference[position - 1], 3)
        assert [t.token_id for t in entries[position].top][0] == int(top.indices[0])
        rank = int((reference[position - 1] > reference[position - 1, ids[position]]).sum()) + 1
        assert entries[position].rank == rank


def test_prompt_logprobs_over_several_chunks_match_transformers(engine: Any, tiny_model: Path) -> None:
    """A prompt longer than max_chunk_size (512) is scored in pieces through the cache; the result
    matches transformers' forward pass over the whole prompt on the same weights (fp16 tolerance)."""
    from transformers import AutoModelForCausalLM

    ids = engine.encode(TEXT * 40, True)[:1200]
    entries = engine.prompt_logprobs(ids, 0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float16).to("cuda").eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device="cuda")).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)
    got = torch.tensor([e.logprob for e in entries[1:]])
    expected = reference[torch.arange(len(ids) - 1), torch.tensor(ids[1:], device="cuda")].cpu()
    assert float((got - expected).abs().max()) < 5e-2
    assert float((got - expected).abs().mean()) < 5e-3
    del model
    torch.cuda.empty_cache()


def test_banned_strings_allowed_tokens_and_stop_string_kept(engine: Any) -> None:
    ids = engine.encode(TEXT, True)
    plain = run_job(engine, ids, greedy(48)).text
    word = next(w for w in plain.split() if len(w) >= 3)
    banned = run_job(engine, ids, greedy(48, banned_strings=[word])).text
    assert word.lower() not in banned.lower()
    allowed = sorted(set(engine.encode(" the a of and", False)))
    only = run_job(engine, ids, greedy(16, allowed_token_ids=allowed))
    assert set(only.token_ids) <= set(allowed)
    stop = plain[len(plain) // 2 : len(plain) // 2 + 3]
    kept = run_job(engine, ids, greedy(48, stop=[stop], include_stop_str_in_output=True, ignore_eos=False))
    assert kept.text == plain[: plain.index(stop)] + stop
