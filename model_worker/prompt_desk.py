"""Prompts prepared on the worker's prompt thread, before the engine thread sees them.

Runs in the worker process, on the prompt thread (model_worker.link_thread). Owns the work a
Generate needs before an engine can take it, none of which touches the engine: rendering chat
messages with the model's template, tokenizing with a tokenizer the engine hands out for another
thread (`Engine.text_codec`), and the shared checks (engines.validation). A Generate becomes a
`PreparedJob`: its ids, or the rejection to answer it with; an Embed likewise becomes a
`PreparedEmbed`, its inputs tokenized and checked (empty, too long, ids out of range, not an
embedding model), so that the engine thread only runs them (model_worker.embedding_batch).
Tokenize and Detokenize are answered here outright. A long prompt or embedding text is tokenized
here while the engine keeps stepping every other job and the engine thread keeps its heartbeat.
"""

from __future__ import annotations

from dataclasses import dataclass

from model_worker.chat_template import ChatTemplate
from model_worker.engines.base import RequestRejected, TextCodec
from model_worker.engines.validation import check_job
from model_worker.prompts import PromptBuilder
from wire import messages as wire
from wire.params import WorkerSpec
from wire.results import RejectCode
from wire.stats import EngineInfo


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
        self.prompts = PromptBuilder(codec, chat_template, spec.name)

    def prepare(self, msg: wire.Generate) -> PreparedJob:
        try:
            if self.spec.task == "embed":
                raise RequestRejected(
                    RejectCode.INVALID_REQUEST,
                    f"model '{self.spec.name}' is an embedding model; use /v1/embeddings",
                    "model",
                )
            prompt_ids = self.prompts.ids(msg.prompt, msg.prompt_token_ids, msg.messages, msg.chat)
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
            # Each input is checked as it is tokenized: a text that is too long refuses the request
            # before the texts after it cost the tokenizer anything.
            for text in msg.texts or []:
                inputs.append(self._check_input(self.codec.encode(text, add_special_tokens=True)))
            for ids in msg.token_ids or []:
                inputs.append(self._check_input(list(ids)))
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
        try:
            if msg.messages is not None:
                ids = self.prompts.chat_ids(msg.messages, msg.chat)
            else:
                ids = self.codec.encode(msg.prompt or "", add_special_tokens=msg.add_special_tokens)
        except RequestRejected as exc:
            return wire.Rejected(msg.rid, exc.code, exc.message, exc.param)
        return wire.Tokens(msg.rid, ids, "")

    def detokenize(self, msg: wire.Detokenize) -> wire.Tokens | wire.Rejected:
        vocab = self.info.vocab_size
        bad = [t for t in msg.token_ids if t < 0 or (vocab and t >= vocab)]
        if bad:
            message = f"token ids out of range: {bad[:5]}"
            return wire.Rejected(msg.rid, RejectCode.INVALID_TOKENS, message, "tokens")
        return wire.Tokens(msg.rid, list(msg.token_ids), self.codec.decode(list(msg.token_ids)))
