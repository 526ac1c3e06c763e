"""What the two exllama engines share: a dynamic generator driven one `iterate()` at a time.

Runs in a worker process, on the serve loop's engine thread. Owns the map from request id to the
generator's job, the tokenizer calls, cancelling, the step that turns the generator's result
dictionaries into JobOutputs, the counters behind `stats()`, and closing. Each engine's own module
keeps what differs: loading, how a job is built (sampler, filters, extensions), how its page
table is read, and its result quirks (exllamav3's error stage, exllamav2's stop strings), through
the small hooks below. torch and the engine library are bound by the subclass's `load()`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from model_worker.devices import gpu_memory_used_bytes
from model_worker.engines.base import RequestRejected, TextCodec
from model_worker.engines.generator_results import PartialOutput, TakeEntries, add_tokens, finish
from model_worker.engines.gpu_logprobs import StepLogprobs
from model_worker.engines.prompt_tokenizer import hugging_face_tokenizer, releasing_copy
from model_worker.engines.token_bytes import partial_bytes_reader
from model_worker.engines.token_texts import TokenTexts
from wire.params import SamplingParams
from wire.results import JobOutput, RejectCode
from wire.stats import EngineStats


@dataclass
class GeneratorJob:
    job: Any  # the library's job object
    prompt_tokens: int
    take: TakeEntries | None  # its logprob entries, when it asked for logprobs
    include_stop_str: bool = False
    ingested: int = 0  # prompt tokens its library's last prefill report said it had ingested
    started: bool = False  # its first token came: its prompt tokens found in the cache are counted


# exllamav3 encodes a text this long in chunks, with TOKENIZERS_PARALLELISM switched on in
# os.environ for the call and then restored or deleted: two such calls at once on different threads
# could delete it twice (a KeyError that would end the worker), so they take turns.
LONG_TEXT_CHARS = 32_768
_LONG_ENCODES = threading.Lock()


class LibraryCodec:
    """encode/decode through an exllama library tokenizer (the engine's, or the copy the prompt
    threads share: `serial_long_texts` makes their encodes of long texts take turns)."""

    def __init__(self, tokenizer: Any, torch: Any, serial_long_texts: bool = False) -> None:
        self.tokenizer, self.torch = tokenizer, torch
        self._serial_long_texts = serial_long_texts

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._serial_long_texts and len(text) >= LONG_TEXT_CHARS:
            with _LONG_ENCODES:  # short texts still encode beside a long one
                return self._encode(text, add_special_tokens)
        return self._encode(text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # Chat templates put special tokens in the text; they must become their ids, not text.
        ids = self.tokenizer.encode(text, add_bos=add_special_tokens, encode_special_tokens=True)
        return [int(t) for t in ids[0].tolist()]

    def decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return str(self.tokenizer.decode(self.torch.tensor(token_ids, dtype=self.torch.long)))


class DynamicGeneratorEngine:
    """The shared half of ExLlamaV2Engine and ExLlamaV3Engine; not an engine on its own."""

    # Batch sizes for which the library builds something of its own the first time it steps one.
    SHAPED_BATCH_SIZES: ClassVar[range] = range(0)

    def __init__(self, path: str, max_seq_len: int, settings: Any) -> None:
        self.path = path
        self.max_seq_len = max_seq_len
        self.settings = settings
        self._jobs: dict[str, GeneratorJob] = {}
        self._exl: Any = None  # the engine library and torch, bound in load()
        self._torch: Any = None
        self.generator: Any = None
        self.model: Any = None
        self.cache: Any = None
        self.tokenizer: Any = None
        self._codec: LibraryCodec | None = None  # the engine's own, over self.tokenizer
        self.draft_model: Any = None
        self.draft_cache: Any = None
        self.vocab_size = 0
        self._eos_ids: list[int] = []
        self._pieces: list[str] = []
        self._logprobs: StepLogprobs | None = None
        self._jobs_per_step = 0.0
        self._counters = {"steps": 0, "tokens": 0, "finished": 0, "cancelled": 0, "prefill_tokens": 0,
                          "cached_prompt_tokens": 0}  # fmt: skip
        self._page_tokens = 0  # tokens per cache page, read from the library on first use
        self._texts = TokenTexts(self.decode)

    def warmup_batches(self) -> list[int]:
        """Those of `SHAPED_BATCH_SIZES` below the largest batch, then the largest batch, whose
        prompts the warm-up makes fill more than one prefill chunk."""
        largest = self.settings.max_batch_size
        if largest < 2:
            return []
        return [*(size for size in self.SHAPED_BATCH_SIZES if 1 < size < largest), largest]

    def prefill_chunk_tokens(self) -> int:
        return int(self.settings.max_chunk_size)

    def prefill_tokens(self) -> int:
        """From the libraries' "prefill" results (their progress over the job's prompt); a prefix
        they found in their cache counts in the job's first report."""
        return self._counters["prefill_tokens"]

    def cached_prompt_tokens(self) -> int:
        """Prompt tokens the library found in its cache (whole pages and a partial match), counted
        when each job's first token comes: a part of `prefill_tokens`, which were not computed."""
        return self._counters["cached_prompt_tokens"]

    def _found_in_cache(self, job: Any) -> int:
        # Both libraries count a job's reused pages and, beside them, tokens of a partly matched page.
        if not self._page_tokens:
            self._page_tokens = self._page_size()
        return int(job.cached_pages) * self._page_tokens + int(job.cached_tokens)

    # ---- hooks for each engine -------------------------------------------------------------------

    def _check_result(self, result: dict[str, Any]) -> None:
        """Raise for a result that means the worker must stop (none by default)."""

    def _finish_text(self, result: dict[str, Any], state: GeneratorJob) -> str:
        """Text a finished job adds after its last tokens (none by default)."""
        return ""

    def _pages(self) -> tuple[int, int]:
        """(total, free) pages of the generator's cache."""
        raise NotImplementedError

    def _page_size(self) -> int:
        """Tokens per page of the generator's cache."""
        raise NotImplementedError

    def _close_generator(self) -> None:
        """Release what the generator holds beyond the models (nothing by default)."""

    # ---- tokens ----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._library_codec().encode(text, add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return self._library_codec().decode(token_ids)

    def _read_partial_bytes(self) -> None:
        """Once the tokenizer is loaded: logprobs carry the bytes of tokens that are part of a character."""
        self._texts.read_partial_bytes(partial_bytes_reader(hugging_face_tokenizer(self.tokenizer)))

    def _library_codec(self) -> LibraryCodec:
        # Made once, after load() bound the tokenizer: decode runs for every streamed token.
        if self._codec is None:
            self._codec = LibraryCodec(self.tokenizer, self._torch)
        return self._codec

    def text_codec(self) -> TextCodec:
        # A shallow copy, not a second tokenizer (that would rebuild every piece table), shared by
        # the prompt threads: encode and decode change no tokenizer state (exllamav3's long-text
        # switch of os.environ aside, see LONG_TEXT_CHARS), and the copy lets the GIL go while it
        # encodes.
        return LibraryCodec(releasing_copy(self.tokenizer), self._torch, serial_long_texts=True)

    def draft_name(self) -> str:
        s = self.settings
        return "ngram" if s.ngram_draft else (Path(s.draft_path).name if s.draft_path else "")

    # ---- jobs ------------------------------------------------------------------------------------

    def _enqueue(self, rid: str, job: Any, params: SamplingParams, prompt_tokens: int) -> None:
        """Hand a built job to the generator and track it; RequestRejected if it cannot fit."""
        try:
            self.generator.enqueue(job)
        except AssertionError as exc:  # both libraries check the fit with asserts, before changing state
            message = f"the job does not fit the cache: {exc}"
            raise RequestRejected(RejectCode.CONTEXT_LENGTH_EXCEEDED, message) from None
        take = None
        if params.logprobs is not None:
            assert self._logprobs is not None
            self._logprobs.add_job(rid, params.logprobs, prompt_tokens)
            logprobs = self._logprobs
            take = lambda count: logprobs.take(rid, count)  # noqa: E731
        self._jobs[rid] = GeneratorJob(job, prompt_tokens, take, params.include_stop_str_in_output)

    def cancel(self, rid: str) -> bool:
        state = self._jobs.pop(rid, None)
        if state is None:
            return False
        if self._logprobs is not None:
            self._logprobs.drop_job(rid)
        # A job that finished inside the last iterate() is no longer the generator's to cancel.
        if state.job in self.generator.pending_jobs or state.job in self.generator.active_jobs:
            self.generator.cancel(state.job)  # releases its pages
            self._counters["cancelled"] += 1
            return True
        return False

    def step(self) -> list[JobOutput]:
        active = len(self.generator.active_jobs)
        results = self.generator.iterate()  # an exception here is fatal for the worker: let it rise
        self._counters["steps"] += 1
        # How well batching is used: a moving average over the last ~20 steps.
        self._jobs_per_step += (active - self._jobs_per_step) * 0.05
        if self._logprobs is not None and self._logprobs.active:
            self._logprobs.after_step({rid: state.job for rid, state in self._jobs.items()})
        merged: dict[str, PartialOutput] = {}
        for result in results:
            self._check_result(result)
            state = self._jobs.get(str(result.get("identifier")))
            if result["stage"] == "prefill" and state is not None:
                progress = int(result.get("curr_progress", 0))
                self._counters["prefill_tokens"] += max(progress - state.ingested, 0)
                state.ingested = progress
            if result["stage"] != "streaming" or state is None:
                continue
            if not state.started:
                state.started = True
                self._counters["cached_prompt_tokens"] += self._found_in_cache(state.job)
            rid = result["identifier"]
            part = merged.setdefault(rid, PartialOutput(logprobs=None if state.take is None else []))
            add_tokens(part, result, self._texts, state.take)
            if result["eos"]:
                finish(part, result, state.prompt_tokens, self._pieces, self._texts, state.take)
                part.text += self._finish_text(result, state)
                self._counters["finished"] += 1
                del self._jobs[rid]
                if self._logprobs is not None:
                    self._logprobs.drop_job(rid)
        outputs = []
        for rid, part in merged.items():
            if part.token_ids or part.text or part.finish_reason:
                self._counters["tokens"] += len(part.token_ids)
                outputs.append(JobOutput(rid, part.text, part.token_ids, part.finish_reason, part.usage,
                                         part.logprobs))  # fmt: skip
        return outputs

    def has_work(self) -> bool:
        return self.generator is not None and self.generator.num_remaining_jobs() > 0

    # ---- reporting -------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        generator = self.generator
        if generator is None:
            return EngineStats()
        total_pages, free_pages = self._pages()
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

    def close(self) -> None:
        for rid in list(self._jobs):
            self.cancel(rid)
        if self.generator is not None:
            self._close_generator()
        for model in (self.model, self.draft_model):
            if model is not None:
                model.unload()
        self.generator = self.cache = self.draft_cache = self.model = self.draft_model = None
        if self._torch is not None:
            self._torch.cuda.empty_cache()
