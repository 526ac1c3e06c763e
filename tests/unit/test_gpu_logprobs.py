"""StepLogprobs, the batched logprobs of the GPU engines, driven on CPU tensors.

Runs in the pytest process. A scripted generator stands in for exllamav2's/exllamav3's: its step
runs one `iterate_gen` with one forward pass over the prefill-done jobs, then appends the sampled
tokens to each job's sequence, exactly the shape of the real generators that `attach` relies on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from model_worker.engines.gpu_logprobs import MIN_LOGPROB, StepLogprobs


class _Sequence:
    """As exllamav2's and exllamav3's `SeqTensor` hold a job's ids: in a (1, capacity) CPU tensor that a
    larger one replaces when it is full."""

    def __init__(self, ids: list[int], capacity: int = 2) -> None:
        self.tensor = torch.zeros((1, capacity), dtype=torch.long)
        self.length = 0
        self.extend(ids)

    def __len__(self) -> int:
        return self.length

    def extend(self, ids: list[int]) -> None:
        end = self.length + len(ids)
        if end > self.tensor.shape[1]:
            self.tensor = torch.cat((self.tensor, torch.zeros((1, end), dtype=torch.long)), dim=1)
        self.tensor[0, self.length : end] = torch.tensor(ids, dtype=torch.long)
        self.length = end


@dataclass
class _Seq:
    sequence_ids: _Sequence


@dataclass
class _Job:
    identifier: str
    prompt: list[int]
    prefilled: bool = True
    sequences: list[_Seq] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sequences = [_Seq(_Sequence(self.prompt))]

    def is_prefill_done(self) -> bool:
        return self.prefilled


class _Model:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits
        self.calls = 0

    def forward(self, input_ids: Any) -> torch.Tensor:
        self.calls += 1
        return self.logits


class _Generator:
    def __init__(self, model: _Model, jobs: list[_Job]) -> None:
        self.model, self.active_jobs = model, jobs

    def iterate_gen(self, samples: dict[str, list[int]]) -> None:
        self.model.forward(None)
        for job in self.active_jobs:
            if job.is_prefill_done():
                job.sequences[0].sequence_ids.extend(samples[job.identifier])

    def prefill(self) -> None:
        self.model.forward(None)  # outside iterate_gen: never captured


def test_entries_are_log_softmax_of_each_jobs_row_and_position() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 2, 10)  # three rows (jobs), two positions (one accepted draft token)
    logits[1, :, 9] = 50.0  # past the tokenizer's 9 ids: never reported, never an alternative
    jobs = [_Job("a", [1, 2]), _Job("waiting", [1], prefilled=False), _Job("b", [3]), _Job("plain", [4])]
    generator = _Generator(_Model(logits), jobs)
    logprobs = StepLogprobs(vocab_size=9)
    logprobs.attach(generator, generator.model, "forward")
    logprobs.add_job("a", top_k=2, prompt_tokens=2)
    logprobs.add_job("b", top_k=0, prompt_tokens=1)

    generator.prefill()  # a prefill forward is not a decode step
    generator.iterate_gen({"a": [5, 6], "b": [7], "plain": [1]})
    logprobs.after_step({job.identifier: job for job in jobs})

    # Rows are the prefill-done jobs in order: a -> 0, b -> 1, plain -> 2.
    reference = torch.log_softmax(logits[:, :, :9], dim=-1)
    a = logprobs.take("a", 5)
    assert len(a) == 2, "one entry per sampled token, however many were asked for"
    for position, (token, (logprob, top)) in enumerate(zip([5, 6], a, strict=True)):
        assert abs(logprob - float(reference[0, position, token])) < 1e-5
        values, ids = torch.topk(reference[0, position], 2)
        assert [t for t, _ in top] == ids.tolist()
        assert all(abs(v - float(w)) < 1e-5 for (_, v), w in zip(top, values, strict=True))
    [(logprob_b, top_b)] = logprobs.take("b", 1)
    assert abs(logprob_b - float(reference[1, 0, 7])) < 1e-5 and top_b == []
    assert logprobs.take("plain", 1) == [] and logprobs.take("a", 1) == []


def test_held_tokens_keep_their_entries_until_emitted_and_nothing_is_armed_without_jobs() -> None:
    logits = torch.zeros(1, 1, 4)
    model = _Model(logits)
    job = _Job("a", [0])
    generator = _Generator(model, [job])
    logprobs = StepLogprobs(vocab_size=4)
    logprobs.attach(generator, model, "forward")
    generator.iterate_gen({"a": [1]})
    logprobs.after_step({"a": job})
    assert logprobs.take("a", 1) == [], "a job added later has no entries for earlier steps"

    logprobs.add_job("a", top_k=1, prompt_tokens=len(job.sequences[0].sequence_ids))
    for token in (2, 3):  # two steps whose tokens the generator holds back, then emits together
        generator.iterate_gen({"a": [token]})
        logprobs.after_step({"a": job})
    entries = logprobs.take("a", 2)
    assert [round(lp, 4) for lp, _ in entries] == [round(float(torch.log(torch.tensor(0.25))), 4)] * 2
    logprobs.drop_job("a")
    assert not logprobs.active and logprobs.take("a", 1) == []
    assert MIN_LOGPROB < -1000


def test_a_job_asking_more_alternatives_than_the_vocabulary_gets_each_id_once() -> None:
    logits = torch.tensor([[[0.0, 3.0, 1.0, 2.0]], [[5.0, 0.0, 0.0, 0.0]]])
    jobs = [_Job("wide", [0]), _Job("narrow", [0])]
    generator = _Generator(_Model(logits), jobs)
    logprobs = StepLogprobs(vocab_size=4)
    logprobs.attach(generator, generator.model, "forward")
    logprobs.add_job("wide", top_k=20, prompt_tokens=1)
    logprobs.add_job("narrow", top_k=1, prompt_tokens=1)
    generator.iterate_gen({"wide": [1], "narrow": [0]})
    logprobs.after_step({job.identifier: job for job in jobs})

    [(_, wide_top)] = logprobs.take("wide", 1)
    assert [token for token, _ in wide_top] == [1, 3, 2, 0], "each id once, best first; no other job's row"
    [(narrow_logprob, narrow_top)] = logprobs.take("narrow", 1)
    assert [token for token, _ in narrow_top] == [0]
    assert abs(narrow_logprob - float(torch.log_softmax(logits[1, 0], dim=-1)[0])) < 1e-6


def test_each_step_reads_the_tokens_just_sampled_after_the_sequence_grows() -> None:
    logits = torch.log(torch.tensor([[[0.1, 0.2, 0.3, 0.4]]]))
    job = _Job("a", [0])  # a capacity of 2: the ids move to a larger tensor on the second step
    generator = _Generator(_Model(logits), [job])
    logprobs = StepLogprobs(vocab_size=4)
    logprobs.attach(generator, generator.model, "forward")
    logprobs.add_job("a", top_k=0, prompt_tokens=1)
    for token in (3, 1, 2, 0):
        generator.iterate_gen({"a": [token]})
        logprobs.after_step({"a": job})
    entries = logprobs.take("a", 4)
    assert [round(lp, 5) for lp, _ in entries] == [round(float(logits[0, 0, t]), 5) for t in (3, 1, 2, 0)]
