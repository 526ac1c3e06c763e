"""Settings of the exllamav2 engine (the `engine_settings` of an `engine: exllamav2` model).

Imported by the worker and by `model_worker.settings_check` at config time; imports neither torch
nor exllamav2. The fields and checks both exllama engines share are in
`model_worker.engines.exllama_settings`; what exllamav2 0.3.2's dynamic generator would refuse with
an assertion at load or at a job's enqueue is refused there or here, naming the field:
- the paged cache is made of 256-token pages: `cache.max_seq_len must be multiple of 256`;
- in paged mode a prefill chunk is whole pages: `max_chunk_size must be multiple of 256`;
- a job must fit the cache: `Job requires N pages (only M available)`, so the cache holds at least
  one job of max_seq_len tokens plus the draft tokens speculated past its end.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, ValidationInfo, model_validator

from model_worker.engines.exllama_settings import PagedCacheSettings


class ExLlamaV2Settings(PagedCacheSettings):
    engine_name: ClassVar[str] = "exllamav2"
    # bad_words is not among them: exllamav2 bans strings (banned_strings), not token sequences.
    supported_parameters: ClassVar[frozenset[str]] = frozenset(
        {"prompt_logprobs", "include_stop_str_in_output", "banned_strings", "allowed_token_ids"}
    )

    cache_mode: Literal["FP16", "Q4", "Q6", "Q8"] = Field("FP16", description="KV cache precision.")
    paged: bool = Field(
        True,
        description="Batch jobs with paged attention when flash-attn is installed; false: one job at a time.",
    )

    def prefills_whole_pages(self) -> bool:
        return self.paged  # unpaged, the whole cache is one page

    @model_validator(mode="after")
    def _what_exllamav2_accepts(self, info: ValidationInfo) -> ExLlamaV2Settings:
        self.check_pages(info)
        return self
