"""Settings of the exllamav3 engine (the `engine_settings` of an `engine: exllamav3` model).

Imported by the worker and by `model_worker.settings_check` at config time; imports neither torch
nor exllamav3. What exllamav3 1.6.5 would refuse or quietly bend is refused here, naming the field:
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

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from model_worker.engines.base import EngineSettings, context_max_seq_len, settings_error

PAGE_SIZE = 256  # exllamav3's PAGE_SIZE
NUM_DRAFT_TOKENS = 4  # tokens drafted per step when speculating (draft model or n-gram)
NGRAM_MATCH_MIN = 3  # n-gram drafting proposes a continuation after a match of at least this many tokens
CACHE_BITS = {"Q8": 8, "Q6": 6, "Q5": 5, "Q4": 4, "Q3": 3, "Q2": 2}

_EXLLAMAV2_ONLY = {
    "paged": "exllamav3 always batches through its own paged attention (no flash-attn needed); remove it",
}


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ExLlamaV3Settings(EngineSettings):
    needs_gpu: ClassVar[bool] = True

    cache_size: int | None = Field(
        None,
        ge=PAGE_SIZE,
        description="KV cache tokens shared by all jobs, a multiple of 256 that holds at least one "
        "max_seq_len job; default max_seq_len x max_batch_size (rounded up to 256).",
    )
    cache_mode: Literal["FP16", "Q8", "Q6", "Q5", "Q4", "Q3", "Q2"] = Field(
        "FP16", description="KV cache precision: FP16, or keys and values quantized to 8 ... 2 bits."
    )
    gpu_split: list[float] | None = Field(
        None, description="GB per GPU that the model may use when split; default autosplit."
    )
    reserve_vram_gb: float = Field(0.0, ge=0.0, description="GB per GPU left free when loading.")
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
    draft_path: Path | None = Field(None, description="Draft model folder for speculative decoding.")
    ngram_draft: bool = Field(
        False, description="Speculative decoding with n-gram drafts from the context (no draft model)."
    )

    @model_validator(mode="before")
    @classmethod
    def _exllamav2_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, reason in _EXLLAMAV2_ONLY.items():
                if key in data:
                    raise settings_error(cls, key, f"{key} is an exllamav2 setting: {reason}", data[key])
        return data

    @field_validator("draft_path")
    @classmethod
    def _resolve_draft(cls, path: Path | None, info: ValidationInfo) -> Path | None:
        base = (info.context or {}).get("base_dir")
        return (Path(base) / path).resolve() if path is not None and base else path

    @field_validator("gpu_split")
    @classmethod
    def _split_per_gpu(cls, split: list[float] | None, info: ValidationInfo) -> list[float] | None:
        gpu_counts: list[int] = (info.context or {}).get("gpu_counts") or []
        if split is not None and any(count != len(split) for count in gpu_counts):
            raise ValueError("gpu_split needs one entry per GPU of each replica")
        if split is not None and not any(gb > 0 for gb in split):
            raise ValueError("gpu_split must give at least one GPU a positive number of GB")
        return split

    @model_validator(mode="after")
    def _what_exllamav3_accepts(self, info: ValidationInfo) -> ExLlamaV3Settings:
        if self.ngram_draft and self.draft_path is not None:
            raise ValueError("ngram_draft and draft_path are two drafting methods; choose one")
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
        if self.max_chunk_size % PAGE_SIZE:
            message = (
                f"max_chunk_size must be a multiple of {PAGE_SIZE} (exllamav3 prefills whole cache pages), "
                f"e.g. {max(PAGE_SIZE, self.max_chunk_size // PAGE_SIZE * PAGE_SIZE)}"
            )
            raise settings_error(type(self), "max_chunk_size", message, self.max_chunk_size)
        if self.cache_size is not None:
            if self.cache_size % PAGE_SIZE:
                message = (
                    f"cache_size must be a multiple of {PAGE_SIZE} (exllamav3's cache page), "
                    f"e.g. {round_up(self.cache_size, PAGE_SIZE)}"
                )
                raise settings_error(type(self), "cache_size", message, self.cache_size)
            max_seq_len = context_max_seq_len(info.context)
            if max_seq_len is not None and self.cache_size < self.tokens_per_job(max_seq_len):
                reserved = "one token more" + (" and the draft window" if self.drafts else "")
                message = (
                    f"cache_size {self.cache_size} cannot hold one job of max_seq_len {max_seq_len} tokens "
                    f"(exllamav3 reserves {reserved}); it needs at least {self.tokens_per_job(max_seq_len)}"
                )
                raise settings_error(type(self), "cache_size", message, self.cache_size)
        return self

    @property
    def drafts(self) -> bool:
        return self.ngram_draft or self.draft_path is not None

    def tokens_per_job(self, max_seq_len: int) -> int:
        """Cache tokens exllamav3 reserves for one job of max_seq_len tokens, in whole pages."""
        return round_up(max_seq_len + 1 + (NUM_DRAFT_TOKENS if self.drafts else 0), PAGE_SIZE)

    def paged_cache_size(self, max_seq_len: int) -> int:
        if self.cache_size is not None:
            return max(self.cache_size, self.tokens_per_job(max_seq_len))
        return max(round_up(max_seq_len * self.max_batch_size, PAGE_SIZE), self.tokens_per_job(max_seq_len))

    def cache_bits(self) -> int | None:
        """Bits per K/V element, or None for FP16."""
        return CACHE_BITS.get(self.cache_mode)

    def weight_dirs(self) -> list[Path]:
        return [self.draft_path] if self.draft_path is not None else []

    def reserved_vram_gb(self) -> float:
        return self.reserve_vram_gb
