"""Logprobs computed on the GPU, batched over one generator step, for the exllamav2/v3 engines.

Runs in the worker process, inside an engine, on the serve loop's thread. The generators' own
`return_probs`/`return_top_tokens` softmax and sort the whole vocabulary once per job and token
(exllamav2 on the CPU, exllamav3 one GPU sort per job), which at 64 jobs made each step several
times slower. Instead, `StepLogprobs` sees the step's logits while they are still on the GPU (the
engine routes the generator's forward pass through `capture`), computes one log-softmax and one
top-k over the rows of the jobs that asked for logprobs, and after the step gathers each sampled
token's logprob: one small copy to the GPU and one back per step, never a vocabulary-wide one, and
both after the step's own wait for its sampled tokens. Nothing in the middle of the step waits for
the GPU: a copy there (to or from it) would make the CPU wait for the forward pass before it
launches the sampler, and a step whose time is the CPU's launches loses that wait outright.

The values are the model's own distribution (log-softmax of its logits), before temperature,
penalties and filters: what OpenAI's API and vLLM report. Each job keeps a FIFO of entries, one
per sampled token, because a generator may hold tokens back (an unfinished character or a
possible stop string) and emit them in a later step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

# (sampled token's logprob, [(alternative id, its logprob), ...] best first)
Entry = tuple[float, list[tuple[int, float]]]
MIN_LOGPROB = -9999.0  # stands in for log(0), which JSON cannot carry


@dataclass
class _Captured:
    """One step's capture, all on the GPU until `record` reads what the sampled tokens need."""

    logprobs: Any  # (rows, positions, vocab) float tensor
    top_values: Any  # (rows, positions, k) float tensor; None when no job wants alternatives
    top_ids: Any  # (rows, positions, k) integer tensor; None likewise
    row_of: dict[Hashable, tuple[int, int]]  # job key -> (row in `logprobs`, its top-k)


@dataclass
class _JobEntries:
    top_k: int
    sampled: int  # tokens in the job's sequence (prompt included) when its entries were last queued
    queue: deque[Entry] = field(default_factory=deque)
    buffer: Any = None  # the sequence's id tensor that `view` shows
    view: Any = None

    def newest_ids(self, sequence: Any) -> list[int]:
        """The ids the sequence gained since the last call. Both libraries' `SeqTensor` keep a job's
        ids in `tensor` (1 x capacity, on the CPU), replaced by a larger one when it grows; a NumPy
        view of it is kept until then, since slicing it through torch costs about ten times as much
        (about 5 us a job, a quarter of a millisecond in each step of 64 jobs)."""
        length = len(sequence)
        if sequence.tensor is not self.buffer:
            self.buffer = sequence.tensor
            self.view = self.buffer.numpy()
        ids: list[int] = self.view[0, self.sampled : length].tolist()
        self.sampled = length
        return ids


class StepLogprobs:
    """Per-step logprob capture for the jobs of one engine, keyed by the engine's job key."""

    def __init__(self, vocab_size: int) -> None:
        # Ids at or past the tokenizer's size have no text and the samplers mask them; so do we.
        self.vocab_size = vocab_size
        self._jobs: dict[Hashable, _JobEntries] = {}
        self._captured: _Captured | None = None

    def add_job(self, key: Hashable, top_k: int, prompt_tokens: int) -> None:
        self._jobs[key] = _JobEntries(top_k, prompt_tokens)

    def drop_job(self, key: Hashable) -> None:
        self._jobs.pop(key, None)

    def wants(self, key: Hashable) -> bool:
        return key in self._jobs

    @property
    def active(self) -> bool:
        return bool(self._jobs)

    def attach(self, generator: Any, model: Any, forward_name: str) -> None:
        """Route the generator's decode forward pass through `capture`. Both exllamav2's and
        exllamav3's generators run exactly one forward of the model through `iterate_gen` per step,
        over the jobs whose prefill is done, one row per job in `active_jobs` order (prefill and
        draft models run elsewhere); the wrappers are instance attributes, so nothing else changes."""
        iterate_gen = generator.iterate_gen
        forward = getattr(model, forward_name)
        armed = False

        def iterate_gen_capturing(*args: Any, **kwargs: Any) -> Any:
            nonlocal armed
            armed = self.active
            try:
                return iterate_gen(*args, **kwargs)
            finally:
                armed = False

        def forward_capturing(*args: Any, **kwargs: Any) -> Any:
            nonlocal armed
            out = forward(*args, **kwargs)
            if armed:
                armed = False
                logits = out["logits"] if isinstance(out, dict) else out
                keys = [job.identifier for job in generator.active_jobs if job.is_prefill_done()
                        for _ in job.sequences]  # fmt: skip
                self.capture(logits, keys)
            return out

        generator.iterate_gen = iterate_gen_capturing
        setattr(model, forward_name, forward_capturing)

    def after_step(self, jobs: dict[Hashable, Any]) -> None:
        """Queue the entries of the tokens each generator job (by key) sampled in the step just run,
        read from the end of its sequence."""
        if self._captured is None:
            return
        sampled: dict[Hashable, list[int]] = {}
        for key, job in jobs.items():
            entries = self._jobs.get(key)
            if entries is None:
                continue
            sequence = job.sequences[0].sequence_ids
            if len(sequence) > entries.sampled:
                sampled[key] = entries.newest_ids(sequence)
        self.record(sampled)

    def capture(self, logits: Any, row_keys: list[Hashable]) -> None:
        """Called with a decode forward pass's logits (batch rows x positions x vocab, on the GPU)
        and the job key of each row; keeps log-softmax and top-k of the rows whose jobs want them.
        Only launches work on the GPU: nothing here waits for it."""
        import torch

        rows = [(i, key) for i, key in enumerate(row_keys) if key in self._jobs]
        if not rows:
            self._captured = None
            return
        if len(rows) < logits.shape[0]:
            index = torch.tensor([i for i, _ in rows])
            if logits.is_cuda:  # pinned, so that the copy is queued behind the forward pass, not waited for
                index = index.pin_memory()
            logits = logits.index_select(0, index.to(logits.device, non_blocking=True))
        logprobs = torch.log_softmax(logits[..., : self.vocab_size].float(), dim=-1)
        top_k = max(self._jobs[key].top_k for _, key in rows)
        top_values = top_ids = None
        if top_k:
            top_values, top_ids = torch.topk(logprobs, min(top_k, logprobs.shape[-1]), dim=-1)
        row_of = {key: (r, self._jobs[key].top_k) for r, (_, key) in enumerate(rows)}
        self._captured = _Captured(logprobs, top_values, top_ids, row_of)

    def record(self, sampled: dict[Hashable, list[int]]) -> None:
        """After the step: the tokens each job sampled in it, in order (position 0, 1, ... of its
        row; more than one when draft tokens were accepted). Queues one entry per token."""
        captured, self._captured = self._captured, None
        if captured is None:
            return
        picks = [(key, pos, token) for key, tokens in sampled.items() if key in captured.row_of
                 for pos, token in enumerate(tokens)]  # fmt: skip
        if not picks:
            return
        import torch

        logprobs = captured.logprobs
        _, positions, vocab = logprobs.shape
        flat = [(captured.row_of[key][0] * positions + pos) * vocab + min(token, self.vocab_size - 1)
                for key, pos, token in picks]  # fmt: skip
        parts = [logprobs.reshape(-1).index_select(0, torch.tensor(flat, device=logprobs.device))]
        if captured.top_values is not None:
            # Ids travel as float64 beside the values, exactly (a vocabulary is far below 2**53):
            # one copy back for the whole step.
            parts += [captured.top_values.reshape(-1), captured.top_ids.reshape(-1)]
        values = torch.cat([part.double() for part in parts]).cpu().tolist()
        chosen, tops = values[: len(picks)], values[len(picks) :]
        width = 0 if captured.top_values is None else captured.top_values.shape[-1]
        ids_at = len(tops) // 2
        for (key, pos, token), logprob in zip(picks, chosen, strict=True):
            row, top_k = captured.row_of[key]
            if token >= self.vocab_size:
                logprob = MIN_LOGPROB
            first = (row * positions + pos) * width
            alternatives = [(int(tops[ids_at + first + i]), max(tops[first + i], MIN_LOGPROB))
                            for i in range(min(top_k, width))]  # fmt: skip
            self._jobs[key].queue.append((max(logprob, MIN_LOGPROB), alternatives))

    def take(self, key: Hashable, count: int) -> list[Entry]:
        """The entries of a job's next `count` emitted tokens (fewer only if none were captured)."""
        job = self._jobs.get(key)
        if job is None:
            return []
        return [job.queue.popleft() for _ in range(min(count, len(job.queue)))]
