"""Settings of the transformers engine (the `engine_settings` of a `engine: transformers` model).

Imported by the worker and by `model_worker.settings_check` at config time; imports no torch.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from model_worker.engines.base import EngineSettings


class TransformersSettings(EngineSettings):
    supported_parameters: ClassVar[frozenset[str]] = frozenset(
        {"prompt_logprobs", "include_stop_str_in_output", "banned_strings", "bad_words", "allowed_token_ids"}
    )

    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="Weights' precision; auto takes the model's (float32 for float16 on a CPU)."
    )
    threads: int | None = Field(None, ge=1, description="CPU threads for torch in this worker.")
