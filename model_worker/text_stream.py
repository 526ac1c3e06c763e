"""Streaming text helpers for engines: token ids -> text deltas, and stop-string matching.

Runs in a worker process, inside an engine, one instance per job. Owns no tokenizer and no model;
the detokenizer is handed a decode function. Both classes are pure and cheap per step: the
detokenizer decodes a window of a few tokens, not the whole sequence, and the matcher keeps at most
the longest stop string's worth of text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# Tokens of the prompt tail used as decode context, so the first generated token decodes with the
# spacing it has in context (SentencePiece drops a leading space on a sequence's first token).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas, vLLM-style (prefix offset / read offset).

    Each push decodes only ids[prefix_offset:]: the text of ids[prefix_offset:read_offset] was
    already emitted and serves as context, and the new text is what the window adds beyond it.
    While the window's text ends in U+FFFD (a multi-byte character split across tokens), nothing is
    emitted and the offsets stay put until the character is complete.
    """

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, new_ids: Sequence[int]) -> str:
        """Add token ids; return the text they complete (possibly empty)."""
        self._ids.extend(new_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of a job: whatever is still held back, incomplete characters included."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]


class StopStringMatcher:
    """Finds stop strings in streamed text without ever emitting part of one.

    Any suffix of the text seen so far that could still grow into a stop string is held back.
    Because every such suffix is held, a stop string can never start inside text already emitted,
    so searching the held text plus the new delta is enough.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = [s for s in stop if s]
        self._held = ""
        self.hit = ""  # the stop string found, once one was (include_stop_str_in_output adds it back)

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit). After a hit, feed no more."""
        if not self._stop:
            return delta, False
        text = self._held + delta
        hits = [(i, s) for i, s in ((text.find(s), s) for s in self._stop) if i >= 0]
        if hits:
            self._held = ""
            first, self.hit = min(hits, key=lambda hit: hit[0])
            return text[:first], True
        keep = self._partial_suffix_len(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back text, for a job that ends for another reason (length, EOS, cancel)."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
