"""Settings of the exllamav2 engine (the `engine_settings` of an `engine: exllamav2` model).

Imported by the worker and by `model_worker.settings_check` at config time; imports neither torch
nor exllamav2. Checks that need the model's context length or its GPU count read them from the
validation context that settings_check supplies.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from model_worker.engines.base import EngineSettings


class ExLlamaV2Settings(EngineSettings):
    needs_gpu: ClassVar[bool] = True
    # bad_words is not among them: exllamav2 bans strings (banned_strings), not token sequences.
    supported_parameters: ClassVar[frozenset[str]] = frozenset(
        {"prompt_logprobs", "include_stop_str_in_output", "banned_strings", "allowed_token_ids"}
    )

    cache_size: int | None = Field(
        None, ge=16, description="KV cache tokens shared by all jobs; default max_seq_len x max_batch_size."
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
    def _one_drafting_method(self) -> ExLlamaV2Settings:
        if self.ngram_draft and self.draft_path is not None:
            raise ValueError("ngram_draft and draft_path are two drafting methods; choose one")
        return self

    def weight_dirs(self) -> list[Path]:
        return [self.draft_path] if self.draft_path is not None else []

    def reserved_vram_gb(self) -> float:
        return self.reserve_vram_gb
