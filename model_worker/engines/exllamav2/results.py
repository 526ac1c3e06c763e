"""exllamav2 helpers: config set-up, attention choice, and turning generator results into outputs.

Runs in a worker process (imported by the exllamav2 engine). Owns no state; exllamav2 is imported
inside the functions that need it, so this module imports on machines without CUDA.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model_worker.engines.token_texts import TokenTexts
from wire.results import FinishReason, TokenLogprob, Usage

logger = logging.getLogger(__name__)

_MIN_LOGPROB = -9999.0  # stands in for log(0), which JSON cannot carry


@dataclass
class PartialOutput:
    """One job's output merged over every result of one iterate() (draft decoding yields several)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


def make_config(path: str) -> Any:
    import exllamav2.attn

    config = exllamav2.ExLlamaV2Config(path)
    config.arch_compat_overrides()
    attn = exllamav2.attn
    flash = attn.has_flash_attn and not config.no_flash_attn
    if not flash and not (attn.has_xformers and not config.no_xformers) and not config.no_sdpa:
        # exllamav2 0.3.2's SDPA fallback passes no mask for plain causal prompts, so prefill chunks
        # attend to later tokens (outputs then depend on chunking and cache history). Its matmul
        # fallback builds the causal mask; decoding (one query per step) costs the same.
        logger.info("no flash-attn or xformers: using exllamav2's masked matmul attention, not SDPA")
        config.no_sdpa = True
    return config


def attention_kind(config: Any) -> str:
    import exllamav2.attn as attn

    if attn.has_flash_attn and not config.no_flash_attn:
        return "flash-attn"
    if attn.has_xformers and not config.no_xformers:
        return "xformers"
    return "matmul" if config.no_sdpa else "sdpa"


def add_tokens(
    part: PartialOutput, result: dict[str, Any], texts: TokenTexts, drop_last: bool = False
) -> None:
    ids = result["token_ids"][0].tolist() if "token_ids" in result else []
    count = len(ids) - 1 if drop_last and ids else len(ids)
    part.text += result.get("text", "")
    part.token_ids.extend(int(t) for t in ids[:count])
    if part.logprobs is not None and count:
        part.logprobs.extend(logprobs(result, ids[:count], texts))


def logprobs(result: dict[str, Any], ids: list[int], texts: TokenTexts) -> list[TokenLogprob]:
    """Entries from exllamav2's final sampling probabilities, computed on the GPU per step: the
    chosen token's probability and the top-k alternatives, never the full distribution."""
    count = len(ids)
    probs = result["token_probs"][0].tolist() if "token_probs" in result else [1.0] * count
    top_ids = result["top_k_tokens"][0].tolist() if "top_k_tokens" in result else [[]] * count
    top_probs = result["top_k_probs"][0].tolist() if "top_k_probs" in result else [[]] * count
    return [
        texts.entry(int(token), log(p), [(int(t), log(q)) for t, q in zip(alts, ps, strict=True)])
        for token, p, alts, ps in zip(ids, probs[:count], top_ids[:count], top_probs[:count], strict=True)
    ]


def log(p: float) -> float:
    return math.log(p) if p > 0.0 else _MIN_LOGPROB


def eos_token_ids(config: Any, tokenizer: Any) -> list[int]:
    """Every end-of-sequence id the model declares: tokenizer, config.json and generation_config.json."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    ids += [int(t) for t in (getattr(config, "generation_config", None) or {}).get("eos_token_id") or []]
    # exllamav2 keeps only the first of a list in config.json (Llama 3 lists several).
    try:
        declared = json.loads((Path(config.model_dir) / "config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        declared = None
    ids += [declared] if isinstance(declared, int) else [t for t in declared or [] if isinstance(t, int)]
    return list(dict.fromkeys(ids))
