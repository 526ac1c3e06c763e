"""The OpenAI response formatter: chat and completions, streamed and not, with echo, logprobs and n."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.http.openai_format import SSE_DONE, ResponseFormatter, completion_logprobs, sse_error
from gateway.serving.choice import Choice
from gateway.serving.outputs import ChoiceInput
from wire.params import SamplingParams
from wire.results import FinishReason, JobOutput, TokenLogprob, TopLogprob, Usage


def choice(index: int, echo: str = "") -> Choice:
    return Choice(None, index, ChoiceInput(prompt=echo or "p", echo=echo), SamplingParams())  # type: ignore[arg-type]


def entry(text: str, token_id: int, logprob: float, *top: tuple[str, int, float]) -> TokenLogprob:
    return TokenLogprob(text, token_id, logprob, [TopLogprob(*t) for t in top])


def decode(chunk: bytes) -> dict[str, Any]:
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
    return json.loads(chunk[6:])  # type: ignore[no-any-return]


# One choice's outputs, as a worker sends them: two tokens, then the last with usage.
OUTPUTS = [
    JobOutput("r", "Hel", [10], logprobs=[entry("Hel", 10, -0.5, ("Hel", 10, -0.5), ("Hi", 11, -1.5))]),
    JobOutput("r", "", [12], logprobs=[entry("", 12, -2.0, ("", 12, -2.0), ("x", 13, -3.0))]),
    JobOutput("r", "lo", [14], FinishReason.STOP, Usage(5, 3, cached_tokens=2),
              [entry("lo", 14, -0.25, ("lo", 14, -0.25), ("w", 15, -2.5))]),
]  # fmt: skip


def feed(formatter: ResponseFormatter, chosen: Choice, with_usage: bool = False) -> list[bytes]:
    chunks = []
    for output in OUTPUTS:
        delta = chosen.text.take(output)[0]  # as the request owner turns each output into a Delta
        chosen.output.add(delta)  # the owner adds each Delta before the formatter sees it
        chunks.append(formatter.delta_chunk(chosen, delta, with_usage))
    return chunks


def test_chat_stream_shape_role_first_finish_last_and_usage_placeholders() -> None:
    formatter = ResponseFormatter("chatcmpl-1", "m", chat=True)
    first = [decode(c) for c in formatter.first_chunks([0], with_usage=True)]
    assert first[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]  # fmt: skip
    assert first[0]["object"] == "chat.completion.chunk" and first[0]["usage"] is None
    chunks = [decode(c) for c in feed(formatter, choice(0), with_usage=True)]
    assert [c["choices"][0]["delta"] for c in chunks] == [{"content": "Hel"}, {}, {"content": "lo"}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]
    assert all(c["usage"] is None for c in chunks)
    top = chunks[0]["choices"][0]["logprobs"]["content"][0]
    assert top == {"token": "Hel", "logprob": -0.5, "bytes": list(b"Hel"),
                   "top_logprobs": [{"token": "Hel", "logprob": -0.5, "bytes": list(b"Hel")},
                                    {"token": "Hi", "logprob": -1.5, "bytes": list(b"Hi")}]}  # fmt: skip


def test_an_output_with_nothing_to_say_sends_nothing() -> None:
    formatter = ResponseFormatter("cmpl-1", "m", chat=False)
    empty = JobOutput("r", "", [7])
    chosen = choice(0)
    assert formatter.delta_chunk(chosen, chosen.text.take(empty)[0], with_usage=False) == b""


def test_completions_echo_once_per_choice_and_offsets_follow_the_text() -> None:
    formatter = ResponseFormatter("cmpl-1", "m", chat=False)
    chunks = [decode(c) for c in feed(formatter, choice(0, echo="Say: "))]
    assert [c["choices"][0]["text"] for c in chunks] == ["Say: Hel", "", "lo"]
    offsets = [c["choices"][0]["logprobs"]["text_offset"] for c in chunks]
    assert offsets == [[5], [8], [8]]  # after the echo, then after "Hel"
    assert chunks[1]["choices"][0]["logprobs"]["top_logprobs"] == [{"": -2.0, "x": -3.0}]
    assert chunks[2]["choices"][0]["finish_reason"] == "stop" and chunks[0]["object"] == "text_completion"


def test_completion_top_logprobs_put_the_token_first_even_outside_the_top() -> None:
    # Scored with 2 alternatives (a prompt_logprobs of 2), echoed for a request with logprobs 1.
    prompt = [TokenLogprob("A", 1, None, []), entry("B", 2, -4.0, ("C", 3, -0.1), ("D", 4, -3.0)),
              entry("C", 3, -0.3, ("C", 3, -0.3), ("B", 2, -2.0))]  # fmt: skip
    sampled = [entry("x", 5, -3.0, ("y", 6, -0.2)), entry("y", 6, -0.2, ("y", 6, -0.2)), entry("z", 7, -1.0)]
    body = completion_logprobs(sampled, 2, prompt, prompt_top=1)
    # Every token, echoed or sampled, with its top alternatives: logprobs + 1 entries at most (the
    # first prompt token has no logprob); logprobs 0 leaves the token alone.
    assert body["top_logprobs"] == [None, {"B": -4.0, "C": -0.1}, {"C": -0.3},
                                    {"x": -3.0, "y": -0.2}, {"y": -0.2}, {"z": -1.0}]  # fmt: skip
    assert list(body["top_logprobs"][1]) == ["B", "C"] and list(body["top_logprobs"][3]) == ["x", "y"]
    assert completion_logprobs([], 0, prompt)["top_logprobs"] == [None, {"B": -4.0}, {"C": -0.3}]


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_text_equals_the_final_body(chat: bool) -> None:
    streamed_choice, whole_choice = choice(0, echo="" if chat else "E "), choice(0, echo="" if chat else "E ")
    formatter = ResponseFormatter("id", "m", chat=chat)
    chunks = [decode(c) for c in feed(formatter, streamed_choice)]
    for output in OUTPUTS:
        whole_choice.output.add(whole_choice.text.take(output)[0])
    body = formatter.final_body([whole_choice])
    if chat:
        streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert body["choices"][0]["message"] == {"role": "assistant", "content": streamed}
        assert len(body["choices"][0]["logprobs"]["content"]) == 3
    else:
        streamed = "".join(c["choices"][0]["text"] for c in chunks)
        assert body["choices"][0]["text"] == streamed == "E Hello"
        assert body["choices"][0]["logprobs"]["text_offset"] == [2, 5, 5]
        assert body["choices"][0]["logprobs"]["tokens"] == ["Hel", "", "lo"]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 2}}  # fmt: skip


def test_n_choices_share_their_prompt_in_usage_and_keep_their_indices() -> None:
    formatter = ResponseFormatter("id", "m", chat=True)
    choices = [choice(0), choice(1)]
    for index, text in ((0, "a"), (1, "bb")):
        chosen = choices[index]
        chosen.output.add(chosen.text.take(JobOutput("r", text, [1, 2], FinishReason.LENGTH, Usage(4, 2)))[0])
    body = formatter.final_body(choices)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "a", "length"), (1, "bb", "length")]  # fmt: skip
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 4
    usage = decode(formatter.usage_chunk([c.output for c in choices]))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 8


def test_usage_counts_each_prompt_once_whatever_n_and_their_lengths() -> None:
    formatter = ResponseFormatter("id", "m", chat=False)
    # Two prompts of the same length, n=2 each: choices 0, 1 answer prompt 0 and 2, 3 prompt 1.
    choices = [
        Choice(None, i, ChoiceInput(prompt=f"p{i // 2}", prompt_index=i // 2), SamplingParams())  # type: ignore[arg-type]
        for i in range(4)
    ]
    for chosen in choices:
        output = JobOutput("r", "x", [1], FinishReason.LENGTH, Usage(3, 1, cached_tokens=1))
        chosen.output.add(chosen.text.take(output)[0])
    usage = formatter.final_body(choices)["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (6, 4, 10)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 2}
    # Prompts of different lengths add up; a choice not accepted yet (0 tokens) takes its sibling's.
    choices[2].output.prompt_tokens, choices[3].output.prompt_tokens = 0, 5
    assert formatter.final_body(choices)["usage"]["prompt_tokens"] == 8


def test_error_event_and_done_framing() -> None:
    assert sse_error({"error": {"code": "x"}}) == b'event: error\ndata: {"error":{"code":"x"}}\n\n'
    assert SSE_DONE == b"data: [DONE]\n\n"


@pytest.mark.parametrize("stream", [True, False])
def test_tool_calls_are_read_from_the_answer_never_from_the_thinking(stream: bool) -> None:
    from gateway.reasoning.parsers import parser_named as reasoning_parser
    from gateway.reasoning.plan import ReasoningPlan
    from gateway.serving.choice_text import TextPlan
    from gateway.tools.parsers import parser_named as tool_parser
    from gateway.tools.plan import ToolPlan

    tools = ToolPlan("auto", parser=tool_parser("hermes"))
    formatter = ResponseFormatter("chatcmpl-1", "m", chat=True, tools=tools, reasoning=True)
    plan = TextPlan(reasoning=ReasoningPlan(reasoning_parser("deepseek_r1")))
    chosen = Choice(None, 0, ChoiceInput(prompt="p"), SamplingParams(), text_plan=plan)  # type: ignore[arg-type]
    # The model thinks about a call, markup and all, then answers in plain text.
    thought = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    outputs = [JobOutput("r", thought, [1]), JobOutput("r", "</think>", [2]),
               JobOutput("r", "It is sunny.", [3], FinishReason.STOP, Usage(5, 3))]  # fmt: skip
    chunks = []
    for output in outputs:
        delta = chosen.text.take(output)[0]  # as the request owner turns each output into a Delta
        chosen.output.add(delta)
        chunks.append(formatter.delta_chunk(chosen, delta, with_usage=False))
    if stream:
        deltas = [d["choices"][0]["delta"] for c in chunks if c for d in [decode(c)]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == thought
        assert "".join(d.get("content") or "" for d in deltas) == "It is sunny."
        assert not any("tool_calls" in d for d in deltas), deltas
        assert [decode(c)["choices"][0]["finish_reason"] for c in chunks if c][-1] == "stop"
    else:
        message = formatter.final_body([chosen])["choices"][0]
        assert message["message"]["reasoning_content"] == thought
        assert message["message"]["content"] == "It is sunny."
        assert not message["message"].get("tool_calls") and message["finish_reason"] == "stop"
