"""The bytes a token stands for where its text cannot say them: part of a multi-byte character.

Runs in the worker process, inside an engine (model_worker.engines.token_texts). Owns reading them
from a Hugging Face tokenizer's vocabulary. A token that holds whole characters decodes to its
text, and its bytes are that text's UTF-8. One that holds only part of a character (an emoji split
over three tokens) decodes to U+FFFD, whose bytes say nothing; OpenAI's logprobs give the token's
own bytes there, so that a client can join a character's pieces. Two vocabularies say them:
byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) writes each byte as one printable character
(transformers' `bytes_to_unicode`), and SentencePiece with byte fallback (Llama 2, Mistral) writes
a lone byte as `<0xNN>`. A vocabulary of neither kind gives no bytes, and the text's UTF-8 stands.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

PartialBytes = Callable[[int], bytes | None]


def no_partial_bytes(_token_id: int) -> bytes | None:
    return None


def partial_bytes_reader(tokenizer: Any) -> PartialBytes:
    """For a `tokenizers.Tokenizer`: token id -> its bytes when they are not valid UTF-8 (part of a
    character), else None. Anything else, or a decoder of another kind: always None."""
    pieces = _piece_bytes(tokenizer)
    if pieces is None:
        return no_partial_bytes

    def partial_bytes(token_id: int) -> bytes | None:
        piece = tokenizer.id_to_token(token_id)
        raw = pieces(piece) if piece is not None else None
        if raw is None:
            return None
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw
        return None

    return partial_bytes


def _piece_bytes(tokenizer: Any) -> Callable[[str], bytes | None] | None:
    kinds = _decoder_kinds(tokenizer)
    if "ByteLevel" in kinds:
        byte_of = _byte_level_table()
        if byte_of is None:
            return None

        def byte_level(piece: str) -> bytes | None:
            try:
                return bytes(byte_of[char] for char in piece)
            except KeyError:  # an added token, written as it is
                return None

        return byte_level
    if "ByteFallback" in kinds:

        def byte_fallback(piece: str) -> bytes | None:
            match = BYTE_PIECE.fullmatch(piece)
            return bytes([int(match.group(1), 16)]) if match else None

        return byte_fallback
    return None


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The types of the tokenizer's decoder and of those it chains (a Sequence)."""
    try:
        state = json.loads(tokenizer.decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):  # not a tokenizers.Tokenizer, or no decoder
        return set()
    kinds = {state.get("type")}
    for inner in state.get("decoders") or []:
        kinds.add(inner.get("type"))
    return {kind for kind in kinds if isinstance(kind, str)}


def _byte_level_table() -> dict[str, int] | None:
    try:
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:
        logger.debug("transformers' bytes_to_unicode is not importable: no partial bytes in logprobs")
        return None
    return {char: byte for byte, char in bytes_to_unicode().items()}
