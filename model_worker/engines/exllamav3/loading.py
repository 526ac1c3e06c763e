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
    draft: bool = False,
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

    try:
        model.load(callback=on_module, **load_arguments(s, main_model=draft is False))
    except RuntimeError as exc:
        if "Insufficient VRAM" not in str(exc):
            raise
        raise RuntimeError(insufficient_vram_message(s, cache_size, str(exc))) from None
    return model, cache


def insufficient_vram_message(settings: ExLlamaV3Settings, cache_size: int, library_says: str) -> str:
    """exllamav3's out-of-memory on load, with the settings that decide it: the cache (its default
    is max_seq_len x max_batch_size tokens, easily larger than the weights) and the memory given."""
    where = (
        f"gpu_split {list(settings.gpu_split)} GB"
        if settings.gpu_split
        else f"this worker's GPUs less reserve_vram_gb {settings.reserve_vram_gb or 0.5} GB each"
    )
    cache_source = "cache_size" if settings.cache_size is not None else "max_seq_len x max_batch_size"
    return (
        f"{library_says}: the weights and a cache of {cache_size} tokens ({cache_source}) do not fit "
        f"{where}; lower engine_settings.cache_size or max_batch_size, or give the model more memory"
    )


def load_arguments(settings: ExLlamaV3Settings, main_model: bool = True) -> dict[str, Any]:
    """What `Model.load` is given besides the progress callback: the split and the scratch sizes.

    The split loaders report each module (the single-device one does not) and, on one GPU, place
    everything there; they size their scratch for our chunk and batch. A reserve of None keeps
    exllamav3's own default margin (0.5 GB per GPU). Tensor parallelism applies to the main model
    only: a draft model is small, and exllamav3 verifies against it from the main model's output device.
    """
    s = settings
    arguments: dict[str, Any] = {"max_chunk_size": s.max_chunk_size, "max_batch_size": s.max_batch_size}
    if s.gpu_split:
        arguments["use_per_device"] = list(s.gpu_split)
    else:
        arguments["reserve_per_device"] = s.reserve_vram_gb or None
    if s.tensor_parallel and main_model:
        arguments.update(tensor_p=True, tp_backend=s.tp_backend)
    return arguments
