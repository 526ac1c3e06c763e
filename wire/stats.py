"""What a worker reports about itself: engine info at ready, engine stats in every heartbeat.

Imported by the worker (engines fill these) and the gateway (admin API, metrics, watchdogs). Every
engine reports the same shapes; a figure an engine does not have keeps its default.
"""

from __future__ import annotations

import sys
from typing import Annotated

from msgspec import Meta

from wire.codec import Count, Struct


class DeviceInfo(Struct, frozen=True):
    """One GPU as the worker sees it; `visible_as` is the host's index it was pinned to."""

    index: int
    visible_as: str
    name: str
    uuid: str = ""
    memory_used_mib: int = 0
    memory_total_mib: int = 0


class EngineInfo(Struct, frozen=True):
    """The engine's limits and set-up, sent once in Ready."""

    engine: str
    engine_version: str
    max_seq_len: int
    max_batch_size: int  # jobs it runs at once (1 for an unpaged exllamav2 generator)
    max_chunk_size: int
    vocab_size: int
    paged: bool
    devices: list[DeviceInfo]  # the GPUs it runs on; empty on a CPU
    attention: str = ""
    cache_size: int = 0  # KV cache tokens; 0 when the engine has no shared cache
    cache_mode: str = ""
    dtype: str = ""
    draft: str = ""  # "" (none), "ngram", or the draft model's folder name
    configured_max_batch_size: int = 0


class EngineStats(Struct, frozen=True):
    """Load figures in every heartbeat. `steps` counts generator steps of every kind, prefill
    included; `active_jobs` and `queued_jobs` are the jobs the engine actually holds."""

    active_jobs: Count = 0
    queued_jobs: Count = 0
    steps: Count = 0
    generated_tokens: Count = 0
    jobs_finished: Count = 0
    jobs_cancelled: Count = 0
    jobs_per_step: Annotated[float, Meta(ge=0.0, le=sys.float_info.max)] = 0.0
    kv_cache_usage_ratio: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    cache_pages_total: Count = 0  # 0 when the engine does not page its cache
    cache_pages_free: Count = 0
    # Device-wide memory in use, keyed by the host's GPU index.
    gpu_memory_used_bytes: dict[str, Count] = {}

    def __post_init__(self) -> None:
        if self.cache_pages_free > self.cache_pages_total:
            raise ValueError("more free cache pages than pages")


class WorkerLoad(Struct, frozen=True):
    """The requests a worker holds (model_worker.jobs), in every heartbeat. `active`: generation jobs
    admitted and running (or compiling their constraint), and embedding requests in the turn the
    engine runs; `queued`: generation jobs admitted and waiting for a running slot, and embedding
    requests waiting for the next turn or having their inputs tokenized. `max_jobs` and `max_queue`:
    the cap the worker enforces itself on generation jobs; 0: none of its own (a worker its gateway
    spawned, whose admission is the gateway's). Embedding requests are never refused by it (a turn
    batches them all); gateways bound them with their slots, reading this load. `yours`: how many of
    active + queued belong to the gateway the heartbeat is sent to, so each gateway knows what the
    others put on the worker. `idle_s`: how long it has held no request of any gateway (0 while it
    holds one), which the leading gateway unloads an idle model by (cluster mode, `idle_unload_s`)."""

    active: Count = 0
    queued: Count = 0
    max_jobs: Count = 0
    max_queue: Count = 0
    yours: Count = 0
    idle_s: Annotated[float, Meta(ge=0.0, le=sys.float_info.max)] = 0.0

    @property
    def others(self) -> int:
        """Jobs of other gateways."""
        return max(self.active + self.queued - self.yours, 0)


class TokenizerInfo(Struct, frozen=True):
    """The model's tokenizer as clients see it (vLLM's /tokenizer_info), sent once in Ready."""

    tokenizer_class: str = ""
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template: str | None = None
    model_max_length: int = 0
