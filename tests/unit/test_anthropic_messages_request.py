"""The Messages request's translation into a chat request, and the message body of an answer.

Runs in the pytest process: the schema and the formatter as functions, no server (the same rules
through real HTTP and the anthropic SDK are in tests/integration/test_anthropic_messages.py).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.errors import InvalidRequest
from gateway.http.anthropic_format import MessagesFormatter
from gateway.http.anthropic_schemas import MessagesRequest
from gateway.serving.outputs import ChoiceOutput
from gateway.tools.plan import ToolPlan
from wire.results import FinishReason

ASK = {"role": "user", "content": "Hello"}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}


def _request(messages: list[dict[str, Any]], **fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": messages, **fields})


@pytest.mark.parametrize("empty", ["", []])
def test_an_empty_final_assistant_turn_asks_for_no_prefill(empty: str | list[Any]) -> None:
    chat = _request([ASK, {"role": "assistant", "content": empty}]).as_chat()
    assert [m.role for m in chat.messages] == ["user"]
    assert chat.add_generation_prompt and not chat.continue_final_message


@pytest.mark.parametrize(
    "messages",
    [[{"role": "user", "content": ""}], [ASK, {"role": "assistant", "content": []}, ASK]],
)
def test_any_other_empty_turn_is_refused(messages: list[dict[str, Any]]) -> None:
    with pytest.raises(InvalidRequest, match="must have non-empty content except for the optional final"):
        _request(messages).as_chat()


def test_a_tool_result_must_answer_the_turn_before() -> None:
    answered = [ASK, {"role": "assistant", "content": [CALL]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}]  # fmt: skip
    assert [m.role for m in _request(answered).as_chat().messages] == ["user", "assistant", "tool"]
    stray = [*answered[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}]
    with pytest.raises(
        InvalidRequest, match="unexpected `tool_use_id` found in `tool_result` blocks: toolu_9"
    ):
        _request(stray).as_chat()


@pytest.mark.parametrize(
    "next_turn",
    [ASK, {"role": "user", "content": [{"type": "text", "text": "Go on."}]},
     {"role": "assistant", "content": "Sunny."}],
)  # fmt: skip
def test_a_tool_use_is_answered_by_the_next_turn_anywhere_in_the_history(next_turn: dict[str, Any]) -> None:
    two_calls = {"role": "assistant", "content": [CALL, {**CALL, "id": "toolu_2"}]}
    answered = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"},
                                            {"type": "tool_result", "tool_use_id": "toolu_2"}]}  # fmt: skip
    later = [{"role": "assistant", "content": "Done."}, ASK]
    assert len(_request([ASK, two_calls, answered, *later]).as_chat().messages) == 6
    # Not the last turn: the history goes on after the turn that leaves the calls unanswered.
    unanswered = r"^messages\[1\]: `tool_use` ids were found without `tool_result` blocks immediately after"
    with pytest.raises(InvalidRequest, match=unanswered + r": toolu_1, toolu_2\."):
        _request([ASK, two_calls, next_turn, *later]).as_chat()
    partly = {"role": "user", "content": answered["content"][:1]}
    with pytest.raises(InvalidRequest, match=r"^messages\[1\]: .* immediately after: toolu_2\.") as refused:
        _request([ASK, two_calls, partly, *later]).as_chat()
    assert refused.value.status == 400 and refused.value.param == "messages"


@pytest.mark.parametrize(
    "fields", [{"max_tokens": True}, {"temperature": True}, {"stream": "true"}, {"top_p": "0.5"}]
)
def test_scalars_take_their_own_json_type_only(fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match=next(iter(fields))):
        _request([ASK], **fields)
    assert _request([ASK], temperature=1, timeout=5).temperature == 1.0  # an int is still a number


def test_an_empty_answer_has_no_content_blocks() -> None:
    output = ChoiceOutput(index=0, finish_reason=FinishReason.STOP)
    owner = SimpleNamespace(choices=[SimpleNamespace(output=output)])
    body = MessagesFormatter("m", ToolPlan("none")).body(owner)  # type: ignore[arg-type]
    assert body["content"] == [] and body["stop_reason"] == "end_turn"
