"""The exact bytes of the OpenAI SSE chunks: what `json.dumps(chunk, separators=(",", ":"),
ensure_ascii=False)` writes, whichever encoder the formatter uses for a part of it."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from gateway.http.openai_format import ResponseFormatter, json_bytes, plain_json_bytes
from gateway.serving.choice import Choice
from gateway.serving.outputs import ChoiceInput, ChoiceOutput, Delta
from gateway.tools.plan import plan_tools
from wire.params import SamplingParams
from wire.results import FinishReason, TokenLogprob, TopLogprob

# Quotes, backslashes, every control character, DEL, non-ASCII, astral and line separators.
AWKWARD = "".join(chr(c) for c in range(0x20)) + '"\\/\x7f é中\u2028\u2029\U0001f600'


def reference(chunk: bytes) -> bytes:
    """What the stdlib writes for the chunk's own content (dict order and float values survive)."""
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
    payload = json.loads(chunk[6:-2])
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def choice(index: int = 0, echo: str = "") -> Choice:
    return Choice(None, index, ChoiceInput(prompt=echo or "p", echo=echo), SamplingParams())  # type: ignore[arg-type]


def logprobs(text: str) -> list[TokenLogprob]:
    return [TokenLogprob(text, 7, -1e-05, [TopLogprob(text, 7, -1e-05), TopLogprob("x", 8, -12.5)])]


def events(chunks: bytes) -> list[bytes]:
    return [part + b"\n\n" for part in chunks.split(b"\n\n") if part]


def stream(formatter: ResponseFormatter, deltas: list[Delta], echo: str = "") -> list[bytes]:
    chosen = choice(echo=echo)
    out = []
    for delta in deltas:
        chosen.output.add(delta)
        out += events(formatter.delta_chunk(chosen, delta, formatter.with_usage, [chosen.output]))
    return out


DELTAS = [
    Delta(text="Hel", token_count=1),
    Delta(text=AWKWARD, token_count=1),
    Delta(reasoning="think " + AWKWARD, token_count=1),
    Delta(text="", token_count=1, logprobs=logprobs("")),
    Delta(text="lo", token_count=1, logprobs=logprobs("lo")),
    Delta(text="!", token_count=1, finish_reason=FinishReason.LENGTH),
]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("usage", ["none", "final", "continuous"])
def test_every_chunk_is_the_stdlib_encoding_of_itself(chat: bool, usage: str) -> None:
    formatter = ResponseFormatter(
        "id-" + AWKWARD, "model/é", chat=chat, with_usage=usage != "none",
        continuous_usage=usage == "continuous", reasoning=True, echo_logprobs=True, prompt_logprobs=True,
    )  # fmt: skip
    chunks = stream(formatter, DELTAS, echo="" if chat else "Say " + AWKWARD)
    assert len(chunks) == len(DELTAS)
    for chunk in chunks:
        assert chunk == reference(chunk)
    decoded = [json.loads(c[6:]) for c in chunks]
    fields = ["id", "object", "created", "model", "choices", *(["usage"] if usage != "none" else [])]
    assert all(list(d) == fields for d in decoded)
    assert decoded[0]["id"] == "id-" + AWKWARD and decoded[0]["model"] == "model/é"


def test_tool_call_chunks_are_the_stdlib_encoding_of_themselves() -> None:
    tools: Any = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    plan = plan_tools(tools, "auto", None, "m", "hermes")
    formatter = ResponseFormatter("id", "m", chat=True, tools=plan, with_usage=True)
    call = '<tool_call>{"name": "get", "arguments": {"q": ' + json.dumps(AWKWARD, ensure_ascii=False) + "}}"
    end = Delta(text="</tool_call>", finish_reason=FinishReason.STOP)
    deltas = [Delta(text="Hi " + AWKWARD), Delta(text=call), end]
    chunks = stream(formatter, deltas)
    assert chunks and any(b'"tool_calls"' in c for c in chunks)
    for chunk in chunks:
        assert chunk == reference(chunk)


def test_the_exact_bytes_of_a_text_chunk_and_a_logprob_chunk() -> None:
    formatter = ResponseFormatter("cmpl-1", "m", chat=False, with_usage=True)
    created = formatter.created
    head = f'data: {{"id":"cmpl-1","object":"text_completion","created":{created},"model":"m","choices":['
    deltas = [Delta(text='a"\n\x01é', token_count=1), Delta(text="b", logprobs=logprobs("b"))]
    text, lp = stream(formatter, deltas)
    assert text == (head + '{"index":0,"text":"a\\"\\n\\u0001é","logprobs":null,"finish_reason":null}],'
                    '"usage":null}\n\n').encode()  # fmt: skip
    assert lp == (head + '{"index":0,"text":"b","logprobs":{"tokens":["b"],"token_logprobs":[-1e-05],'
                  '"top_logprobs":[{"b":-1e-05,"x":-12.5}],"text_offset":[5]},"finish_reason":null}],'
                  '"usage":null}\n\n').encode()  # fmt: skip


def test_plain_json_matches_the_stdlib_on_every_code_point() -> None:
    text = "".join(chr(c) for c in range(sys.maxunicode + 1) if not 0xD800 <= c <= 0xDFFF)
    value = {"k" + text[:300]: [text, 1, -2, None, True, False, {"": ""}]}
    assert plain_json_bytes(value) == json_bytes(value)


def test_usage_chunk_and_first_chunks_keep_their_shape() -> None:
    formatter = ResponseFormatter("id", "m", chat=True, with_usage=True)
    for chunk in [*formatter.first_chunks([0, 1], True), formatter.usage_chunk([ChoiceOutput(0)])]:
        assert chunk == reference(chunk)
