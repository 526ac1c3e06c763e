"""Chat completions and completions take each field's own JSON type, never a coerced one: `"n": "2"`,
`"max_tokens": true` or `"stream": "true"` is a 400 in OpenAI's shape naming the field, as on the
Responses and Messages routes (a whole number still fits a float field). logit_bias keys are ASCII
decimal token ids; chat's `reasoning` (OpenRouter's spelling), which nothing here honours, is refused
by name as `reasoning_effort` is.

Runs in the pytest process: the request schemas alone, and the app's test client for the 400's
shape (the body is refused before any worker is asked).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.config.registry import parse_registry
from gateway.errors import InvalidRequest
from gateway.http.app import create_app
from gateway.http.schemas import ChatCompletionRequest, CompletionRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "m", "prompt": "hi"}

# A value of the wrong JSON type for fields both surfaces share: lax pydantic would read each as a
# setting the client never chose (true as 1, "2" as 2, "0.5" as 0.5, 2.0 as 2).
SHARED_WRONG_TYPES = [
    ("max_tokens", True),
    ("max_tokens", "4"),
    ("max_tokens", 4.0),
    ("n", "2"),
    ("n", 2.0),
    ("n", True),
    ("best_of", "1"),
    ("seed", "7"),
    ("seed", 7.0),
    ("top_k", "5"),
    ("min_tokens", "1"),
    ("stream", "true"),
    ("stream", 1),
    ("ignore_eos", "false"),
    ("ignore_eos", 0),
    ("include_stop_str_in_output", "true"),
    ("temperature", "0.5"),
    ("temperature", True),
    ("top_p", "1"),
    ("min_p", "0.1"),
    ("typical_p", "0.9"),
    ("repetition_penalty", "1.1"),
    ("frequency_penalty", "0"),
    ("presence_penalty", False),
    ("timeout", "30"),
    ("prompt_logprobs", "1"),
    ("stop_token_ids", ["2"]),
    ("stop_token_ids", [2.0]),
    ("allowed_token_ids", [True]),
    ("logit_bias", {"12": "5"}),
    ("logit_bias", {"12": True}),
    ("stream_options", {"include_usage": "true"}),
    ("stream_options", {"continuous_usage_stats": 1}),
]
CHAT_WRONG_TYPES = [
    ("max_completion_tokens", True),
    ("max_completion_tokens", "8"),
    ("logprobs", "true"),
    ("logprobs", 1),
    ("top_logprobs", "2"),
    ("top_logprobs", 2.0),
    ("parallel_tool_calls", "false"),
    ("add_generation_prompt", "false"),
    ("continue_final_message", 1),
    ("echo", "false"),
    ("thinking_token_budget", "64"),
]
TEXT_WRONG_TYPES = [
    ("logprobs", "1"),
    ("logprobs", True),
    ("logprobs", 1.0),
    ("echo", "true"),
    ("prompt", [1.0, 2.0]),
    ("prompt", [[True]]),
]


Surface = type[ChatCompletionRequest | CompletionRequest]


def _refused_field(request_class: Surface, body: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as refused:
        request_class.model_validate(body)
    return str(refused.value.errors()[0]["loc"][0])


@pytest.mark.parametrize(("field", "value"), SHARED_WRONG_TYPES + CHAT_WRONG_TYPES)
def test_chat_refuses_a_value_of_the_wrong_json_type(field: str, value: Any) -> None:
    body = {**CHAT, field: value}
    if field == "stream_options":
        body["stream"] = True
    assert _refused_field(ChatCompletionRequest, body) == field


@pytest.mark.parametrize(("field", "value"), SHARED_WRONG_TYPES + TEXT_WRONG_TYPES)
def test_completions_refuse_a_value_of_the_wrong_json_type(field: str, value: Any) -> None:
    body = {**TEXT, field: value}
    if field == "stream_options":
        body["stream"] = True
    assert _refused_field(CompletionRequest, body) == field


def test_messages_and_tools_are_typed_strictly_too() -> None:
    for body in (
        {"messages": [{"role": "user", "content": "hi", "name": 5}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        {"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]},
    ):
        assert _refused_field(ChatCompletionRequest, {**CHAT, **body}) in ("messages", "tools")


def test_whole_numbers_fit_float_fields_and_right_types_pass() -> None:
    chat = ChatCompletionRequest.model_validate(
        {**CHAT, "temperature": 1, "top_p": 1, "min_p": 0, "typical_p": 1, "repetition_penalty": 1,
         "frequency_penalty": -1, "presence_penalty": 2, "timeout": 30, "logit_bias": {"12": 5},
         "n": 2, "max_tokens": 4, "max_completion_tokens": 4, "seed": 7, "top_k": -1, "stream": True,
         "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2,
         "stop_token_ids": [2], "parallel_tool_calls": False}
    )  # fmt: skip
    assert (chat.temperature, chat.timeout, chat.logit_bias, chat.n, chat.stream) == (
        1.0, 30.0, {"12": 5.0}, 2, True
    )  # fmt: skip
    assert isinstance(chat.temperature, float) and chat.include_usage_in_stream()
    text = CompletionRequest.model_validate({**TEXT, "prompt": [[1, 2], [3]], "logprobs": 2, "echo": True})
    assert text.prompts() == [[1, 2], [3]] and text.logprobs == 2


@pytest.mark.parametrize(
    "key",
    ["١٢", "12٣", "１２", "²", "-1", "+1", " 1", "1 ", "1.0", "1e3", "", "0x10", "1_000", "2147483648",
     "9" * 5000],
)  # fmt: skip
def test_logit_bias_keys_are_ascii_decimal_token_ids(key: str) -> None:
    for request_class, base in ((ChatCompletionRequest, CHAT), (CompletionRequest, TEXT)):
        with pytest.raises(ValidationError) as refused:
            request_class.model_validate({**base, "logit_bias": {key: 1}})
        error = refused.value.errors()[0]
        assert error["loc"] == ("logit_bias",)
        assert "ASCII decimal" in error["msg"] and "invalid literal" not in error["msg"]


def test_logit_bias_keeps_its_ascii_token_ids_and_range() -> None:
    request = ChatCompletionRequest.model_validate({**CHAT, "logit_bias": {"0": -100, "2147483647": 100}})
    assert request.logit_bias == {"0": -100.0, "2147483647": 100.0}
    with pytest.raises(ValidationError, match=r"within \[-100, 100\]"):
        ChatCompletionRequest.model_validate({**CHAT, "logit_bias": {"1": 101}})


@pytest.mark.parametrize(
    "reasoning", [{"effort": "high"}, {"max_tokens": 100}, {"exclude": True}, {"enabled": False}, "low", True]
)
def test_chat_refuses_openrouters_reasoning_as_it_refuses_reasoning_effort(reasoning: Any) -> None:
    with pytest.raises(InvalidRequest) as refused:
        ChatCompletionRequest.model_validate({**CHAT, "reasoning": reasoning})
    assert refused.value.param == "reasoning" and refused.value.status == 400
    assert "thinking_token_budget" in refused.value.message
    with pytest.raises(InvalidRequest) as effort:
        ChatCompletionRequest.model_validate({**CHAT, "reasoning_effort": "high"})
    assert effort.value.param == "reasoning_effort"


def test_chat_accepts_a_reasoning_that_asks_for_nothing() -> None:
    for reasoning in (None, {}, {"effort": None}):
        ChatCompletionRequest.model_validate({**CHAT, "reasoning": reasoning})


def _post_all(tmp_path: Path, requests: list[tuple[str, dict[str, Any]]]) -> list[tuple[int | None, Any]]:
    """Each request's (status, JSON body); (None, None) for one that got past validation and so waits
    for a worker that never starts."""
    raw = {"server": {"runtime_dir": str(tmp_path / "rt")},
           "models": [{"name": "m", "engine": "transformers", "path": str(tmp_path)}]}  # fmt: skip
    app = create_app(parse_registry(raw, tmp_path / "models.yaml"))

    async def post() -> list[tuple[int | None, Any]]:
        client = app.test_client()
        answers: list[tuple[int | None, Any]] = []
        try:
            for path, body in requests:
                try:
                    response = await asyncio.wait_for(client.post(path, json=body), timeout=5)
                except TimeoutError:
                    answers.append((None, None))
                    continue
                answers.append((response.status_code, await response.get_json()))
        finally:
            await app.extensions["gateway"].link.close()  # the app's socket exists from its creation
        return answers

    return asyncio.run(post())


def test_the_http_answer_is_openais_400_naming_the_field(tmp_path: Path) -> None:
    requests = [
        ("/v1/chat/completions", {**CHAT, "max_tokens": True}),
        ("/v1/chat/completions", {**CHAT, "n": "2"}),
        ("/v1/chat/completions", {**CHAT, "stream": "true"}),
        ("/v1/chat/completions", {**CHAT, "temperature": "0.5"}),
        ("/v1/completions", {**TEXT, "n": 2.0}),
        ("/v1/completions", {**TEXT, "logprobs": True}),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"١٢": 1}}),
        ("/v1/completions", {**TEXT, "logit_bias": {"²": 1}}),
        ("/v1/chat/completions", {**CHAT, "reasoning": {"effort": "low"}}),
    ]
    answers = _post_all(tmp_path, requests)
    params = ["max_tokens", "n", "stream", "temperature", "n", "logprobs", "logit_bias", "logit_bias",
              "reasoning"]  # fmt: skip
    for (status, body), param in zip(answers, params, strict=True):
        assert status == 400, (param, body)
        error = body["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert "invalid literal" not in error["message"]
