"""The bytes of tokens that are part of a character, read from tokenizers' vocabularies: the demo
model's byte-level BPE, and a SentencePiece-style vocabulary with byte fallback built here."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models

from model_worker.engines.token_bytes import partial_bytes_reader
from model_worker.engines.token_texts import TokenTexts

EMOJI = "\U0001f60a"  # four bytes of UTF-8, which byte-level vocabularies split


@pytest.fixture(scope="module")
def byte_level(demo_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))


def test_the_pieces_of_a_split_character_give_its_bytes(byte_level: Tokenizer) -> None:
    ids = byte_level.encode(EMOJI, add_special_tokens=False).ids
    assert len(ids) > 1, "the emoji is one token in this vocabulary: nothing to test"
    partial = partial_bytes_reader(byte_level)
    pieces = [partial(i) for i in ids]
    assert all(piece is not None for piece in pieces), pieces
    assert b"".join(p for p in pieces if p is not None) == EMOJI.encode()
    assert all(byte_level.decode([i]) == "\ufffd" for i in ids)  # what their texts say instead


def test_whole_characters_give_none_their_text_says_them(byte_level: Tokenizer) -> None:
    partial = partial_bytes_reader(byte_level)
    whole = [byte_level.encode(text, add_special_tokens=False).ids for text in (" the", "\n", " a")]
    assert all(len(ids) == 1 for ids in whole), whole
    assert [partial(ids[0]) for ids in whole] == [None, None, None]
    assert partial(byte_level.token_to_id("<|im_start|>")) is None  # an added token


def test_byte_fallback_pieces_give_their_byte() -> None:
    vocab = {"<unk>": 0, "<0xF0>": 1, "<0x9F>": 2, "▁hi": 3, "<0x0A>": 4}
    sentencepiece = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    sentencepiece.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    partial = partial_bytes_reader(sentencepiece)
    assert [partial(i) for i in range(5)] == [None, b"\xf0", b"\x9f", None, None]


def test_a_tokenizer_of_another_kind_gives_none() -> None:
    assert partial_bytes_reader(None)(5) is None
    wordpiece = Tokenizer(models.WordPiece(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    assert partial_bytes_reader(wordpiece)(1) is None


def test_entries_carry_the_bytes_of_partial_tokens_only(byte_level: Tokenizer) -> None:
    texts = TokenTexts(lambda ids: byte_level.decode(ids))
    texts.read_partial_bytes(partial_bytes_reader(byte_level))
    first, second, *_ = byte_level.encode(EMOJI, add_special_tokens=False).ids
    whole = byte_level.encode(" the", add_special_tokens=False).ids[0]
    entry = texts.entry(first, -0.5, [(second, -1.0), (whole, -2.0)])
    assert entry.raw and EMOJI.encode().startswith(entry.raw)
    assert entry.top[0].raw and entry.top[1].raw is None
