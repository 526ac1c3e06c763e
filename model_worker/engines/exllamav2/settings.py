"""Settings of the exllamav2 engine (the `engine_settings` of an `engine: exllamav2` model).

Imported by the worker and by `model_worker.settings_check` at config time; imports neither torch
nor exllamav2. Checks that need the model's context length or its GPU count read them from the
validation context that settings_check supplies. What exllamav2 0.3.2's dynamic generator would
refuse with an assertion at load or at a job's enqueue is refused here, naming the field:
- the paged cache is made of 256-token pages: `cache.max_seq_len must be multiple of 256`;
- in paged mode a prefill chunk is whole pages: `max_chunk_size must be multiple of 256`;
- a job must fit the cache: `Job requires N pages (only M available)`, so the cache holds at least
  one job of max_seq_len tokens plus the draft tokens speculated past its end.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from model_worker.engines.base import EngineSettings, context_max_seq_len, settings_error

PAGE_SIZE = 256  # exllamav2's PAGED_PAGE_SIZE
NUM_DRAFT_TOKENS = 4  # tokens drafted per step when speculating (draft model or n-gram)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ExLlamaV2Settings(EngineSettings):
    needs_gpu: ClassVar[bool] = True
    # bad_words is not among them: exllamav2 bans strings (banned_strings), not token sequences.
    supported_parameters: ClassVar[frozenset[str]] = frozenset(
        {"prompt_logprobs", "include_stop_str_in_output", "banned_strings", "allowed_token_ids"}
    )

    cache_size: int | None = Field(
        None,
        ge=PAGE_SIZE,
        description="KV cache tokens shared by all jobs, a multiple of 256 that holds at least one "
        "max_seq_len job; default max_seq_len x max_batch_size (rounded up to 256).",
    )
    cache_mode: Literal["FP16", "Q4", "Q6", "Q8"] = Field("FP16", description="KV cache precision.")
    paged: bool = Field(
        True,
        description="Batch jobs with paged attention when flash-attn is installed; false: one job at a time.",
    )
    gpu_split: list[float] | None = Field(None, description="GB of weights per GPU; default autosplit.")
    reserve_vram_gb: float = Field(0.0, ge=0.0, description="GB per GPU left free when splitting.")
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
        return split

    @model_validator(mode="after")
    def _what_exllamav2_accepts(self, info: ValidationInfo) -> ExLlamaV2Settings:
        if self.ngram_draft and self.draft_path is not None:
            raise ValueError("ngram_draft and draft_path are two drafting methods; choose one")
        if self.paged and self.max_chunk_size % PAGE_SIZE:
            message = (
                f"max_chunk_size must be a multiple of {PAGE_SIZE} in paged mode (exllamav2 prefills whole "
                f"cache pages), e.g. {max(PAGE_SIZE, self.max_chunk_size // PAGE_SIZE * PAGE_SIZE)}"
            )
            raise settings_error(type(self), "max_chunk_size", message, self.max_chunk_size)
        if self.cache_size is not None:
            if self.cache_size % PAGE_SIZE:
                message = (
                    f"cache_size must be a multiple of {PAGE_SIZE} (exllamav2's cache page), "
                    f"e.g. {round_up(self.cache_size, PAGE_SIZE)}"
                )
                raise settings_error(type(self), "cache_size", message, self.cache_size)
            max_seq_len = context_max_seq_len(info.context)
            if max_seq_len is not None and self.cache_size < self.tokens_per_job(max_seq_len):
                message = (
                    f"cache_size {self.cache_size} cannot hold one job of max_seq_len {max_seq_len} tokens"
                    f"{' plus its draft tokens' if self.drafts else ''}; it needs at least "
                    f"{self.tokens_per_job(max_seq_len)}"
                )
                raise settings_error(type(self), "cache_size", message, self.cache_size)
        return self

    @property
    def drafts(self) -> bool:
        return self.ngram_draft or self.draft_path is not None

    def tokens_per_job(self, max_seq_len: int) -> int:
        """Cache tokens one job may hold: its context plus the tokens drafted past its end, in pages."""
        return round_up(max_seq_len + (NUM_DRAFT_TOKENS if self.drafts else 0), PAGE_SIZE)

    def paged_cache_size(self, max_seq_len: int) -> int:
        """The paged cache's size in tokens: as configured, or max_seq_len x max_batch_size."""
        if self.cache_size is not None:
            return max(self.cache_size, self.tokens_per_job(max_seq_len))
        return max(round_up(max_seq_len * self.max_batch_size, PAGE_SIZE), self.tokens_per_job(max_seq_len))

    def weight_dirs(self) -> list[Path]:
        return [self.draft_path] if self.draft_path is not None else []

    def reserved_vram_gb(self) -> float:
        return self.reserve_vram_gb
