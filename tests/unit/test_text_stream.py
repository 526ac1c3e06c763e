"""Unit tests for model_worker.text_stream: incremental detokenizing and stop-string matching."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from model_worker.text_stream import IncrementalDetokenizer, StopStringMatcher


def _byte_decode(ids: list[int]) -> str:
    """A tokenizer whose tokens are single bytes: the harshest case for split characters."""
    return bytes(ids).decode("utf-8", errors="replace")


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.push([token]) for token in ids]
    return [*deltas, detok.flush()]


def test_detokenizer_holds_back_split_characters() -> None:
    text = "naïve café → 日本 🙂!"
    deltas = _stream(IncrementalDetokenizer(_byte_decode), list(text.encode("utf-8")))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    # The four bytes of the emoji come out as one delta, on the step that completes it.
    assert "🙂" in deltas


def test_detokenizer_flush_emits_incomplete_tail() -> None:
    detok = IncrementalDetokenizer(_byte_decode)
    assert detok.push(list(b"ok ")) == "ok "
    assert detok.push(list("日".encode())[:2]) == ""
    assert detok.flush() == "\ufffd"


def test_detokenizer_uses_prompt_as_context_only() -> None:
    detok = IncrementalDetokenizer(_byte_decode, prompt_ids=list(b"the prompt "))
    assert detok.push(list(b"and")) == "and"
    assert detok.push(list(b" more")) == " more"


@pytest.fixture(scope="module")
def demo_tokenizer(demo_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))


def test_detokenizer_matches_full_decode_with_real_tokenizer(demo_tokenizer: Tokenizer) -> None:
    text = "Bread asks for time. Crème brûlée, 東京 and 🍞🧀 — then soup."
    ids = demo_tokenizer.encode(text, add_special_tokens=False).ids
    prompt_ids = demo_tokenizer.encode("Tell me:", add_special_tokens=True).ids

    def decode(token_ids: list[int]) -> str:
        return demo_tokenizer.decode(token_ids, skip_special_tokens=True)

    deltas = _stream(IncrementalDetokenizer(decode, prompt_ids), ids)
    assert "".join(deltas) == decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def _match(stop: list[str], deltas: list[str]) -> tuple[str, bool, str]:
    matcher = StopStringMatcher(stop)
    emitted = []
    for delta in deltas:
        text, stopped = matcher.feed(delta)
        emitted.append(text)
        if stopped:
            return "".join(emitted), True, ""
    return "".join(emitted), False, matcher.flush()


def test_stop_string_inside_one_delta() -> None:
    assert _match(["END"], ["hello END world"]) == ("hello ", True, "")


def test_stop_string_split_across_deltas_is_never_emitted() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("result: 42</") == ("result: 42", False)
    assert matcher.feed("ans") == ("", False)
    assert matcher.feed("wer> trailing") == ("", True)


def test_partial_match_that_fails_is_released() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go ST") == ("go ", False)
    assert matcher.feed("ART") == ("START", False)
    assert matcher.flush() == ""


def test_earliest_of_several_stop_strings_wins() -> None:
    assert _match(["world", "lo w"], ["hel", "lo wor", "ld"]) == ("hel", True, "")
    assert _match(["\n\n", "."], ["One", ". Two\n\n"]) == ("One", True, "")


def test_flush_returns_held_text_when_job_ends_otherwise() -> None:
    assert _match(["###"], ["title #", "#"]) == ("title ", False, "##")


def test_no_stop_strings_passes_text_through() -> None:
    matcher = StopStringMatcher(["", ""])
    assert matcher.feed("anything at all") == ("anything at all", False)
    assert matcher.flush() == ""


def test_stop_string_at_very_start() -> None:
    assert _match(["Q:"], ["Q", ": what"]) == ("", True, "")
