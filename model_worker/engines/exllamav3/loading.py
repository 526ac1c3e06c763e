"""Loading for the exllamav3 engine: a model folder and its paged cache on this worker's GPUs.

Runs in a worker process (called by ExLlamaV3Engine.load). Owns no state; exllamav3 is imported
inside the function, so this module imports on machines without CUDA.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model_worker.engines.base import ProgressCallback
from model_worker.engines.exllamav3.settings import ExLlamaV3Settings


def load_model(
    path: str,
    settings: ExLlamaV3Settings,
    cache_size: int,
    progress: ProgressCallback,
    span: tuple[float, float],
) -> tuple[Any, Any]:
    """One model (EXL3 or unquantized) and its cache of `cache_size` tokens, loaded over the
    visible GPUs (one, or a split: gpu_split GB each, else autosplit leaving reserve_vram_gb free).
    The cache must exist before the model loads: exllamav3 allocates it with the layers."""
    import exllamav3

    s = settings
    config = exllamav3.Config.from_directory(path)
    model = exllamav3.Model.from_config(config)
    bits = s.cache_bits()
    if bits is None:
        cache = exllamav3.Cache(model, max_num_tokens=cache_size)
    else:
        cache = exllamav3.Cache(
            model, max_num_tokens=cache_size, layer_type=exllamav3.CacheLayer_quant, k_bits=bits, v_bits=bits
        )
    name, (p0, p1) = Path(path).name, span

    def on_module(done: int, total: int) -> None:
        progress(f"loading {name}: module {done}/{total}", p0 + (p1 - p0) * done / max(total, 1))

    # The layer-split loader reports each module (the single-device one does not) and, on one GPU,
    # places everything there; it sizes its scratch for our chunk and batch.
    # reserve None keeps exllamav3's own default margin (0.5 GB per GPU).
    split: dict[str, Any] = (
        {"use_per_device": list(s.gpu_split)}
        if s.gpu_split
        else {"reserve_per_device": s.reserve_vram_gb or None}
    )
    model.load(callback=on_module, max_chunk_size=s.max_chunk_size, max_batch_size=s.max_batch_size, **split)
    return model, cache
