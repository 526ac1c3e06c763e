"""Sloppy and hostile requests on the routes beside generation: /v1/embeddings, /tokenize,
/detokenize and the admin reload view, through one real gateway with a chat and an embedding worker.

Each request either does what it asks or is a 400 naming the field; none is coerced into another
meaning or quietly loses a field. The server section's heartbeat_timeout_s is short, so an embedding
batch, or the tokenizing of a text, that outlasts it shows whether the worker stays alive through it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.demo.embedding_model import make_demo_embedding_model
from tests.harness import GatewayProcess, wait_until
from tests.integration.conftest import demo_entry, write_registry

HEARTBEAT_TIMEOUT_S = 1.5
ASK = [{"role": "user", "content": "Tell me about the weather"}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    root = tmp_path_factory.mktemp("edges")
    embed_dir = make_demo_embedding_model(root / "demo-embed", seed=2)
    config = write_registry(
        root / "models.yaml",
        [
            demo_entry("m", demo_model_dir),
            # Longer than MAX_INPUTS (2048) tokens fit: the demo model has 4096 positions.
            demo_entry("e", embed_dir, task="embed", max_seq_len=4096),
        ],
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
    )
    with GatewayProcess(config) as gw:
        yield gw


def post(gateway: GatewayProcess, path: str, body: dict[str, Any], timeout: float = 30) -> httpx.Response:
    return httpx.post(gateway.url + path, json=body, timeout=timeout)


def refused_param(gateway: GatewayProcess, path: str, body: dict[str, Any]) -> str | None:
    reply = post(gateway, path, body)
    assert reply.status_code == 400, (body, reply.text)
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    return error["param"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"input": ""}, "input"),  # OpenAI refuses it; its vector would be the special tokens' alone
        ({"input": ["a", ""]}, "input.1"),
        ({"input": [[1, 2], []]}, "input.1"),
        ({"input": [True, False]}, "input.0"),  # not token ids 1 and 0
        ({"input": [1.0, 2.0]}, "input.0"),
        ({"input": ["a", 5]}, "input.1"),  # one kind per request
        ({"input": [[5], "a"]}, "input.1"),
        ({"input": ["a", None]}, "input.1"),
        ({"input": [[[5]]]}, "input.0"),
        ({"input": "x", "dimensions": "64"}, "dimensions"),
        ({"input": "x", "dimensions": True}, "dimensions"),
        ({"input": "x", "timeout": "5"}, "timeout"),
    ],
)
def test_an_embedding_input_of_the_wrong_kind_is_refused_by_name(
    gateway: GatewayProcess, extra: dict[str, Any], param: str
) -> None:
    assert refused_param(gateway, "/v1/embeddings", {"model": "e", **extra}) == param


def test_one_input_of_more_token_ids_than_the_input_count_cap_is_embedded(gateway: GatewayProcess) -> None:
    # The cap counts inputs; the tokens of one input are bounded by the model's length alone.
    reply = post(gateway, "/v1/embeddings", {"model": "e", "input": [5] * 2100, "encoding_format": "float"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == 2100 and len(reply.json()["data"]) == 1


def test_a_batch_longer_than_the_heartbeat_timeout_keeps_its_worker(gateway: GatewayProcess) -> None:
    inputs = [[5 + i % 100] * 512 for i in range(1024)]
    started = time.monotonic()
    reply = post(gateway, "/v1/embeddings", {"model": "e", "input": inputs}, timeout=600)
    took_s = time.monotonic() - started
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["data"]) == len(inputs)
    # The premise: the worker was busy in one batch for longer than the gateway waits for a frame.
    assert took_s > HEARTBEAT_TIMEOUT_S, f"the batch took {took_s:.1f}s: make it larger"
    worker = next(w for w in gateway.workers() if w["model"] == "e")
    assert worker["state"] == "ready" and worker["restarts"] == 0, worker


def test_a_text_the_tokenizer_takes_longer_than_the_heartbeat_timeout_over_keeps_its_worker(
    gateway: GatewayProcess,
) -> None:
    # Megabytes of text: seconds of tokenizing on the worker's prompt thread, while its engine
    # thread beats on. On the engine thread, nothing went out for that long: the gateway judged the
    # worker hung, killed it, and the request failed with a 503 instead of its 400.
    text = "the weather today is fine and warm " * 100_000
    started = time.monotonic()
    reply = post(gateway, "/v1/embeddings", {"model": "e", "input": text}, timeout=120)
    took_s = time.monotonic() - started
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "input"), error
    assert took_s > HEARTBEAT_TIMEOUT_S, f"the tokenizer took {took_s:.1f}s: make the text longer"
    worker = next(w for w in gateway.workers() if w["model"] == "e")
    assert worker["state"] == "ready" and worker["restarts"] == 0, worker


def embedded_inputs(gateway: GatewayProcess) -> int:
    """What the embedding worker's engine has embedded, as of a heartbeat sent after this call."""

    def view() -> dict[str, Any]:
        return next(w for w in gateway.workers() if w["model"] == "e")

    seen = view()["heartbeats"]
    settled = wait_until(lambda: (w := view())["heartbeats"] >= seen + 2 and w, "two more heartbeats")
    return int(settled["stats"]["jobs_finished"])


def test_an_embedding_past_its_deadline_stops_running_on_its_worker(gateway: GatewayProcess) -> None:
    before = embedded_inputs(gateway)
    # 2048 inputs of 512 tokens: half a minute of engine batches (32 inputs each) on this worker.
    inputs = [[5 + i % 100] * 512 for i in range(2048)]
    reply = post(gateway, "/v1/embeddings", {"model": "e", "input": inputs, "timeout": 1.0}, timeout=60)
    assert reply.status_code == 408, reply.text
    # The gateway cancelled it on the worker, which drops its inputs after the engine batch in
    # progress: the next request is answered then, not once the rest of them have run.
    probe = post(gateway, "/v1/embeddings", {"model": "e", "input": "hello", "timeout": 10.0}, timeout=60)
    assert probe.status_code == 200, probe.text
    ran = embedded_inputs(gateway) - before - 1
    assert ran < len(inputs) / 2, f"{ran} of the timed-out request's {len(inputs)} inputs were embedded"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        # Only a chat template reads these: beside a prompt they would be dropped.
        ({"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"prompt": "hi", "add_generation_prompt": False}, "add_generation_prompt"),
        ({"prompt": "hi", "continue_final_message": True}, "continue_final_message"),
        ({"prompt": "hi", "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
        # The template places the special tokens; none are added on top.
        ({"messages": ASK, "add_special_tokens": True}, "add_special_tokens"),
        # Strict: not read as false.
        ({"prompt": "hi", "add_special_tokens": "no"}, "add_special_tokens"),
        ({"prompt": "hi", "add_special_tokens": 0}, "add_special_tokens"),
    ],
)
def test_tokenize_refuses_what_it_would_drop_or_coerce(
    gateway: GatewayProcess, body: dict[str, Any], param: str
) -> None:
    assert refused_param(gateway, "/tokenize", {"model": "m", **body}) == param


def test_tokenize_accepts_the_defaults_spelled_out(gateway: GatewayProcess) -> None:
    plain = post(gateway, "/tokenize", {"model": "m", "prompt": "hi"}).json()["tokens"]
    spelled = {"add_generation_prompt": True, "continue_final_message": False, "tools": []}
    assert post(gateway, "/tokenize", {"model": "m", "prompt": "hi", **spelled}).json()["tokens"] == plain
    chat = post(gateway, "/tokenize", {"model": "m", "messages": ASK}).json()["tokens"]
    explicit = {"model": "m", "messages": ASK, "add_special_tokens": False}
    assert post(gateway, "/tokenize", explicit).json()["tokens"] == chat


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tokens": ["5", "6"]}, "tokens.0"),
        ({"tokens": [True]}, "tokens.0"),
        ({"tokens": [5.0]}, "tokens.0"),
        ({"tokens": [5], "skip_special_tokens": False}, "skip_special_tokens"),  # they are always skipped
    ],
)
def test_detokenize_refuses_what_it_would_coerce_or_drop(
    gateway: GatewayProcess, extra: dict[str, Any], param: str
) -> None:
    assert refused_param(gateway, "/detokenize", {"model": "m", **extra}) == param


def test_an_unknown_reload_is_not_found(gateway: GatewayProcess) -> None:
    reply = httpx.get(gateway.url + "/admin/reload/999", timeout=5)
    assert reply.status_code == 404, reply.text
    assert reply.json()["error"]["code"] == "not_found"
