"""What the settings of the two exllama engines share: a KV cache of 256-token pages, a split over
GPUs, and speculative decoding with a draft model or n-gram drafts.

Imported by the worker and by `model_worker.settings_check` at config time; imports neither torch
nor an exllama library. Each engine's `settings` module subclasses `PagedCacheSettings` with its
cache precisions and its own keys, and says through two class variables where the libraries differ:
how many tokens past a job's context its cache reserves, and whether prefill chunks are whole pages.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field, ValidationInfo, field_validator

from model_worker.engines.base import EngineSettings, context_max_seq_len, settings_error

PAGE_SIZE = 256  # the cache page of exllamav2 (PAGED_PAGE_SIZE) and of exllamav3 (PAGE_SIZE)
NUM_DRAFT_TOKENS = 4  # tokens drafted per step when speculating (draft model or n-gram)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class PagedCacheSettings(EngineSettings):
    """Fields and checks common to `engine: exllamav2` and `engine: exllamav3`."""

    needs_gpu: ClassVar[bool] = True
    engine_name: ClassVar[str]
    # exllamav3 reserves one token past a job's prompt and completion; exllamav2 none.
    tokens_reserved_past_context: ClassVar[int] = 0

    cache_size: int | None = Field(
        None,
        ge=PAGE_SIZE,
        description="KV cache tokens shared by all jobs, a multiple of 256 that holds at least one "
        "max_seq_len job; default max_seq_len x max_batch_size (rounded up to 256).",
    )
    gpu_split: list[float] | None = Field(
        None, description="GB per GPU given to the model when it is split over several; default autosplit."
    )
    reserve_vram_gb: float = Field(0.0, ge=0.0, description="GB per GPU left free when loading.")
    draft_path: Path | None = Field(None, description="Draft model folder for speculative decoding.")
    ngram_draft: bool = Field(
        False, description="Speculative decoding with n-gram drafts from the context (no draft model)."
    )

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

    def prefills_whole_pages(self) -> bool:
        """Whether a prefill chunk must be whole cache pages (the engine may not page at all)."""
        return True

    def check_pages(self, info: ValidationInfo) -> None:
        """What the library would refuse at load or at a job's enqueue, or bend quietly: called by
        each engine's model validator, so that the error names the field."""
        if self.ngram_draft and self.draft_path is not None:
            raise ValueError("ngram_draft and draft_path are two drafting methods; choose one")
        engine = self.engine_name
        if self.prefills_whole_pages() and self.max_chunk_size % PAGE_SIZE:
            message = (
                f"max_chunk_size must be a multiple of {PAGE_SIZE} ({engine} prefills whole cache pages), "
                f"e.g. {max(PAGE_SIZE, self.max_chunk_size // PAGE_SIZE * PAGE_SIZE)}"
            )
            raise settings_error(type(self), "max_chunk_size", message, self.max_chunk_size)
        if self.cache_size is None:
            return
        if self.cache_size % PAGE_SIZE:
            message = (
                f"cache_size must be a multiple of {PAGE_SIZE} ({engine}'s cache page), "
                f"e.g. {round_up(self.cache_size, PAGE_SIZE)}"
            )
            raise settings_error(type(self), "cache_size", message, self.cache_size)
        max_seq_len = context_max_seq_len(info.context)
        if max_seq_len is not None and self.cache_size < self.tokens_per_job(max_seq_len):
            reserved = [
                *(["one token more"] if self.tokens_reserved_past_context else []),
                *(["the draft window"] if self.drafts else []),
            ]
            why = f" ({engine} reserves {' and '.join(reserved)})" if reserved else ""
            message = (
                f"cache_size {self.cache_size} cannot hold one job of max_seq_len {max_seq_len} tokens{why}; "
                f"it needs at least {self.tokens_per_job(max_seq_len)}"
            )
            raise settings_error(type(self), "cache_size", message, self.cache_size)

    @property
    def drafts(self) -> bool:
        return self.ngram_draft or self.draft_path is not None

    def tokens_per_job(self, max_seq_len: int) -> int:
        """Cache tokens the library reserves for one job of max_seq_len tokens, in whole pages."""
        draft_window = NUM_DRAFT_TOKENS if self.drafts else 0
        return round_up(max_seq_len + self.tokens_reserved_past_context + draft_window, PAGE_SIZE)

    def paged_cache_size(self, max_seq_len: int) -> int:
        """The paged cache's size in tokens: as configured, or max_seq_len x max_batch_size."""
        if self.cache_size is not None:
            return max(self.cache_size, self.tokens_per_job(max_seq_len))
        return max(round_up(max_seq_len * self.max_batch_size, PAGE_SIZE), self.tokens_per_job(max_seq_len))

    def weight_dirs(self) -> list[Path]:
        return [self.draft_path] if self.draft_path is not None else []

    def reserved_vram_gb(self) -> float:
        return self.reserve_vram_gb
