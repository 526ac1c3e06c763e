"""The exllamav3 engine: one model, one paged KV cache and one generator on this worker's GPUs.

Runs in a worker process whose CUDA_VISIBLE_DEVICES already names its GPUs, driven by the serve
loop's single thread (like exllamav2's, exllamav3's generator is driven by one caller). Owns the
exllamav3 objects (config, model, cache, tokenizer, generator, optional draft model and draft
cache) and the map from request id to generator job. exllamav3 batches every job through its own
Triton paged attention, so it needs no flash-attn. torch and exllamav3 are imported in `load()`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from model_worker.devices import cuda_devices
from model_worker.engines.base import GREEDY_BELOW_TEMPERATURE, ProgressCallback, RequestRejected
from model_worker.engines.dynamic_generator import DynamicGeneratorEngine
from model_worker.engines.exllama_settings import NUM_DRAFT_TOKENS
from model_worker.engines.exllamav3 import loading
from model_worker.engines.exllamav3.settings import NGRAM_MATCH_MIN, ExLlamaV3Settings
from model_worker.engines.gpu_logprobs import StepLogprobs
from model_worker.engines.structured_output import wants_json
from model_worker.engines.validation import completion_budget
from wire.params import SamplingParams
from wire.results import RejectCode
from wire.stats import EngineInfo

logger = logging.getLogger(__name__)

_ANY_OBJECT_SCHEMA = '{"type": "object"}'


class ExLlamaV3Engine(DynamicGeneratorEngine):
    settings: ExLlamaV3Settings
    # exllamav3 captures its decode attention as CUDA graphs, one set per batch size up to 8
    # (compiled and captured on first use): on an 8B shape the first step of 2 jobs at once took
    # 1.4 s against 0.05 s the next time, 3 to 8 jobs 20-100 ms more the first time.
    SHAPED_BATCH_SIZES = range(2, 9)

    def __init__(self, path: str, max_seq_len: int, settings: ExLlamaV3Settings) -> None:
        super().__init__(path, max_seq_len, settings)
        self._version = ""
        self.cache_size = settings.paged_cache_size(max_seq_len)

    # ---- loading -------------------------------------------------------------------------------

    def load(self, progress: ProgressCallback) -> None:
        import exllamav3
        import torch
        from exllamav3.version import __version__

        self._exl, self._torch, self._version = exllamav3, torch, str(__version__)
        if not torch.cuda.is_available():
            raise RuntimeError("the exllamav3 engine needs a CUDA GPU, and none is visible to this worker")
        s = self.settings
        if s.draft_path is not None:
            self.draft_model, self.draft_cache = loading.load_model(
                str(s.draft_path), s, self.cache_size, progress, span=(0.0, 0.15), draft=True
            )
        self.model, self.cache = loading.load_model(
            self.path, s, self.cache_size, progress, span=(0.15 if s.draft_path else 0.0, 0.9)
        )
        # Triton compilation and autotuning for the shapes the generator will run, before the
        # generator owns the cache (the passes write its first pages).
        progress("compiling kernels for the model's shapes", 0.9)
        failed = self.model.warmup(cache=self.cache, max_chunk_size=s.max_chunk_size,
                                   max_batch_size=s.max_batch_size)  # fmt: skip
        if failed:
            logger.warning("exllamav3 warm-up passes that raised: %s", ", ".join(failed))
        config = self.model.config
        self.tokenizer = exllamav3.Tokenizer.from_config(config)
        self.vocab_size = int(config.vocab_size)
        self._eos_ids = [int(t) for t in dict.fromkeys(config.eos_token_id_list)]
        self._pieces = self.tokenizer.get_id_to_piece_list(False)
        self._read_partial_bytes()
        self.generator = exllamav3.Generator(
            model=self.model,
            cache=self.cache,
            tokenizer=self.tokenizer,
            max_batch_size=s.max_batch_size,
            max_chunk_size=s.max_chunk_size,
            # By default exllamav3 lets a new prompt in only every fifth step, one job at a time, with
            # half chunks, while other jobs generate: behind a gateway requests arrive while others
            # run, and the 64th of a burst waited 11 s for its first token (0.2 s in-process, where
            # all 64 arrive before the first step). Like exllamav2, every job now prefills a full
            # chunk per step; max_chunk_size still bounds what one step adds per job.
            prefill_cooldown=0,
            shared_chunk_size=s.max_chunk_size,
            draft_model=self.draft_model,
            draft_cache=self.draft_cache,
            num_draft_tokens=NUM_DRAFT_TOKENS if s.drafts else None,
            # n-gram drafting proposes the continuation of an earlier match in the job's own context.
            ngram_match_min=NGRAM_MATCH_MIN if s.ngram_draft else 0,
        )
        self._logprobs = StepLogprobs(min(self.vocab_size, int(self.tokenizer.actual_vocab_size)))
        self._logprobs.attach(self.generator, self.model, "forward")
        logger.info(
            "exllamav3 on %s: triton paged attention, cache %d tokens (%d pages of 256, %s), up to %d jobs "
            "per step, prefill chunks of %d tokens, %s%s", Path(self.path).name, self.cache_size,
            self.cache_size // 256, s.cache_mode, s.max_batch_size, s.max_chunk_size, self._split_name(),
            f", drafting {self.draft_name()}" if s.drafts else "",
        )  # fmt: skip
        progress("model loaded", 1.0)

    # ---- jobs ------------------------------------------------------------------------------------

    def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_ids)
        sampler = self._sampler(params)
        filters = self._json_filters(params)
        eos = [] if params.ignore_eos else self._eos_ids
        stop: list[Any] = [*params.stop, *params.stop_token_ids, *eos]
        job = self._exl.Job(
            input_ids=self._torch.tensor([prompt_ids], dtype=self._torch.long),
            max_new_tokens=completion_budget(n, params, self.max_seq_len),
            min_new_tokens=params.min_tokens,
            sampler=sampler,
            seed=params.seed,
            stop_conditions=list(dict.fromkeys(stop)),
            identifier=rid,
            filters=filters,
        )
        self._enqueue(rid, job, params, n)

    def _sampler(self, params: SamplingParams) -> Any:
        if params.typical_p not in (0.0, 1.0):
            raise RequestRejected(
                RejectCode.UNSUPPORTED_PARAMETER,
                "typical_p is not supported by the exllamav3 engine",
                "typical_p",
            )
        greedy = params.temperature < GREEDY_BELOW_TEMPERATURE  # near 0 overflows a sampler; it means greedy
        return self._exl.ComboSampler(
            rep_p=float(params.repetition_penalty),
            freq_p=float(params.frequency_penalty),
            pres_p=float(params.presence_penalty),
            temperature=0.0 if greedy else float(params.temperature),
            min_p=float(params.min_p),
            top_k=int(params.top_k),
            top_p=float(params.top_p),
            logit_bias={int(t): float(v) for t, v in params.logit_bias.items()} or None,
        )

    def _json_filters(self, params: SamplingParams) -> list[Any]:
        """The job's llguidance filter (exllamav3's constraint library) when it asks for JSON; it
        ends the job once the JSON is complete. RequestRejected for a schema llguidance refuses."""
        if not wants_json(params):
            return []
        if params.regex is not None:
            # llguidance takes Rust regex syntax: no lookaround, no backreferences.
            try:
                filter_ = self._exl.LLGuidanceFilter(
                    self.tokenizer, regex=params.regex, eos_after_completed=True
                )
            except ValueError as exc:
                reason = str(exc).strip().splitlines()[0][:200]
                message = f"the regular expression cannot be enforced: {reason}"
                raise RequestRejected(RejectCode.INVALID_RESPONSE_FORMAT, message, "regex") from None
            return [filter_]
        schema = params.json_schema if params.json_schema is not None else _ANY_OBJECT_SCHEMA
        try:
            parsed = json.loads(schema)
            if not isinstance(parsed, dict):
                raise ValueError("json_schema.schema must be a JSON object")
            # llguidance allows any run of whitespace between JSON tokens by default, and a model may
            # then never close the object; compact JSON unless the schema sets its own options.
            parsed.setdefault("x-guidance", {"whitespace_flexible": False})
            filter_ = self._exl.LLGuidanceFilter(self.tokenizer, json_schema=parsed, eos_after_completed=True)
            return [filter_]
        except ValueError as exc:  # json.JSONDecodeError included; llguidance: "Invalid grammar: ..."
            message = f"the JSON schema cannot be enforced: {str(exc).strip().splitlines()[0][:200]}"
            raise RequestRejected(RejectCode.INVALID_RESPONSE_FORMAT, message, "response_format") from None

    def _split_name(self) -> str:
        gpus = int(self._torch.cuda.device_count())
        if self.settings.tensor_parallel:
            return f"tensor-parallel over {gpus} GPUs ({self.settings.tp_backend})"
        return f"layers split over {gpus} GPUs" if gpus > 1 else "one GPU"

    def _check_result(self, result: dict[str, Any]) -> None:
        if result["stage"] == "error":
            # exllamav3 isolates a job that raised (non-finite logits: a kernel fault, it says);
            # CUDA state may be bad, so the worker stops and its supervisor restarts it.
            raise RuntimeError(f"exllamav3 job {result.get('identifier')} failed: {result.get('error')}")

    def _pages(self) -> tuple[int, int]:
        pages = self.generator.pagetable
        total = int(pages.max_pages)
        # Unreferenced pages are free to take; some still hold a reusable prompt prefix.
        return total, min(int(pages.num_unreferenced_pages()), total)

    def _page_size(self) -> int:
        from exllamav3.constants import PAGE_SIZE  # the library's fixed page, for every cache

        return int(PAGE_SIZE)

    def _close_generator(self) -> None:
        self.generator.close()  # releases its pages and any recurrent state

    # ---- reporting -------------------------------------------------------------------------------

    def info(self) -> EngineInfo:
        s = self.settings
        return EngineInfo(
            engine="exllamav3",
            engine_version=self._version,
            max_seq_len=self.max_seq_len,
            max_batch_size=s.max_batch_size,
            max_chunk_size=s.max_chunk_size,
            vocab_size=self.vocab_size,
            paged=True,
            devices=cuda_devices(),
            attention="triton-paged",
            cache_size=self.cache_size,
            cache_mode=s.cache_mode,
            draft=self.draft_name(),
            configured_max_batch_size=s.max_batch_size,
        )
