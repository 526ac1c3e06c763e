"""The exllamav2 engine: one model, one KV cache and one dynamic generator on this worker's GPUs.

Runs in a worker process whose CUDA_VISIBLE_DEVICES already names its GPUs, driven by the serve
loop's single thread (the dynamic generator is not thread-safe). Owns the exllamav2 objects
(config, model, cache, tokenizer, generator, optional draft model and draft cache) and the map
from request id to generator job. torch and exllamav2 are imported in `load()`, so this module
imports on machines without CUDA or exllamav2.

Paged (flash-attn installed, `paged: true`): jobs share a cache of 256-token pages and are batched
in every step (continuous batching); a job that does not fit the free pages waits in the
generator's queue. Unpaged: one job at a time, the cache sized for exactly one.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from model_worker.devices import cuda_devices
from model_worker.engines.base import GREEDY_BELOW_TEMPERATURE, ProgressCallback, RequestRejected
from model_worker.engines.dynamic_generator import DynamicGeneratorEngine, GeneratorJob
from model_worker.engines.exllama_settings import NUM_DRAFT_TOKENS, round_up
from model_worker.engines.exllamav2 import extensions, loading, scoring
from model_worker.engines.exllamav2.settings import ExLlamaV2Settings
from model_worker.engines.gpu_logprobs import StepLogprobs
from model_worker.engines.structured_output import (
    build_parser,
    exllamav2_filter,
    exllamav2_tokenizer_data,
    wants_json,
)
from model_worker.engines.validation import completion_budget
from wire.params import SamplingParams
from wire.results import RejectCode, TokenLogprob
from wire.stats import EngineInfo

logger = logging.getLogger(__name__)


class ExLlamaV2Engine(DynamicGeneratorEngine):
    settings: ExLlamaV2Settings

    def __init__(self, path: str, max_seq_len: int, settings: ExLlamaV2Settings) -> None:
        super().__init__(path, max_seq_len, settings)
        self.paged = False
        self.attention = ""
        self.cache_size = 0
        self.max_chunk_size = settings.max_chunk_size
        self._supports_logit_bias = False
        self._json_data: Any = None  # lm-format-enforcer's tokenizer data, built for the first JSON job

    def warmup_batches(self) -> list[int]:
        return super().warmup_batches() if self.paged else []  # unpaged: one job at a time

    # ---- loading -------------------------------------------------------------------------------

    def load(self, progress: ProgressCallback) -> None:
        import exllamav2
        import exllamav2.generator
        import torch

        self._exl, self._torch = exllamav2, torch
        if not torch.cuda.is_available():
            raise RuntimeError("the exllamav2 engine needs a CUDA GPU, and none is visible to this worker")
        s = self.settings
        num_draft = NUM_DRAFT_TOKENS if s.drafts else 0
        config = loading.make_config(self.path)
        self.attention = loading.attention_kind(config)
        self.paged = loading.can_page(config) and s.paged
        if self.paged:
            self.cache_size = s.paged_cache_size(self.max_seq_len)
            self.max_chunk_size = s.max_chunk_size  # whole pages: the settings check made sure
        else:
            # Unpaged, the whole cache is one page that serves one job: anything beyond it is waste.
            self.cache_size = s.tokens_per_job(self.max_seq_len)
            self.max_chunk_size = min(s.max_chunk_size, self.max_seq_len)
        batch = s.max_batch_size if self.paged else 1
        sizes = loading.Sizes(self.max_seq_len + num_draft, self.cache_size, self.max_chunk_size, batch)
        if s.draft_path:
            draft_config = loading.make_config(str(s.draft_path))
            self.draft_model, self.draft_cache = loading.load_model(
                draft_config, s, sizes, progress, (0.0, 0.2)
            )
        span = (0.2 if s.draft_path else 0.0, 1.0)
        self.model, self.cache = loading.load_model(config, s, sizes, progress, span)
        self.tokenizer = exllamav2.ExLlamaV2Tokenizer(config)
        self.vocab_size = int(config.vocab_size)
        self._eos_ids = loading.eos_token_ids(config, self.tokenizer)
        self._pieces = self.tokenizer.get_id_to_piece_list(False)
        self._read_partial_bytes()
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
        self._logprobs = StepLogprobs(min(self.vocab_size, self.tokenizer.get_vocab_size()))
        self._logprobs.attach(self.generator, self.model, "forward_chunk")
        self._log_mode()
        progress("model loaded", 1.0)

    def _log_mode(self) -> None:
        s, name = self.settings, Path(self.path).name
        if self.paged:
            logger.info(
                "exllamav2 paged on %s: attention %s, cache %d tokens (%d pages of 256, %s), up to %d jobs "
                "per step, prefill chunks of %d tokens", name, self.attention, self.cache_size,
                self.cache_size // 256, s.cache_mode, s.max_batch_size, self.max_chunk_size,
            )  # fmt: skip
        elif s.paged:
            logger.info(
                "exllamav2 unpaged on %s (attention %s): flash-attn >= 2.5.7 is not installed, so jobs run "
                "one at a time (max_batch_size %d is not used); install flash-attn to batch them",
                name, self.attention, s.max_batch_size,
            )  # fmt: skip
        else:
            logger.info("exllamav2 unpaged on %s (paged: false): jobs run one at a time", name)

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
            filters=filters,
            # Ends the job as soon as the JSON is complete, instead of letting whitespace run on.
            filter_prefer_eos=bool(filters),
            **extensions.job_arguments(params),
        )
        self._enqueue(rid, job, params, n)

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
            bias = self._torch.zeros((round_up(self.vocab_size, 32),), dtype=self._torch.float)
            for token_id, value in params.logit_bias.items():
                bias[token_id] = float(value)
            settings.token_bias = bias
        if params.allowed_token_ids:
            if not self._supports_logit_bias:
                message = "allowed_token_ids is not supported"
                raise RequestRejected(RejectCode.UNSUPPORTED_PARAMETER, message, "allowed_token_ids")
            extensions.restrict_tokens(settings, params, round_up(self.vocab_size, 32), self._torch)
        return settings

    def prompt_logprobs(self, prompt_ids: list[int], top: int) -> list[TokenLogprob]:
        return scoring.prompt_logprobs(
            self.model, prompt_ids, top, self.max_chunk_size, self.vocab_size, self._texts
        )

    def _finish_text(self, result: dict[str, Any], state: GeneratorJob) -> str:
        return extensions.stop_string_text(result, state.include_stop_str)

    def _pages(self) -> tuple[int, int]:
        total = int(self.generator.max_pages)
        return total, min(len(self.generator.unreferenced_pages), total)

    def _page_size(self) -> int:
        return int(self.generator.page_size)  # unpaged: the whole cache is one page per job

    # ---- reporting -------------------------------------------------------------------------------

    def info(self) -> EngineInfo:
        s = self.settings
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
            draft=self.draft_name(),
            configured_max_batch_size=s.max_batch_size,
        )
