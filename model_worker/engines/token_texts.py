"""Token id -> text, cached, and the logprob entries engines put in their outputs.

Runs in the worker process, inside an engine. Owns a per-engine cache of single-token texts, so
logprobs with top alternatives decode each distinct id once rather than once per step, and of the
bytes of tokens that are part of a character (model_worker.engines.token_bytes), which their
entries carry beside the text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from model_worker.engines.token_bytes import PartialBytes, no_partial_bytes
from wire.results import TokenLogprob, TopLogprob

MAX_CACHED = 1 << 17


class TokenTexts:
    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._texts: dict[int, str] = {}
        self._partial_bytes: PartialBytes = no_partial_bytes
        self._raw: dict[int, bytes | None] = {}

    def read_partial_bytes(self, partial_bytes: PartialBytes) -> None:
        """From now on entries carry the bytes of tokens that are part of a character (the engine's
        tokenizer is loaded)."""
        self._partial_bytes = partial_bytes
        self._raw.clear()

    def raw(self, token_id: int) -> bytes | None:
        if token_id in self._raw:
            return self._raw[token_id]
        raw = self._partial_bytes(token_id)
        if len(self._raw) < MAX_CACHED:
            self._raw[token_id] = raw
        return raw

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._decode([token_id])
            if len(self._texts) < MAX_CACHED:
                self._texts[token_id] = text
        return text

    def entry(self, token_id: int, logprob: float, top: Iterable[tuple[int, float]]) -> TokenLogprob:
        alternatives = [TopLogprob(self(alt), alt, lp, self.raw(alt)) for alt, lp in top]
        return TokenLogprob(self(token_id), token_id, logprob, alternatives, raw=self.raw(token_id))
