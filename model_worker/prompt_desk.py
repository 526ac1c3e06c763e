"""Prompts prepared on the worker's prompt thread, before the engine thread sees them.

Runs in the worker process, on the prompt thread (model_worker.link_thread). Owns the work a
Generate needs before an engine can take it, none of which touches the engine: rendering chat
messages with the model's template, tokenizing with a tokenizer the engine hands out for another
thread (`Engine.text_codec`), and the shared checks (engines.validation). A Generate becomes a
`PreparedJob`: its ids, or the rejection to answer it with. Tokenize and Detokenize are answered
here outright. A long prompt is tokenized here while the engine keeps stepping every other job.
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
