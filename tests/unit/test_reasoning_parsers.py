"""Reasoning split from the answer as text streams in, however the text is cut into pieces."""

from __future__ import annotations

import pytest

from gateway.reasoning.parsers import ReasoningSplitter, parser_named

CASES = [
    # (model output, thinking, answer)
    ("Let me think.\n</think>\n\nThe answer is 4.", "Let me think.\n", "The answer is 4."),
    ("<think>\nStep one.</think>Four.", "\nStep one.", "Four."),  # a <think> the model writes itself
    ("  <think>a</think> b", "a", "b"),
    ("no end tag at all", "no end tag at all", ""),  # cut by max_tokens while thinking
    ("</think>only an answer", "", "only an answer"),
    ("a < b </thin and </think>x</think>", "a < b </thin and ", "x</think>"),  # only the first end counts
]


def split(text: str, cuts: list[int]) -> tuple[str, str]:
    splitter = ReasoningSplitter(parser_named("deepseek_r1"))
    thinking, answer = "", ""
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        t, a = splitter.feed(text[start:end])
        thinking, answer = thinking + t, answer + a
    t, a = splitter.flush()
    return thinking + t, answer + a


@pytest.mark.parametrize(("text", "thinking", "answer"), CASES)
def test_every_way_of_cutting_the_stream_splits_alike(text: str, thinking: str, answer: str) -> None:
    assert split(text, []) == (thinking, answer)
    for cut in range(1, len(text)):  # two pieces, at every position (tags split across them)
        assert split(text, [cut]) == (thinking, answer), cut
    assert split(text, list(range(1, len(text)))) == (thinking, answer)  # one character at a time


def test_a_tag_is_never_sent_in_pieces() -> None:
    splitter = ReasoningSplitter(parser_named("qwen3"))
    assert splitter.feed("hmm </th") == ("hmm ", "")  # "</th" may become the end tag: held
    assert splitter.feed("ink>\n\nYes") == ("", "Yes")
    assert not splitter.thinking


def test_closing_by_the_gateway_hands_over_what_was_held() -> None:
    splitter = ReasoningSplitter(parser_named("deepseek_r1"))
    assert splitter.feed("thinking </") == ("thinking ", "")
    assert splitter.close() == "</"  # what was held is thinking; what follows is the answer
    assert splitter.feed("\n\nAnswer") == ("", "Answer")


def test_qwen3_thinks_unless_the_template_switch_turns_it_off() -> None:
    qwen3, r1 = parser_named("qwen3"), parser_named("deepseek_r1")
    assert qwen3.thinks({}) and qwen3.thinks({"enable_thinking": True})
    assert not qwen3.thinks({"enable_thinking": False})
    assert r1.thinks({"enable_thinking": False})  # DeepSeek R1's template has no such switch
