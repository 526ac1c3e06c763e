"""Token id -> text, cached, and the logprob entries engines put in their outputs.

Runs in the worker process, inside an engine. Owns a per-engine cache of single-token texts, so
logprobs with top alternatives decode each distinct id once rather than once per step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from wire.results import TokenLogprob, TopLogprob

MAX_CACHED = 1 << 17


class TokenTexts:
    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._decode([token_id])
            if len(self._texts) < MAX_CACHED:
                self._texts[token_id] = text
        return text

    def entry(self, token_id: int, logprob: float, top: Iterable[tuple[int, float]]) -> TokenLogprob:
        return TokenLogprob(
            self(token_id), token_id, logprob, [TopLogprob(self(alt), alt, lp) for alt, lp in top]
        )
