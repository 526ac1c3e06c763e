"""Loading for the exllamav2 engine: config, attention choice, models and caches on this worker's GPUs.

Runs in a worker process (called by ExLlamaV2Engine.load). Owns no state; exllamav2 and torch are
imported inside the functions, so this module imports on machines without CUDA.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_worker.engines.base import ProgressCallback
from model_worker.engines.exllamav2 import rope
from model_worker.engines.exllamav2.settings import ExLlamaV2Settings

logger = logging.getLogger(__name__)

CACHE_CLASSES = {"FP16": "ExLlamaV2Cache", "Q4": "ExLlamaV2Cache_Q4", "Q6": "ExLlamaV2Cache_Q6",
                 "Q8": "ExLlamaV2Cache_Q8"}  # fmt: skip


def make_config(path: str) -> Any:
    import exllamav2
    import exllamav2.attn

    config = exllamav2.ExLlamaV2Config(path)
    rope.apply_rope_parameters(config)  # what transformers 5 nests, exllamav2 0.3.2 would miss
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


def can_page(config: Any) -> bool:
    """Paged attention (continuous batching) needs flash-attn >= 2.5.7 (exllamav2's own test)."""
    import exllamav2.attn

    return bool(exllamav2.attn.has_flash_attn_with_paged) and not config.no_flash_attn


@dataclass(frozen=True)
class Sizes:
    max_seq_len: int  # per job, draft tokens included
    cache_size: int  # tokens
    max_chunk_size: int
    batch: int  # jobs per step


def load_model(
    config: Any,
    settings: ExLlamaV2Settings,
    sizes: Sizes,
    progress: ProgressCallback,
    span: tuple[float, float],
) -> tuple[Any, Any]:
    """One model and its cache: one GPU, an explicit gpu_split, or autosplit over every visible GPU."""
    import exllamav2
    import torch

    s, cache_size = settings, sizes.cache_size
    config.max_seq_len = sizes.max_seq_len
    config.max_input_len = sizes.max_chunk_size
    config.max_attention_size = sizes.max_chunk_size**2
    # The generator checks max_batch_size * max_q_size (8) against these scratch dimensions.
    config.max_batch_size = max(1, math.ceil(sizes.batch * 8 / config.max_input_len))
    model = exllamav2.ExLlamaV2(config)
    cache_cls = getattr(exllamav2, CACHE_CLASSES[s.cache_mode])
    name, (p0, p1) = Path(config.model_dir).name, span

    def on_module(done: int, total: int) -> None:
        progress(f"loading {name}: module {done}/{total}", p0 + (p1 - p0) * done / max(total, 1))

    devices = torch.cuda.device_count()
    if s.gpu_split and devices > 1:
        for index, gb in enumerate(s.gpu_split[:devices]):
            total_gb = torch.cuda.get_device_properties(index).total_memory / 1024**3
            if gb + s.reserve_vram_gb > total_gb:
                raise RuntimeError(
                    f"gpu_split[{index}] = {gb} GB plus reserve_vram_gb {s.reserve_vram_gb} exceeds "
                    f"the {total_gb:.1f} GB of GPU {index}"
                )
        model.load(gpu_split=list(s.gpu_split), callback=on_module)
        return model, cache_cls(model, max_seq_len=cache_size)
    if devices > 1:
        # Lazy cache: autosplit places cache layers beside their attention layers as it fills GPUs.
        cache = cache_cls(model, max_seq_len=cache_size, lazy=True)
        reserve = int(s.reserve_vram_gb * 1024**3) if s.reserve_vram_gb else None
        model.load_autosplit(cache, reserve_vram=reserve, callback=on_module)
        return model, cache
    model.load(callback=on_module)
    return model, cache_cls(model, max_seq_len=cache_size)


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
