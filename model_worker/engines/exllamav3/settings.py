"""Settings of the exllamav3 engine (the `engine_settings` of an `engine: exllamav3` model).

Imported by the worker and by `model_worker.settings_check` at config time; imports neither torch
nor exllamav3. The fields and checks both exllama engines share are in
`model_worker.engines.exllama_settings`; what exllamav3 1.6.5 would refuse or quietly bend is
refused there or here, naming the field:
- its cache is 256-token pages (`max_num_tokens must be a multiple of 256`);
- a prefill chunk ends on a page boundary, so a chunk below 256 tokens never advances and others
  are cut to whole pages: max_chunk_size is a multiple of 256;
- a job reserves its prompt, its whole completion, one more token and the draft window in the
  cache, and exllamav3 shortens the completion of a job that does not fit instead of refusing it:
  the cache holds at least one max_seq_len job;
- quantized K/V take 2 to 8 bits.
Keys of the exllamav2 engine that exllamav3 has no counterpart for are refused with the reason.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, model_validator

from model_worker.engines.base import settings_error
from model_worker.engines.exllama_settings import PagedCacheSettings

NGRAM_MATCH_MIN = 3  # n-gram drafting proposes a continuation after a match of at least this many tokens
CACHE_BITS = {"Q8": 8, "Q6": 6, "Q5": 5, "Q4": 4, "Q3": 3, "Q2": 2}

_EXLLAMAV2_ONLY = {
    "paged": "exllamav3 always batches through its own paged attention (no flash-attn needed); remove it",
}


class ExLlamaV3Settings(PagedCacheSettings):
    engine_name: ClassVar[str] = "exllamav3"
    tokens_reserved_past_context: ClassVar[int] = 1

    cache_mode: Literal["FP16", "Q8", "Q6", "Q5", "Q4", "Q3", "Q2"] = Field(
        "FP16", description="KV cache precision: FP16, or keys and values quantized to 8 ... 2 bits."
    )
    tensor_parallel: bool = Field(
        False,
        description="Split every layer over all of the replica's GPUs (exllamav3's tensor parallelism, "
        "one helper process per GPU inside the worker) instead of placing whole layers on each GPU in "
        "turn (the layer split, the default when a replica has several GPUs). Needs at least two GPUs "
        "per replica and an architecture exllamav3 can run tensor-parallel.",
    )
    tp_backend: Literal["native", "nccl"] = Field(
        "native",
        description="How the tensor-parallel GPUs exchange activations: exllamav3's own shared-memory "
        "transport (native), or NCCL. Only with tensor_parallel.",
    )

    @model_validator(mode="before")
    @classmethod
    def _exllamav2_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, reason in _EXLLAMAV2_ONLY.items():
                if key in data:
                    raise settings_error(cls, key, f"{key} is an exllamav2 setting: {reason}", data[key])
        return data

    @model_validator(mode="after")
    def _what_exllamav3_accepts(self, info: ValidationInfo) -> ExLlamaV3Settings:
        # Judged by value, not by whether it was written: a worker validates the registry's dump
        # again, where every default counts as written.
        if self.tp_backend != "native" and not self.tensor_parallel:
            message = "tp_backend applies only with tensor_parallel: true"
            raise settings_error(type(self), "tp_backend", message, self.tp_backend)
        gpu_counts: list[int] = (info.context or {}).get("gpu_counts") or []
        if self.tensor_parallel and any(count < 2 for count in gpu_counts):
            message = (
                f"tensor_parallel needs at least two GPUs per replica (gpus gives {min(gpu_counts)}); "
                "list two or more in the model's gpus, or remove tensor_parallel"
            )
            raise settings_error(type(self), "tensor_parallel", message, self.tensor_parallel)
        self.check_pages(info)
        return self

    def cache_bits(self) -> int | None:
        """Bits per K/V element, or None for FP16."""
        return CACHE_BITS.get(self.cache_mode)
