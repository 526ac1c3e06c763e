"""Checks every job passes before any engine sees it: one place, one set of codes and messages.

Runs in the worker process, called by the serve loop before `Engine.submit` (vLLM validates
requests once before the engine, in the same spirit). Optional parameters that not every engine
implements are refused here, by name, unless the engine's settings class lists them in
`supported_parameters`. What only one engine can judge (whether a job fits its paged cache, whether
its sampler supports logit_bias) stays in that engine.
"""

from __future__ import annotations

from collections.abc import Callable

from model_worker.engines.base import RequestRejected
from wire.params import SamplingParams
from wire.results import RejectCode

# Optional parameters by request field name, and whether a job uses each.
OPTIONAL_PARAMETERS: dict[str, Callable[[SamplingParams], bool]] = {
    "prompt_logprobs": lambda p: p.prompt_logprobs is not None,
    "include_stop_str_in_output": lambda p: p.include_stop_str_in_output,
    "banned_strings": lambda p: bool(p.banned_strings),
    "bad_words": lambda p: bool(p.bad_words),
    "allowed_token_ids": lambda p: bool(p.allowed_token_ids),
}


def check_job(
    prompt_ids: list[int],
    params: SamplingParams,
    max_seq_len: int,
    vocab_size: int,
    supported: frozenset[str] = frozenset(),
    engine: str = "this engine",
    prompt_field: str = "messages",
) -> None:
    """RequestRejected unless the job can run on a model with this context and vocabulary, on an
    engine that supports the optional parameters in `supported`. `prompt_field` is the request
    field a prompt too long is blamed on (`messages` for chat, `prompt` for completions)."""
    for name, used in OPTIONAL_PARAMETERS.items():
        if used(params) and name not in supported:
            raise RequestRejected(
                RejectCode.UNSUPPORTED_PARAMETER, f"{name} is not supported by the {engine} engine", name
            )
    count = len(prompt_ids)
    if count == 0:
        raise RequestRejected(RejectCode.INVALID_PROMPT, "The prompt is empty.", "prompt")
    if count >= max_seq_len:
        raise RequestRejected(
            RejectCode.CONTEXT_LENGTH_EXCEEDED,
            f"This model's maximum context length is {max_seq_len} tokens, however you requested "
            f"{count} prompt tokens. Please reduce the length of the messages or prompt.",
            prompt_field,
        )
    # An out-of-range id would index past the embedding table: on a GPU, a fault that kills the worker.
    if any(type(t) is not int or not 0 <= t < vocab_size for t in prompt_ids):
        raise RequestRejected(
            RejectCode.INVALID_PROMPT, f"Prompt token ids must be in [0, {vocab_size}).", "prompt"
        )
    for name, ids in (
        ("logit_bias", params.logit_bias),
        ("stop_token_ids", params.stop_token_ids),
        ("allowed_token_ids", params.allowed_token_ids),
    ):
        if any(not 0 <= t < vocab_size for t in ids):
            raise RequestRejected(RejectCode.INVALID_VALUE, f"{name} must be in [0, {vocab_size}).", name)
    if params.max_tokens < 0:
        # 0 generates nothing: the prompt's logprobs and token count (echo) are all the job returns.
        raise RequestRejected(RejectCode.INVALID_VALUE, "max_tokens must not be negative.", "max_tokens")


def completion_budget(prompt_tokens: int, params: SamplingParams, max_seq_len: int) -> int:
    """New tokens a job may make: what it asked for, cut to the context left after its prompt."""
    return min(params.max_tokens, max_seq_len - prompt_tokens)
