"""Checks every job passes before any engine sees it: one place, one set of codes and messages.

Runs in the worker process, called by the serve loop before `Engine.submit` (vLLM validates
requests once before the engine, in the same spirit). What only one engine can judge (whether a
job fits its paged cache, whether its sampler supports logit_bias) stays in that engine.
"""

from __future__ import annotations

from model_worker.engines.base import RequestRejected
from wire.params import SamplingParams
from wire.results import RejectCode


def check_job(prompt_ids: list[int], params: SamplingParams, max_seq_len: int, vocab_size: int) -> None:
    """RequestRejected unless the job can run on a model with this context and vocabulary."""
    count = len(prompt_ids)
    if count == 0:
        raise RequestRejected(RejectCode.INVALID_PROMPT, "The prompt is empty.", "prompt")
    if count >= max_seq_len:
        raise RequestRejected(
            RejectCode.CONTEXT_LENGTH_EXCEEDED,
            f"This model's maximum context length is {max_seq_len} tokens, however you requested "
            f"{count} prompt tokens. Please reduce the length of the messages or prompt.",
            "messages",
        )
    # An out-of-range id would index past the embedding table: on a GPU, a fault that kills the worker.
    if any(type(t) is not int or not 0 <= t < vocab_size for t in prompt_ids):
        raise RequestRejected(
            RejectCode.INVALID_PROMPT, f"Prompt token ids must be in [0, {vocab_size}).", "prompt"
        )
    if any(not 0 <= t < vocab_size for t in params.logit_bias):
        raise RequestRejected(
            RejectCode.INVALID_VALUE, f"logit_bias keys must be in [0, {vocab_size}).", "logit_bias"
        )
    if any(not 0 <= t < vocab_size for t in params.stop_token_ids):
        raise RequestRejected(
            RejectCode.INVALID_VALUE, f"stop_token_ids must be in [0, {vocab_size}).", "stop_token_ids"
        )
    if params.max_tokens < 1:
        raise RequestRejected(RejectCode.INVALID_VALUE, "max_tokens must be at least 1.", "max_tokens")


def completion_budget(prompt_tokens: int, params: SamplingParams, max_seq_len: int) -> int:
    """New tokens a job may make: what it asked for, cut to the context left after its prompt."""
    return min(params.max_tokens, max_seq_len - prompt_tokens)
