"""Fallbacks for requests that only the answering model can prepare or take, and the error texts of
the OpenAI surfaces that named the wrong thing.

Real gateway, real CPU workers. `lonely` never finishes loading (its load is delayed far past the
test) and falls back to `tiny` (a short context, two slots) and then `small`. A completion whose
token-id prompt is echoed must not need `lonely`'s tokenizer, and a request that `lonely` could
take but `tiny` cannot must go on to `small`, not come back as a 400 about `tiny`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import GatewayProcess, wait_until
from tests.integration.conftest import demo_entry, write_registry

FAULTY = "test:tests.fault_engines.FaultyEngine"
IDS = [[100, 200, 300], [400, 500]]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    config = write_registry(
        tmp_path_factory.mktemp("probe-fallbacks") / "models.yaml",
        [
            demo_entry(
                "lonely",
                demo_model_dir,
                engine=FAULTY,
                fallbacks=["tiny", "small"],
                env={"FAULT_LOAD_DELAY_S": "900"},
            ),
            demo_entry(
                "tiny",
                demo_model_dir,
                max_seq_len=256,
                defaults={"max_tokens": 32},
                limits={"max_concurrent_jobs": 2, "max_queued_requests": 8},
            ),
            demo_entry("small", demo_model_dir),
        ],  # fmt: skip
        readiness="any",
    )
    with GatewayProcess(config, env={"GATEWAY_ALLOW_TEST_ENGINES": "1"}) as gw:
        for model in ("tiny", "small"):
            wait_until(lambda m=model: httpx.get(f"{gw.url}/health/ready/{m}").status_code == 200,
                       f"{model} ready", context=gw.events)  # fmt: skip
        yield gw


def post(gateway: GatewayProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gateway.url + path, json=body, timeout=60)


def detokenized(gateway: GatewayProcess, model: str, ids: list[int]) -> str:
    reply = post(gateway, "/detokenize", {"model": model, "tokens": ids})
    assert reply.status_code == 200, reply.text
    return str(reply.json()["prompt"])


def streamed_texts(reply: httpx.Response) -> tuple[dict[int, str], set[str]]:
    texts: dict[int, str] = {}
    models = set()
    for line in reply.text.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            models.add(chunk["model"])
            for choice in chunk["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts, models


def test_an_echoed_token_id_prompt_falls_back_like_any_other(gateway: GatewayProcess) -> None:
    # The echo's text came from `lonely`'s own worker, asked before the fallback was chosen: a 503.
    body = {"model": "lonely", "prompt": IDS[0], "echo": True, "max_tokens": 3}
    reply = post(gateway, "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "tiny"
    assert reply.json()["choices"][0]["text"].startswith(detokenized(gateway, "tiny", IDS[0]))

    streamed = post(gateway, "/v1/completions", {**body, "prompt": IDS, "n": 2, "stream": True,
                                                 "max_tokens": 40})  # fmt: skip
    assert streamed.status_code == 200, streamed.text
    texts, models = streamed_texts(streamed)
    assert models == {"small"}  # 2 prompts x n=2 is more than tiny's two slots
    for index, text in texts.items():
        assert text.startswith(detokenized(gateway, "small", IDS[index // 2]))


def test_a_fallback_that_cannot_take_the_request_is_passed_over(gateway: GatewayProcess) -> None:
    # 1000 tokens fit lonely's context (2048), not tiny's (256): small answers, not a 400 about tiny.
    chat = {"model": "lonely", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1000}
    reply = post(gateway, "/v1/chat/completions", {**chat, "stop": ["e"]})
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "small"
    # Three choices are more than tiny runs at once.
    reply = post(gateway, "/v1/chat/completions", {**chat, "max_tokens": 2, "n": 3})
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "small" and len(reply.json()["choices"]) == 3
    responses = {"model": "lonely", "input": "Hello", "max_output_tokens": 1000, "stream": True}
    streamed = post(gateway, "/v1/responses", responses)
    assert streamed.status_code == 200, streamed.text
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert events[-1]["response"]["model"] == "small"
    # A request tiny can take still goes to it, the first fallback.
    assert post(gateway, "/v1/chat/completions", {**chat, "max_tokens": 2}).json()["model"] == "tiny"


def test_errors_name_what_the_client_sent(gateway: GatewayProcess) -> None:
    too_long = post(gateway, "/v1/responses", {"model": "small", "input": "x", "max_output_tokens": 5000})
    assert too_long.status_code == 400
    error = too_long.json()["error"]
    assert error["param"] == "max_output_tokens" and error["message"].startswith("max_output_tokens ")
    # A text part without its text is malformed, not of an unsupported type.
    parts = [{"type": "input_text"}]
    reply = post(gateway, "/v1/responses", {"model": "small", "input": [{"role": "user", "content": parts}]})
    assert reply.status_code == 400 and "not supported" not in reply.json()["error"]["message"]
    assert "needs text" in reply.json()["error"]["message"]
    chat = {"model": "small", "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    reply = post(gateway, "/v1/chat/completions", chat)
    assert reply.status_code == 400 and "needs text" in reply.json()["error"]["message"]


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FUNCTIONS = [{"name": "get_weather", "parameters": CITY}]


def test_legacy_functions_are_answered_and_read_back_as_function_call(gateway: GatewayProcess) -> None:
    # A client of the legacy `functions` API reads message.function_call: tool_calls would be lost.
    body = {"model": "small", "messages": [{"role": "user", "content": "Weather in Rome?"}],
            "functions": FUNCTIONS, "function_call": {"name": "get_weather"}, "max_tokens": 12}  # fmt: skip
    message = post(gateway, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"] is None
    assert message["function_call"]["name"] == "get_weather"
    assert message["function_call"]["arguments"].startswith("{")

    streamed = post(gateway, "/v1/chat/completions", {**body, "stream": True})
    deltas = [json.loads(line[6:])["choices"][0]["delta"]
              for line in streamed.text.splitlines() if line.startswith("data: {")]  # fmt: skip
    calls = [delta["function_call"] for delta in deltas if "function_call" in delta]
    assert not any("tool_calls" in delta for delta in deltas)
    assert calls[0]["name"] == "get_weather" and all("name" not in call for call in calls[1:])
    assert "".join(call["arguments"] for call in calls).startswith("{")


def test_a_legacy_function_call_in_the_history_reaches_the_template(gateway: GatewayProcess) -> None:
    # It was dropped: the template got an empty assistant turn, and the model never saw its call.
    history = [{"role": "user", "content": "Weather in Rome?"},
               {"role": "assistant", "content": None,
                "function_call": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
               {"role": "function", "name": "get_weather", "content": "sunny"}]  # fmt: skip
    tokens = post(gateway, "/tokenize", {"model": "small", "messages": history}).json()["tokens"]
    assert '"Rome"' in detokenized(gateway, "small", tokens)
