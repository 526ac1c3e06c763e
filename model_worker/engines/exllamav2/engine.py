"""The exllamav2 engine: one model, one KV cache and one dynamic generator on this worker's GPUs.

Runs in a worker process whose CUDA_VISIBLE_DEVICES already names its GPUs, driven by the serve
loop's single thread (the dynamic generator is not thread-safe). Owns the exllamav2 objects
(config, model, cache, tokenizer, generator, optional draft model and draft cache) and the map
from request id to generator job. torch and exllamav2 are imported in `load()`, so this module
imports on machines without CUDA or exllamav2.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_worker.devices import cuda_devices, gpu_memory_used_bytes
from model_worker.engines.base import GREEDY_BELOW_TEMPERATURE, ProgressCallback, RequestRejected
from model_worker.engines.exllamav2 import extensions, scoring
from model_worker.engines.exllamav2.results import (
    PartialOutput,
    add_tokens,
    attention_kind,
    eos_token_ids,
    make_config,
)
from model_worker.engines.exllamav2.settings import ExLlamaV2Settings
from model_worker.engines.structured_output import (
    build_parser,
    exllamav2_filter,
    exllamav2_tokenizer_data,
    wants_json,
)
from model_worker.engines.token_texts import TokenTexts
from model_worker.engines.validation import completion_budget
from wire.params import SamplingParams
from wire.results import FinishReason, JobOutput, RejectCode, TokenLogprob, Usage
from wire.stats import EngineInfo, EngineStats

logger = logging.getLogger(__name__)

PAGE_SIZE = 256  # exllamav2's PAGED_PAGE_SIZE: cache sizes (and paged chunk sizes) are multiples of it
NUM_DRAFT_TOKENS = 4
_CACHE_CLASSES = {"FP16": "ExLlamaV2Cache", "Q4": "ExLlamaV2Cache_Q4", "Q6": "ExLlamaV2Cache_Q6",
                  "Q8": "ExLlamaV2Cache_Q8"}  # fmt: skip


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class _Job:
    job: Any  # ExLlamaV2DynamicJob
    prompt_tokens: int
    logprobs: int | None
    include_stop_str: bool = False


class ExLlamaV2Engine:
    def __init__(self, path: str, max_seq_len: int, settings: ExLlamaV2Settings) -> None:
        self._jobs_per_step = 0.0
        self.path = path
        self.max_seq_len = max_seq_len
        self.settings = settings
        self._jobs: dict[str, _Job] = {}
        self._exl: Any = None  # the exllamav2 modules and torch, bound in load()
        self._torch: Any = None
        self.generator: Any = None
        self.model: Any = None
        self.cache: Any = None
        self.tokenizer: Any = None
        self.draft_model: Any = None
        self.draft_cache: Any = None
        self.paged = False
        self.attention = ""
        self.cache_size = 0
        self.max_chunk_size = settings.max_chunk_size
        self.vocab_size = 0
        self._eos_ids: list[int] = []
        self._pieces: list[str] = []
        self._supports_logit_bias = False
        self._json_data: Any = None  # lm-format-enforcer's tokenizer data, built for the first JSON job
        self._counters = {"steps": 0, "tokens": 0, "finished": 0, "cancelled": 0}
        self._texts = TokenTexts(self.decode)

    # ---- loading -------------------------------------------------------------------------------

    def load(self, progress: ProgressCallback) -> None:
        import exllamav2
        import exllamav2.attn
        import exllamav2.generator
        import torch

        self._exl, self._torch = exllamav2, torch
        if not torch.cuda.is_available():
            raise RuntimeError("the exllamav2 engine needs a CUDA GPU, and none is visible to this worker")
        s = self.settings
        num_draft = NUM_DRAFT_TOKENS if s.draft_path else 0
        config = make_config(self.path)
        self.attention = attention_kind(config)
        # Paged attention (continuous batching) needs flash-attn >= 2.5.7; without it exllamav2's
        # unpaged fallback holds one sequence at a time.
        self.paged = bool(exllamav2.attn.has_flash_attn_with_paged) and not config.no_flash_attn
        self.paged = self.paged and s.paged
        # A job holds up to max_seq_len tokens plus the draft tokens speculated past its end.
        per_job = _round_up(self.max_seq_len + num_draft, PAGE_SIZE)
        if self.paged:
            wanted = s.cache_size or self.max_seq_len * s.max_batch_size
            self.cache_size = max(_round_up(wanted, PAGE_SIZE), per_job)
            self.max_chunk_size = max(PAGE_SIZE, s.max_chunk_size // PAGE_SIZE * PAGE_SIZE)  # whole pages
        else:
            # Unpaged, the whole cache is one page that serves one job: anything beyond it is waste.
            self.cache_size = per_job
            self.max_chunk_size = min(s.max_chunk_size, self.max_seq_len)
            logger.info(
                "flash-attn >= 2.5.7 is not available: exllamav2 runs unpaged, so jobs on %s run one at a "
                "time (max_batch_size %d is not used); install flash-attn to batch them",
                Path(self.path).name, s.max_batch_size,
            )  # fmt: skip
        if s.cache_size and s.cache_size != self.cache_size:
            logger.info("cache_size %d adjusted to %d tokens", s.cache_size, self.cache_size)
        batch = s.max_batch_size if self.paged else 1
        if s.draft_path:
            draft = self._load_model(make_config(str(s.draft_path)), batch, num_draft, progress, (0.0, 0.2))
            self.draft_model, self.draft_cache = draft
        span = (0.2 if s.draft_path else 0.0, 1.0)
        self.model, self.cache = self._load_model(config, batch, num_draft, progress, span)
        self.tokenizer = exllamav2.ExLlamaV2Tokenizer(config)
        self.vocab_size = int(config.vocab_size)
        self._eos_ids = eos_token_ids(config, self.tokenizer)
        self._pieces = self.tokenizer.get_id_to_piece_list(False)
        sampler = exllamav2.generator.ExLlamaV2Sampler
        self._supports_logit_bias = hasattr(sampler.Settings(), "token_bias")
        self.generator = exllamav2.generator.ExLlamaV2DynamicGenerator(
            model=self.model,
            cache=self.cache,
            tokenizer=self.tokenizer,
            max_batch_size=batch,
            max_seq_len=config.max_seq_len,
            max_chunk_size=self.max_chunk_size,
            paged=self.paged,
            draft_model=self.draft_model,
            draft_cache=self.draft_cache,
            num_draft_tokens=NUM_DRAFT_TOKENS,
            # n-gram drafting proposes tokens seen earlier in the context; no second model needed.
            use_ngram_draft=s.ngram_draft and self.draft_model is None,
        )
        progress("model loaded", 1.0)

    def _load_model(
        self, config: Any, batch: int, num_draft: int, progress: ProgressCallback, span: tuple[float, float]
    ) -> tuple[Any, Any]:
        """One model and its cache: one GPU, an explicit gpu_split, or autosplit over every visible GPU."""
        s, torch = self.settings, self._torch
        config.max_seq_len = self.max_seq_len + num_draft
        config.max_input_len = self.max_chunk_size
        config.max_attention_size = self.max_chunk_size**2
        # The generator checks max_batch_size * max_q_size (8) against these scratch dimensions.
        config.max_batch_size = max(1, math.ceil(batch * 8 / config.max_input_len))
        model = self._exl.ExLlamaV2(config)
        cache_cls = getattr(self._exl, _CACHE_CLASSES[s.cache_mode])
        name, (p0, p1) = Path(config.model_dir).name, span

        def on_module(done: int, total: int) -> None:
            progress(f"loading {name}: module {done}/{total}", p0 + (p1 - p0) * done / max(total, 1))

        devices = torch.cuda.device_count()
        if s.gpu_split and devices > 1:
            for index, gb in enumerate(s.gpu_split[:devices]):
                total_gb = torch.cuda.get_device_properties(index).total_memory / 1024**3
                if gb + s.reserve_vram_gb > total_gb:
                    raise RuntimeError(
                        f"gpu_split[{index}] = {gb} GB plus reserve_vram_gb {s.reserve_vram_gb} exceeds "
                        f"the {total_gb:.1f} GB of GPU {index}"
                    )
            model.load(gpu_split=list(s.gpu_split), callback=on_module)
            return model, cache_cls(model, max_seq_len=self.cache_size)
        if devices > 1:
            # Lazy cache: autosplit places cache layers beside their attention layers as it fills GPUs.
            cache = cache_cls(model, max_seq_len=self.cache_size, lazy=True)
            reserve = int(s.reserve_vram_gb * 1024**3) if s.reserve_vram_gb else None
            model.load_autosplit(cache, reserve_vram=reserve, callback=on_module)
            return model, cache
        model.load(callback=on_module)
        return model, cache_cls(model, max_seq_len=self.cache_size)

    # ---- tokens ----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # Chat templates put special tokens in the text; they must become their ids, not text.
        ids = self.tokenizer.encode(text, add_bos=add_special_tokens, encode_special_tokens=True)
        return [int(t) for t in ids[0].tolist()]

    def decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return str(self.tokenizer.decode(self._torch.tensor(token_ids, dtype=self._torch.long)))

    # ---- jobs ------------------------------------------------------------------------------------

    def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_ids)
        eos = [] if params.ignore_eos else self._eos_ids
        filters = self._json_filters(params)
        if filters:
            # The enforcer closes the output with the tokenizer's EOS: it ends the job even under ignore_eos.
            eos = [*eos, int(self.tokenizer.eos_token_id)]
        stop: list[Any] = [*params.stop, *params.stop_token_ids, *eos]
        job = self._exl.generator.ExLlamaV2DynamicJob(
            input_ids=self._torch.tensor([prompt_ids], dtype=self._torch.long),
            # The generator ends a job num_draft_tokens early when it drafts; add them back.
            max_new_tokens=completion_budget(n, params, self.max_seq_len) + self.generator.num_draft_tokens,
            min_new_tokens=params.min_tokens,
            gen_settings=self._sampler_settings(params),
            seed=params.seed,
            stop_conditions=list(dict.fromkeys(stop)),
            identifier=rid,
            return_probs=params.logprobs is not None,
            return_top_tokens=params.logprobs or 0,
            filters=filters,
            # Ends the job as soon as the JSON is complete, instead of letting whitespace run on.
            filter_prefer_eos=bool(filters),
            **extensions.job_arguments(params),
        )
        try:
            self.generator.enqueue(job)
        except AssertionError as exc:  # exllamav2 checks the fit with asserts, before changing state
            message = f"the job does not fit the cache: {exc}"
            raise RequestRejected(RejectCode.CONTEXT_LENGTH_EXCEEDED, message) from None
        self._jobs[rid] = _Job(job, n, params.logprobs, params.include_stop_str_in_output)

    def _json_filters(self, params: SamplingParams) -> list[Any]:
        """The job's lm-format-enforcer filter when it asks for JSON; RequestRejected for a bad schema."""
        if not wants_json(params):
            return []
        parser = build_parser(params)  # before the slow tokenizer data: a bad schema fails fast
        self.prepare_constraints()
        return [exllamav2_filter(parser, self._json_data)]

    def prepare_constraints(self) -> None:
        """Build the constraint tokenizer data ahead (called once, on a thread beside the serve loop)."""
        if self._json_data is None:
            started = time.monotonic()
            self._json_data = exllamav2_tokenizer_data(self.tokenizer)
            logger.info("structured output: tokenizer data built in %.2fs", time.monotonic() - started)

    def _sampler_settings(self, params: SamplingParams) -> Any:
        settings_cls = self._exl.generator.ExLlamaV2Sampler.Settings
        if params.temperature < GREEDY_BELOW_TEMPERATURE:  # near 0 overflows the sampler; it means greedy
            settings = settings_cls.greedy()
        else:
            settings = settings_cls(
                temperature=float(params.temperature),
                top_k=int(params.top_k),
                top_p=float(params.top_p),
                min_p=float(params.min_p),
                typical=float(params.typical_p),  # 1.0, like 0, disables it in exllamav2
            )
        settings.token_repetition_penalty = float(params.repetition_penalty)
        settings.token_frequency_penalty = float(params.frequency_penalty)
        settings.token_presence_penalty = float(params.presence_penalty)
        if params.logit_bias:
            if not self._supports_logit_bias:
                raise RequestRejected(
                    RejectCode.UNSUPPORTED_PARAMETER, "logit_bias is not supported", "logit_bias"
                )
            # Sized like the model's logits, which exllamav2 pads to a multiple of 32.
            bias = self._torch.zeros((_round_up(self.vocab_size, 32),), dtype=self._torch.float)
            for token_id, value in params.logit_bias.items():
                bias[token_id] = float(value)
            settings.token_bias = bias
        if params.allowed_token_ids:
            if not self._supports_logit_bias:
                message = "allowed_token_ids is not supported"
                raise RequestRejected(RejectCode.UNSUPPORTED_PARAMETER, message, "allowed_token_ids")
            extensions.restrict_tokens(settings, params, _round_up(self.vocab_size, 32), self._torch)
        return settings

    def prompt_logprobs(self, prompt_ids: list[int], top: int) -> list[TokenLogprob]:
        return scoring.prompt_logprobs(
            self.model, prompt_ids, top, self.max_chunk_size, self.vocab_size, self._texts
        )

    def cancel(self, rid: str) -> bool:
        state = self._jobs.pop(rid, None)
        if state is None:
            return False
        # A job that finished inside the last iterate() is no longer the generator's to cancel.
        if state.job in self.generator.pending_jobs or state.job in self.generator.active_jobs:
            self.generator.cancel(state.job)
            self._counters["cancelled"] += 1
            return True
        return False

    def step(self) -> list[JobOutput]:
        active = len(self.generator.active_jobs)
        results = self.generator.iterate()  # an exception here is fatal for the worker: let it rise
        self._counters["steps"] += 1
        # How well batching is used: a moving average over the last ~20 steps.
        self._jobs_per_step += (active - self._jobs_per_step) * 0.05
        merged: dict[str, PartialOutput] = {}
        for result in results:
            state = self._jobs.get(str(result.get("identifier")))
            if result["stage"] != "streaming" or state is None:
                continue
            rid = result["identifier"]
            part = merged.setdefault(rid, PartialOutput(logprobs=None if state.logprobs is None else []))
            add_tokens(part, result, self._texts)
            if result["eos"]:
                self._finish(part, result, state)
                del self._jobs[rid]
        outputs = []
        for rid, part in merged.items():
            if part.token_ids or part.text or part.finish_reason:
                self._counters["tokens"] += len(part.token_ids)
                outputs.append(JobOutput(rid, part.text, part.token_ids, part.finish_reason, part.usage,
                                         part.logprobs))  # fmt: skip
        return outputs

    def _finish(self, part: PartialOutput, result: dict[str, Any], state: _Job) -> None:
        reason = result.get("eos_reason")
        held = result.get("held", {})
        if reason == "stop_token" and held:
            # Text held back (a possible stop-string prefix) ends with the stop token: keep the
            # text, drop the token, as OpenAI does with eos.
            stop_id = int(result["eos_triggering_token_id"])
            piece = self._pieces[stop_id] if 0 <= stop_id < len(self._pieces) else ""
            if piece and held.get("text", "").endswith(piece):
                held = {**held, "text": held["text"][: -len(piece)]}
            add_tokens(part, held, self._texts, drop_last=True)
        part.text += extensions.stop_string_text(result, state.include_stop_str)
        part.finish_reason = FinishReason.LENGTH if reason == "max_new_tokens" else FinishReason.STOP
        part.usage = Usage(
            prompt_tokens=state.prompt_tokens,
            completion_tokens=int(result.get("new_tokens", len(part.token_ids))),
            cached_tokens=int(result.get("cached_tokens", 0)),
            queue_s=round(float(result.get("time_enqueued", 0.0)), 6),
            prefill_s=round(float(result.get("time_prefill", 0.0)), 6),
            decode_s=round(float(result.get("time_generate", 0.0)), 6),
            accepted_draft_tokens=int(result.get("accepted_draft_tokens", 0)),
            rejected_draft_tokens=int(result.get("rejected_draft_tokens", 0)),
        )
        self._counters["finished"] += 1

    def has_work(self) -> bool:
        return self.generator is not None and self.generator.num_remaining_jobs() > 0

    # ---- reporting -------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        generator = self.generator
        if generator is None:
            return EngineStats()
        total_pages = len(getattr(generator, "all_pages", None) or []) or int(
            getattr(generator, "max_pages", 0) or 0
        )
        free_pages = min(len(generator.unreferenced_pages), total_pages)
        return EngineStats(
            active_jobs=len(generator.active_jobs),
            queued_jobs=len(generator.pending_jobs),
            steps=self._counters["steps"],
            generated_tokens=self._counters["tokens"],
            jobs_finished=self._counters["finished"],
            jobs_cancelled=self._counters["cancelled"],
            jobs_per_step=round(self._jobs_per_step, 3),
            kv_cache_usage_ratio=round(1.0 - free_pages / total_pages, 4) if total_pages else 0.0,
            cache_pages_total=total_pages,
            cache_pages_free=free_pages,
            gpu_memory_used_bytes=gpu_memory_used_bytes(),
        )

    def info(self) -> EngineInfo:
        s = self.settings
        draft = "ngram" if s.ngram_draft else (Path(s.draft_path).name if s.draft_path else "")
        return EngineInfo(
            engine="exllamav2",
            engine_version=str(self._exl.__version__) if self._exl else "",
            max_seq_len=self.max_seq_len,
            max_batch_size=s.max_batch_size if self.paged else 1,
            max_chunk_size=self.max_chunk_size,
            vocab_size=self.vocab_size,
            paged=self.paged,
            devices=cuda_devices(),
            attention=self.attention,
            cache_size=self.cache_size,
            cache_mode=s.cache_mode,
            draft=draft,
            configured_max_batch_size=s.max_batch_size,
        )

    def close(self) -> None:
        for rid in list(self._jobs):
            self.cancel(rid)
        for model in (self.model, self.draft_model):
            if model is not None:
                model.unload()
        self.generator = self.cache = self.draft_cache = self.model = self.draft_model = None
        if self._torch is not None:
            self._torch.cuda.empty_cache()
