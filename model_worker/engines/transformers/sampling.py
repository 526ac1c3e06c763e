"""Per-job logits processing and token choice for the transformers engine.

Runs in a worker process, inside `TransformersEngine`. Owns one job's sampling state: its chain of
logits processors and its random generator. transformers' own processors and warpers are used
wherever they exist; the few small processors here cover what transformers lacks (OpenAI
frequency/presence penalties, a per-token logit bias). A job asking for JSON also carries a
`JsonConstraint` (model_worker.engines.structured_output) that masks every token the format does
not allow. Nothing here depends on other jobs, so a job's choices are the same alone or in a crowd.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from model_worker.engines.base import GREEDY_BELOW_TEMPERATURE
from model_worker.engines.structured_output import JsonConstraint
from wire.params import SamplingParams


class OpenAIPenaltyProcessor(LogitsProcessor):
    """OpenAI's frequency and presence penalties, over generated tokens only (not the prompt)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len = prompt_len
        self.frequency = frequency
        self.presence = presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        generated = input_ids[0, self.prompt_len :]
        if generated.numel() == 0:
            return scores
        counts = torch.bincount(generated, minlength=scores.shape[-1])[: scores.shape[-1]].to(scores.dtype)
        penalty = self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores - penalty.unsqueeze(0)


class LogitBiasProcessor(LogitsProcessor):
    """OpenAI's logit_bias: a fixed additive bias per token id."""

    def __init__(self, bias: dict[int, float], vocab_size: int, device: torch.device) -> None:
        self.bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        for token_id, value in bias.items():
            self.bias[token_id] = float(value)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        return scores + self.bias[: scores.shape[-1]].unsqueeze(0)


class AllowedTokensProcessor(LogitsProcessor):
    """vLLM's allowed_token_ids: every other token is masked out."""

    def __init__(self, allowed: list[int], vocab_size: int, device: torch.device) -> None:
        self.mask = torch.full((vocab_size,), float("-inf"), dtype=torch.float32, device=device)
        self.mask[torch.tensor(allowed, dtype=torch.long, device=device)] = 0.0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        return scores + self.mask[: scores.shape[-1]].unsqueeze(0)


class JobSampler:
    """Chooses one job's next token from the model's logits for the last position."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_len: int,
        vocab_size: int,
        end_ids: Iterable[int],
        device: torch.device,
        constraint: JsonConstraint | None = None,
        bad_words_ids: list[list[int]] | None = None,
    ) -> None:
        # A temperature this close to 0 overflows logits / temperature to inf; it means greedy anyway.
        self.greedy = params.temperature < GREEDY_BELOW_TEMPERATURE
        self.prompt_len = prompt_len
        self.constraint = constraint
        end = sorted(set(end_ids))
        processors = LogitsProcessorList()
        if params.allowed_token_ids:
            processors.append(AllowedTokensProcessor(params.allowed_token_ids, vocab_size, device))
        if bad_words_ids:
            processors.append(NoBadWordsLogitsProcessor(bad_words_ids, eos_token_id=end))
        if params.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty)))
        if params.frequency_penalty or params.presence_penalty:
            processors.append(
                OpenAIPenaltyProcessor(prompt_len, params.frequency_penalty, params.presence_penalty)
            )
        if params.logit_bias:
            processors.append(LogitBiasProcessor(params.logit_bias, vocab_size, device))
        if params.min_tokens > 0 and end:
            # Last, so that no bias can lift an end token back above -inf before min_tokens.
            processors.append(
                MinNewTokensLengthLogitsProcessor(prompt_len, params.min_tokens, end, device=str(device))
            )
        if not self.greedy:
            # transformers' own order: temperature, then the truncating warpers.
            processors.append(TemperatureLogitsWarper(float(params.temperature)))
            if params.top_k > 0:
                processors.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                processors.append(TopPLogitsWarper(float(params.top_p)))
            if params.min_p > 0.0:
                processors.append(MinPLogitsWarper(float(params.min_p)))
            if params.typical_p < 1.0:
                processors.append(TypicalLogitsWarper(float(params.typical_p)))
        self.processors = processors
        self.generator: torch.Generator | None = None
        if not self.greedy:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            self.generator = torch.Generator(device=device).manual_seed(seed)

    def choose(self, input_ids: torch.Tensor, logits: torch.Tensor) -> int:
        """input_ids: [1, prompt + generated so far]; logits: [1, vocab] float32 for the next token."""
        if self.constraint is not None:
            allowed = self.constraint.allowed(input_ids[0, self.prompt_len :].tolist())
            end = self.constraint.end_in(allowed)
            if end is not None:
                return end
            # Masked before every other processor, so that top-k/top-p choose among allowed tokens only.
            mask = torch.full_like(logits, float("-inf"))
            mask[:, torch.tensor(allowed, dtype=torch.long, device=logits.device)] = 0.0
            logits = logits + mask
        scores = self.processors(input_ids, logits) if self.processors else logits  # type: ignore[arg-type]
        if self.greedy:
            return int(torch.argmax(scores, dim=-1).item())
        probs = torch.softmax(scores, dim=-1)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
            # Extreme but valid parameters can leave no finite probability; one request's settings
            # must never crash the worker that serves everyone, so fall back to the best finite score.
            finite = torch.where(torch.isfinite(scores), scores, torch.full_like(scores, float("-inf")))
            best = finite if bool(torch.isfinite(finite).any()) else logits
            return int(torch.argmax(best, dim=-1).item())
        return int(torch.multinomial(probs, 1, generator=self.generator).item())
