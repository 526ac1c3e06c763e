"""The transformers engine: any Hugging Face causal LM, on CPU or one GPU.

Runs in a worker process, driven by the serve loop's single thread. Owns the model, the tokenizer
and every job's KV cache (one `DynamicCache` per job). Its own decode loop runs each job's forward
pass separately (batch of one), deliberately: a job's numerics never depend on which other jobs
are running, so greedy output alone and under load is bit-identical. It is the engine for dev
hosts, CI and architectures exllamav2 lacks, not the fast path.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

from model_worker.devices import cuda_devices, gpu_memory_used_bytes
from model_worker.engines.base import ProgressCallback, TextCodec
from model_worker.engines.prompt_scoring import first_entry, score_rows
from model_worker.engines.structured_output import (
    JsonConstraint,
    build_parser,
    transformers_tokenizer_data,
    wants_json,
)
from model_worker.engines.token_bytes import partial_bytes_reader
from model_worker.engines.token_texts import TokenTexts
from model_worker.engines.transformers.codec import TokenizerCodec
from model_worker.engines.transformers.sampling import JobSampler
from model_worker.engines.transformers.settings import TransformersSettings
from model_worker.engines.validation import completion_budget
from model_worker.text_stream import IncrementalDetokenizer, StopStringMatcher
from wire.params import SamplingParams
from wire.results import FinishReason, JobOutput, TokenLogprob, Usage
from wire.stats import EngineInfo, EngineStats

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}  # fmt: skip
# Tries to find a token that completes no banned string; each try masks the token it refused.
_BAN_RETRIES = 64


@dataclass(eq=False)
class _Job:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    sampler: JobSampler
    detokenizer: IncrementalDetokenizer
    matcher: StopStringMatcher
    # prompt + generated ids, preallocated; the logits processors read a view of it.
    sequence: torch.Tensor
    submitted_at: float
    cache: Any = None
    prefilled: int = 0
    output_ids: list[int] = field(default_factory=list)
    admitted_at: float = 0.0
    first_token_at: float = 0.0


class TransformersEngine:
    def __init__(self, path: str, max_seq_len: int, settings: TransformersSettings) -> None:
        self.path = path
        self.max_seq_len = max_seq_len
        self.settings = settings
        self._model: Any = None
        self._tokenizer: Any = None
        self._codec: Any = None  # a TokenizerCodec once loaded
        self._device = torch.device("cpu")
        self._cache_kwarg = "past_key_values"
        self._vocab_size = 0
        self._end_ids: set[int] = set()
        self._json_data: Any = None  # lm-format-enforcer's tokenizer data, built for the first JSON job
        self._queue: OrderedDict[str, _Job] = OrderedDict()
        self._active: OrderedDict[str, _Job] = OrderedDict()
        self._steps = 0
        self._jobs_per_step = 0.0
        self._generated_tokens = 0
        self._prefilled_tokens = 0
        self._finished = 0
        self._cancelled = 0
        self._texts = TokenTexts(self.decode)

    # -- lifecycle -------------------------------------------------------------------------------

    def load(self, progress: ProgressCallback) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        # Progress goes to the gateway as Status messages; tqdm bars would only clutter worker logs.
        hf_logging.disable_progress_bar()
        if self.settings.threads:
            torch.set_num_threads(self.settings.threads)
        self._device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        path = self.path
        progress("loading weights", 0.0)
        config = AutoConfig.from_pretrained(path)
        dtype = self._resolve_dtype(config)
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        self._codec = TokenizerCodec(self._tokenizer)
        self._texts.read_partial_bytes(
            partial_bytes_reader(getattr(self._tokenizer, "backend_tokenizer", None))
        )
        placement: dict[str, Any] = {}
        if self._device.type == "cuda" and importlib.util.find_spec("accelerate") is not None:
            # Straight onto the GPU, so the host never holds a second copy of a large model.
            placement["device_map"] = str(self._device)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **placement)
        self._model = model.to(self._device).eval()  # type: ignore[arg-type]
        self._cache_kwarg = cache_keyword(type(self._model))
        progress("loading weights", 0.9)
        self._vocab_size = self._model.get_input_embeddings().num_embeddings
        self._end_ids = set()
        for ids in (self._tokenizer.eos_token_id, self._model.generation_config.eos_token_id):
            if ids is not None:
                self._end_ids.update([ids] if isinstance(ids, int) else ids)
        logger.info("loaded %s on %s as %s; end ids %s", path, self._device, dtype, sorted(self._end_ids))
        progress("loaded", 1.0)

    def _resolve_dtype(self, config: Any) -> torch.dtype:
        name = self.settings.dtype
        if name != "auto":
            if name not in _DTYPE_NAMES:
                raise ValueError(f"unknown dtype {name!r}; use auto or one of {sorted(_DTYPE_NAMES)}")
            return _DTYPE_NAMES[name]
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = _DTYPE_NAMES.get(dtype, torch.float32)
        # CPU float16 matmuls are emulated and very slow; float32 is faster and exact enough.
        if self._device.type == "cpu" and dtype == torch.float16:
            return torch.float32
        return dtype

    def close(self) -> None:
        self._queue.clear()
        self._active.clear()
        self._model = None
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def prefill_tokens(self) -> int:
        """Prompt tokens its prefill chunks have read."""
        return self._prefilled_tokens

    def cached_prompt_tokens(self) -> int:
        """Always 0: this engine keeps no prefix cache between jobs."""
        return 0

    def stats(self) -> EngineStats:
        held = sum(job.cache.get_seq_length() for job in self._active.values() if job.cache is not None)
        capacity = self.settings.max_batch_size * self.max_seq_len
        return EngineStats(
            active_jobs=len(self._active),
            queued_jobs=len(self._queue),
            steps=self._steps,
            generated_tokens=self._generated_tokens,
            jobs_finished=self._finished,
            jobs_cancelled=self._cancelled,
            jobs_per_step=round(self._jobs_per_step, 3),
            # Tokens held in the per-job KV caches over what max_batch_size x max_seq_len allows.
            kv_cache_usage_ratio=min(round(held / capacity, 4), 1.0) if capacity else 0.0,
            gpu_memory_used_bytes=gpu_memory_used_bytes() if self._device.type == "cuda" else {},
        )

    def info(self) -> EngineInfo:
        devices = cuda_devices() if self._device.type == "cuda" else []  # GPUs only; none on a CPU
        return EngineInfo(
            engine="transformers",
            engine_version=transformers.__version__,
            max_seq_len=self.max_seq_len,
            max_batch_size=self.settings.max_batch_size,
            max_chunk_size=self.settings.max_chunk_size,
            vocab_size=self._vocab_size,
            paged=False,
            devices=devices,
            attention=str(getattr(getattr(self._model, "config", None), "_attn_implementation", "") or ""),
            dtype=str(self._model.dtype).removeprefix("torch.") if self._model is not None else "",
            configured_max_batch_size=self.settings.max_batch_size,
        )

    # -- tokenizer -------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._codec.encode(text, add_special_tokens)  # type: ignore[no-any-return]

    def decode(self, token_ids: list[int]) -> str:
        return self._codec.decode(token_ids)  # type: ignore[no-any-return]

    def text_codec(self) -> TextCodec:
        return self._codec.copy()  # type: ignore[no-any-return]

    # -- jobs ------------------------------------------------------------------------------------

    def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        prompt_tokens = len(prompt_ids)
        max_tokens = completion_budget(prompt_tokens, params, self.max_seq_len)
        sequence = torch.zeros((1, prompt_tokens + max_tokens), dtype=torch.long, device=self._device)
        sequence[0, :prompt_tokens] = torch.tensor(prompt_ids, dtype=torch.long)
        constraint = None
        if wants_json(params):
            parser = build_parser(params)  # before the slow tokenizer data: a bad schema fails fast
            constraint = JsonConstraint(self._json_tokenizer_data(), parser, rid)
        end_ids = set() if params.ignore_eos else set(self._end_ids)
        self._queue[rid] = _Job(
            rid=rid,
            prompt_ids=list(prompt_ids),
            params=params,
            max_tokens=max_tokens,
            sampler=JobSampler(
                params,
                prompt_tokens,
                self._vocab_size,
                end_ids | set(params.stop_token_ids),
                self._device,
                constraint,
                bad_words_ids=self._bad_words_ids(params.bad_words),
            ),
            detokenizer=IncrementalDetokenizer(self.decode, prompt_ids),
            matcher=StopStringMatcher(params.stop),
            sequence=sequence,
            submitted_at=time.monotonic(),
        )
        self._admit()

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's bad_words: each word's token sequence, alone and after a space (as in a sentence)."""
        sequences = {
            tuple(self.encode(text, add_special_tokens=False)) for w in words for text in (w, " " + w)
        }
        return [list(ids) for ids in sequences if ids]

    def prompt_logprobs(self, prompt_ids: list[int], top: int) -> list[TokenLogprob]:
        """One pass over the prompt in max_chunk_size pieces with its own cache; each piece's logits
        score the tokens that follow it, so the [prompt x vocabulary] matrix never exists whole."""
        from transformers import DynamicCache

        entries = [first_entry(prompt_ids[0], self._texts)]
        cache = DynamicCache(config=self._model.config)
        chunk = self.settings.max_chunk_size
        scored = len(prompt_ids) - 1  # the last token scores nothing that is part of the prompt
        with torch.inference_mode():
            for start in range(0, scored, chunk):
                end = min(start + chunk, scored)
                input_ids = torch.tensor([prompt_ids[start:end]], dtype=torch.long, device=self._device)
                positions = torch.arange(start, end, device=self._device).unsqueeze(0)
                out = self._model(
                    input_ids=input_ids, position_ids=positions, use_cache=True, **{self._cache_kwarg: cache}
                )
                logprobs = torch.log_softmax(out.logits[0].float(), dim=-1)
                entries += score_rows(logprobs, prompt_ids[start + 1 : end + 1], top, self._texts)
        return entries

    def prepare_constraints(self) -> None:
        """Build the constraint tokenizer data ahead (called once, on a thread beside the serve loop)."""
        self._json_tokenizer_data()

    def _json_tokenizer_data(self) -> Any:
        if self._json_data is None:
            started = time.monotonic()
            # Only ids that both the tokenizer and the model's logits have may ever be allowed.
            vocab_size = min(len(self._tokenizer), self._vocab_size)
            self._json_data = transformers_tokenizer_data(self._tokenizer, vocab_size, self._end_ids)
            logger.info("structured output: tokenizer data built in %.2fs", time.monotonic() - started)
        return self._json_data

    def cancel(self, rid: str) -> bool:
        job = self._queue.pop(rid, None) or self._active.pop(rid, None)
        if job is None:
            return False
        job.cache = None  # drop the only reference: the KV tensors are freed now, not at the next step
        self._cancelled += 1
        return True

    def has_work(self) -> bool:
        return bool(self._queue or self._active)

    def _admit(self) -> None:
        from transformers import DynamicCache

        while self._queue and len(self._active) < self.settings.max_batch_size:
            rid, job = self._queue.popitem(last=False)
            job.cache = DynamicCache(config=self._model.config)
            job.admitted_at = time.monotonic()
            self._active[rid] = job

    # -- the decode loop -------------------------------------------------------------------------

    def step(self) -> list[JobOutput]:
        self._admit()
        if not self._active:
            return []
        self._jobs_per_step += (len(self._active) - self._jobs_per_step) * 0.05  # ~20-step moving average
        outputs: list[JobOutput] = []
        finished: list[str] = []
        chunk = self.settings.max_chunk_size
        with torch.inference_mode():
            for job in list(self._active.values()):
                prompt_len = len(job.prompt_ids)
                if job.prefilled < prompt_len:
                    # Bounded prefill chunks keep other jobs decoding while a long prompt is read.
                    ids = job.prompt_ids[job.prefilled : job.prefilled + chunk]
                    logits = self._forward(job, ids, job.prefilled)
                    job.prefilled += len(ids)
                    self._prefilled_tokens += len(ids)
                    if job.prefilled < prompt_len:
                        continue
                else:
                    position = prompt_len + len(job.output_ids) - 1
                    logits = self._forward(job, job.output_ids[-1:], position)
                output = self._advance(job, logits)
                outputs.append(output)
                if output.finish_reason is not None:
                    finished.append(job.rid)
        for rid in finished:
            job = self._active.pop(rid)
            job.cache = None
            self._finished += 1
        self._steps += 1
        return outputs

    def _forward(self, job: _Job, ids: list[int], start: int) -> torch.Tensor:
        input_ids = torch.tensor([ids], dtype=torch.long, device=self._device)
        positions = torch.arange(start, start + len(ids), device=self._device).unsqueeze(0)
        out = self._model(
            input_ids=input_ids,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: job.cache},
        )
        logits: torch.Tensor = out.logits[:, -1, :].float()
        return logits

    def _advance(self, job: _Job, logits: torch.Tensor) -> JobOutput:
        """Sample one token for a job and turn it into this step's output."""
        params = job.params
        now = time.monotonic()
        if not job.output_ids:
            job.first_token_at = now
        seq_len = len(job.prompt_ids) + len(job.output_ids)
        token = job.sampler.choose(job.sequence[:, :seq_len], logits)
        if params.banned_strings:
            token = self._avoid_banned_strings(job, job.sequence[:, :seq_len], logits, token)
        job.sequence[0, seq_len] = token
        job.output_ids.append(token)
        self._generated_tokens += 1
        count = len(job.output_ids)

        finish: FinishReason | None = None
        text = ""
        # A JSON job ends where the enforcer chose an end token, even under ignore_eos.
        ends = not params.ignore_eos or job.sampler.constraint is not None
        if token in params.stop_token_ids or (ends and token in self._end_ids):
            # The end token's own text is never shown; only what the tokens before it completed.
            finish = FinishReason.STOP
            text, _ = self._drain(job)
        else:
            delta = job.detokenizer.push([token])
            if count < params.min_tokens:
                # As in vLLM, stop strings only count once min_tokens have been generated.
                text = delta
            else:
                text, stopped = job.matcher.feed(delta)
                finish = FinishReason.STOP if stopped else None
            if finish is None and count >= job.max_tokens:
                tail, stopped = self._drain(job)
                text += tail
                finish = FinishReason.STOP if stopped else FinishReason.LENGTH
            if finish is FinishReason.STOP and params.include_stop_str_in_output:
                text += job.matcher.hit

        logprobs = None
        if params.logprobs is not None:
            logprobs = [self._logprobs(logits, token, params.logprobs)]
        usage = None
        if finish is not None:
            usage = Usage(
                prompt_tokens=len(job.prompt_ids),
                completion_tokens=count,
                queue_s=job.admitted_at - job.submitted_at,
                prefill_s=job.first_token_at - job.admitted_at,
                decode_s=now - job.first_token_at,
            )
        return JobOutput(job.rid, text, [token], finish, usage, logprobs)

    def _avoid_banned_strings(
        self, job: _Job, sequence: torch.Tensor, logits: torch.Tensor, token: int
    ) -> int:
        """Choose again while the token would complete a banned string (case-insensitive, as in
        exllamav2). Only text ending in the new token needs checking: earlier text passed before."""
        banned = [s.lower() for s in job.params.banned_strings]
        context = job.output_ids[-max(len(s) for s in banned) :]
        for _ in range(_BAN_RETRIES):
            text = self.decode([*context, token]).lower()
            if not any(s in text for s in banned):
                return token
            logits = logits.clone()
            logits[0, token] = float("-inf")
            token = job.sampler.choose(sequence, logits)
        return token

    @staticmethod
    def _drain(job: _Job) -> tuple[str, bool]:
        """Text still held back at the end of a job, cut at a stop string if one completes in it."""
        text, stopped = job.matcher.feed(job.detokenizer.flush())
        return (text, True) if stopped else (text + job.matcher.flush(), False)

    def _logprobs(self, logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
        logprobs = torch.log_softmax(logits[0], dim=-1)
        alternatives: list[tuple[int, float]] = []
        if top > 0:
            values, indices = torch.topk(logprobs, min(top, logprobs.shape[-1]))
            alternatives = list(zip(indices.tolist(), values.tolist(), strict=True))
        return self._texts.entry(token, float(logprobs[token]), alternatives)


def cache_keyword(model_class: type[torch.nn.Module]) -> str:
    """The name under which this model's forward takes its KV cache: transformers 5.24 renamed
    `past_key_values` to `cache` (the old name warns, and goes in 5.40); older releases know only
    the old one."""
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
