"""The exllama engines' tokenizer as the worker's prompt thread uses it: the GIL let go while it runs.

Imported in the worker process by model_worker.engines.dynamic_generator; used on the prompt
thread (model_worker.link_thread). Both exllama libraries wrap a Hugging Face `tokenizers.Tokenizer`
and call its `encode`, which holds the GIL for the whole tokenization: 140 ms for 200,000
characters, in which the engine thread cannot run a line of Python. `encode_batch` gives the same
encodings and lets the GIL go while it works. So the prompt thread gets a shallow copy of the
library's tokenizer whose Rust tokenizer is wrapped to encode through `encode_batch`; the engine's
own tokenizer is left as it is. A library whose tokenizer is not where this expects it is shared
unchanged instead (correct, only slower to stand beside).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

logger = logging.getLogger(__name__)

# Where each library keeps the Hugging Face tokenizer: exllamav3's Tokenizer.tokenizer, and
# exllamav2's ExLlamaV2Tokenizer.tokenizer_model.hf_tokenizer (absent for SentencePiece models).
_PATHS = (("tokenizer",), ("tokenizer_model", "hf_tokenizer"))


class ReleasingTokenizer:
    """A `tokenizers.Tokenizer` whose single-text encode runs through encode_batch."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def encode(self, sequence: Any, *args: Any, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        if isinstance(sequence, str) and not args and not kwargs:
            return self._inner.encode_batch([sequence], add_special_tokens=add_special_tokens)[0]
        return self._inner.encode(sequence, *args, add_special_tokens=add_special_tokens, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def hugging_face_tokenizer(library_tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` inside an exllama library tokenizer, or None (SentencePiece)."""
    from tokenizers import Tokenizer

    for path in _PATHS:
        inner = library_tokenizer
        for name in path:
            inner = getattr(inner, name, None)
        if isinstance(inner, Tokenizer):
            return inner
    return None


def releasing_copy(library_tokenizer: Any) -> Any:
    """A copy of an exllama library tokenizer that lets the GIL go while it encodes, or the
    tokenizer itself when its Hugging Face tokenizer is not where this expects it."""
    from tokenizers import Tokenizer

    for path in _PATHS:
        owners = [library_tokenizer]
        for name in path:
            owners.append(getattr(owners[-1], name, None))
        if isinstance(owners[-1], Tokenizer):
            copies = [copy.copy(owner) for owner in owners[:-1]]
            for holder, child, name in zip(
                copies, [*copies[1:], ReleasingTokenizer(owners[-1])], path, strict=True
            ):
                setattr(holder, name, child)
            return copies[0]
    logger.info(
        "this tokenizer is shared with the prompt thread as it is (it holds the GIL while it encodes)"
    )
    return library_tokenizer
