"""Optional request parameters on the exllamav2 engine, kept out of the engine's own module.

Runs in a worker process, inside the exllamav2 engine (imported by it; exllamav2 and torch are
handed in, never imported here). Owns how `banned_strings`, `allowed_token_ids` and
`include_stop_str_in_output` map onto exllamav2 0.3.2: the dynamic job's own `banned_strings`
(case-insensitive, with backtracking), a -inf token bias over every token not allowed, and the
triggering stop string that the generator reports on the result that ends a job.
"""

from __future__ import annotations

from typing import Any

from wire.params import SamplingParams


def job_arguments(params: SamplingParams) -> dict[str, Any]:
    """Extra ExLlamaV2DynamicJob arguments for this job."""
    return {"banned_strings": list(params.banned_strings)} if params.banned_strings else {}


def restrict_tokens(settings: Any, params: SamplingParams, padded_vocab: int, torch: Any) -> None:
    """allowed_token_ids as a bias: -inf for every other token, added to any logit_bias already set."""
    if not params.allowed_token_ids:
        return
    mask = torch.full((padded_vocab,), float("-inf"), dtype=torch.float)
    mask[torch.tensor(params.allowed_token_ids, dtype=torch.long)] = 0.0
    settings.token_bias = mask if settings.token_bias is None else settings.token_bias + mask


def stop_string_text(result: dict[str, Any], include: bool) -> str:
    """The stop string that ended the job, when the request asked to keep it in the output."""
    if include and result.get("eos_reason") == "stop_string":
        return str(result.get("eos_triggering_string") or "")
    return ""
