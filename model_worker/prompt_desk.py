"""Prompts prepared on the worker's preparing threads, before the engine thread sees them.

Runs in the worker process, on its preparing threads (model_worker.prompt_threads), several at once.
Owns the work a Generate needs before an engine can take it, none of which touches the engine:
rendering chat messages with the model's template, tokenizing with a tokenizer the engine hands out
for another thread (`Engine.text_codec`), keeping only a prompt's last tokens when the request
says so (`truncate_prompt_tokens`), and the shared checks (engines.validation). A Generate
becomes a `PreparedJob`: its ids, or the rejection to answer it with; an Embed likewise becomes a
`PreparedEmbed`, its inputs tokenized and checked (empty, too long, ids out of range, not an
embedding model), so that the engine thread only runs them (model_worker.embedding_batch).
Tokenize and Detokenize are answered here outright. A long prompt or embedding text is tokenized
here while the engine keeps stepping every other job and the engine thread keeps its heartbeat.

What the preparing threads share and what each has its own: the chat template is shared (a Jinja2
template keeps no state between renders: each render has a context of its own), as are the checks
(pure functions). The tokenizer is shared where encoding and decoding change no state: the exllama
engines' copy (model_worker.engines.prompt_tokenizer), whose library code only reads, but for the
pattern of special tokens it compiles on first use (the same whichever thread does), over a Rust
tokenizer that `encode_batch` borrows shared, or a SentencePiece processor, which does not change
as it encodes (texts of 32,768 characters or more take turns there: exllamav3 switches an
environment variable around them, see model_worker.engines.dynamic_generator). A codec that can
copy itself (`CopiesForThreads`: the transformers engines', whose fast tokenizer may change its
Rust state inside a call and then raises "Already borrowed" beside another thread) gives each
thread a copy of its own, made ahead for `PREPARING_THREADS` threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from model_worker.chat_template import ChatTemplate
from model_worker.engines.base import RequestRejected, TextCodec
from model_worker.engines.validation import check_job
from model_worker.prompts import PromptBuilder
from wire import messages as wire
from wire.params import WorkerSpec
from wire.results import RejectCode
from wire.stats import EngineInfo

# How many threads prepare prompts at once (model_worker.prompt_threads starts that many): two long
# prompts being tokenized still leave one thread for the short requests that arrive behind them.
PREPARING_THREADS = 3


@runtime_checkable
class CopiesForThreads(Protocol):
    """A codec that is not to be shared between threads, and makes a copy of itself for another."""

    def copy(self) -> TextCodec: ...


@dataclass(frozen=True, slots=True)
class PreparedJob:
    """A Generate with its prompt's ids, or the reason it cannot run (exactly one is set)."""

    message: wire.Generate
    prompt_ids: list[int] | None
    rejection: RequestRejected | None = None


@dataclass(frozen=True, slots=True)
class PreparedEmbed:
    """An Embed with its inputs' ids, in order, or the reason it cannot run (exactly one is set)."""

    message: wire.Embed
    inputs: list[list[int]] | None
    rejection: RequestRejected | None = None


class PromptDesk:
    def __init__(
        self,
        codec: TextCodec,
        chat_template: ChatTemplate | None,
        spec: WorkerSpec,
        info: EngineInfo,
        supported: frozenset[str],
    ) -> None:
        self.codec, self.spec, self.info, self.supported = codec, spec, info, supported
        self._builders = _BuilderPerThread(codec, chat_template, spec.name)

    def prepare(self, msg: wire.Generate) -> PreparedJob:
        try:
            if self.spec.task == "embed":
                raise RequestRejected(
                    RejectCode.INVALID_REQUEST,
                    f"model '{self.spec.name}' is an embedding model; use /v1/embeddings",
                    "model",
                )
            prompt_ids = self._builders.mine().ids(msg.prompt, msg.prompt_token_ids, msg.messages, msg.chat)
            prompt_ids = last_tokens(prompt_ids, msg.params.truncate_prompt_tokens)
            check_job(prompt_ids, msg.params, self.info.max_seq_len, self.info.vocab_size, self.supported,
                      self.spec.engine, "messages" if msg.messages is not None else "prompt")  # fmt: skip
        except RequestRejected as exc:
            return PreparedJob(msg, None, exc)
        return PreparedJob(msg, prompt_ids)

    def prepare_embed(self, msg: wire.Embed) -> PreparedEmbed:
        try:
            if self.spec.task != "embed":
                raise RequestRejected(
                    RejectCode.INVALID_REQUEST, f"model '{self.spec.name}' is not an embedding model", "model"
                )
            inputs: list[list[int]] = []
            codec = self._builders.mine().codec
            cut = msg.truncate_prompt_tokens
            # Each input is checked as it is tokenized: a text that is too long refuses the request
            # before the texts after it cost the tokenizer anything.
            for text in msg.texts or []:
                ids = codec.encode(text, add_special_tokens=True)
                inputs.append(self._check_input(last_tokens(ids, cut)))
            for ids in msg.token_ids or []:
                inputs.append(self._check_input(last_tokens(list(ids), cut)))
        except RequestRejected as exc:
            return PreparedEmbed(msg, None, exc)
        return PreparedEmbed(msg, inputs)

    def _check_input(self, ids: list[int]) -> list[int]:
        limit, vocab = self.info.max_seq_len, self.info.vocab_size
        if not ids:
            raise RequestRejected(RejectCode.INVALID_PROMPT, "An input is empty.", "input")
        if len(ids) > limit:
            raise RequestRejected(
                RejectCode.CONTEXT_LENGTH_EXCEEDED,
                f"This model's maximum context length is {limit} tokens, however an input has "
                f"{len(ids)} tokens.",
                "input",
            )
        if any(not 0 <= t < vocab for t in ids):
            raise RequestRejected(RejectCode.INVALID_TOKENS, f"Token ids must be in [0, {vocab}).", "input")
        return ids

    def tokenize(self, msg: wire.Tokenize) -> wire.Tokens | wire.Rejected:
        builder = self._builders.mine()
        try:
            if msg.messages is not None:
                ids = builder.chat_ids(msg.messages, msg.chat)
            else:
                ids = builder.codec.encode(msg.prompt or "", add_special_tokens=msg.add_special_tokens)
        except RequestRejected as exc:
            return wire.Rejected(msg.rid, exc.code, exc.message, exc.param)
        return wire.Tokens(msg.rid, ids, "")

    def detokenize(self, msg: wire.Detokenize) -> wire.Tokens | wire.Rejected:
        vocab = self.info.vocab_size
        bad = [t for t in msg.token_ids if t < 0 or (vocab and t >= vocab)]
        if bad:
            message = f"token ids out of range: {bad[:5]}"
            return wire.Rejected(msg.rid, RejectCode.INVALID_TOKENS, message, "tokens")
        text = self._builders.mine().codec.decode(list(msg.token_ids))
        return wire.Tokens(msg.rid, list(msg.token_ids), text)


def last_tokens(ids: list[int], keep: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: a prompt's last `keep` tokens (None: all of them). The cut
    comes after the chat template and the special tokens, so it may drop a system prompt or a
    beginning-of-text token, as vLLM's does."""
    return ids if keep is None or len(ids) <= keep else ids[-keep:]


class _BuilderPerThread:
    """The prompt builder of the calling thread: over the one codec where it may be shared, else
    over a codec of the thread's own (`PREPARING_THREADS` of them made ahead, on the thread that
    builds the desk, so that no request waits for a copy)."""

    def __init__(self, codec: TextCodec, chat_template: ChatTemplate | None, model_name: str) -> None:
        self._codec, self._template, self._model_name = codec, chat_template, model_name
        self._shared: PromptBuilder | None = None
        self._spares: list[PromptBuilder] = []
        if isinstance(codec, CopiesForThreads):
            self._spares = [self._builder(codec)]
            self._spares += [self._builder(codec.copy()) for _ in range(PREPARING_THREADS - 1)]
        else:
            self._shared = self._builder(codec)
        self._lock = threading.Lock()  # several threads take spares
        self._local = threading.local()

    def _builder(self, codec: TextCodec) -> PromptBuilder:
        return PromptBuilder(codec, self._template, self._model_name)

    def mine(self) -> PromptBuilder:
        if self._shared is not None:
            return self._shared
        builder: PromptBuilder | None = getattr(self._local, "builder", None)
        if builder is None:
            with self._lock:
                spare = self._spares.pop() if self._spares else None
            if spare is None:  # more threads than were planned for (a test calling from its own)
                assert isinstance(self._codec, CopiesForThreads)
                spare = self._builder(self._codec.copy())
            builder = self._local.builder = spare
        return builder
