"""vLLM's truncate_prompt_tokens on /v1/completions, /v1/chat/completions and /v1/embeddings, through
one real gateway with a chat worker and an embedding worker (transformers engine, CPU).

The cut keeps a prompt's last k tokens, after the chat template and the special tokens, as vLLM's
does: a job with the cut must give what the same model gives for those last k tokens sent as token
ids, and report k prompt tokens. -1 means the model's context length; 0, less than -1, more than
the context, and a cut beside `echo` are 400s naming the field.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.demo.embedding_model import make_demo_embedding_model
from tests.harness import GatewayProcess
from tests.integration.conftest import demo_entry, write_registry

CONTEXT = 256
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    root = tmp_path_factory.mktemp("cut")
    embed_dir = make_demo_embedding_model(root / "demo-embed", seed=2)
    config = write_registry(
        root / "models.yaml",
        [
            demo_entry("m", demo_model_dir, max_seq_len=CONTEXT, defaults={"max_tokens": 16}),
            demo_entry("e", embed_dir, task="embed", max_seq_len=CONTEXT),
        ],
    )
    with GatewayProcess(config) as gw:
        yield gw


def post(gateway: GatewayProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(gateway.url + path, json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()  # type: ignore[no-any-return]


def refused(gateway: GatewayProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(gateway.url + path, json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]  # type: ignore[no-any-return]


def prompt_ids(count: int, first: int = 5) -> list[int]:
    return [first + (i * 7) % 200 for i in range(count)]


def test_a_completion_keeps_the_last_tokens_of_its_prompt(gateway: GatewayProcess) -> None:
    ids = prompt_ids(40)
    cut = post(
        gateway, "/v1/completions", {"model": "m", "prompt": ids, "truncate_prompt_tokens": 12, **GREEDY}
    )
    tail = post(gateway, "/v1/completions", {"model": "m", "prompt": ids[-12:], **GREEDY})
    whole = post(gateway, "/v1/completions", {"model": "m", "prompt": ids, **GREEDY})
    assert cut["usage"]["prompt_tokens"] == 12 and whole["usage"]["prompt_tokens"] == 40
    assert cut["choices"][0]["text"] == tail["choices"][0]["text"]
    # A cut longer than the prompt changes nothing.
    long_cut = post(
        gateway, "/v1/completions", {"model": "m", "prompt": ids, "truncate_prompt_tokens": 100, **GREEDY}
    )
    assert long_cut["usage"]["prompt_tokens"] == 40
    assert long_cut["choices"][0]["text"] == whole["choices"][0]["text"]


def test_a_text_prompt_longer_than_the_context_runs_once_cut(gateway: GatewayProcess) -> None:
    text = "the weather is fine today " * 200  # far more tokens than CONTEXT
    too_long = refused(gateway, "/v1/completions", {"model": "m", "prompt": text, **GREEDY})
    assert too_long["code"] == "context_length_exceeded"
    cut = post(
        gateway, "/v1/completions", {"model": "m", "prompt": text, "truncate_prompt_tokens": 64, **GREEDY}
    )
    assert cut["usage"]["prompt_tokens"] == 64
    assert cut["usage"]["completion_tokens"] == GREEDY["max_tokens"]


def test_a_chat_prompt_is_cut_after_its_template(gateway: GatewayProcess) -> None:
    messages = [
        {"role": "system", "content": "You are a careful assistant who answers briefly. " * 4},
        {"role": "user", "content": "Tell me about the weather in the hills this week."},
    ]
    rendered = post(gateway, "/tokenize", {"model": "m", "messages": messages})["tokens"]
    keep = len(rendered) // 2
    chat = post(gateway, "/v1/chat/completions",
                {"model": "m", "messages": messages, "truncate_prompt_tokens": keep, **GREEDY})  # fmt: skip
    tail = post(gateway, "/v1/completions", {"model": "m", "prompt": rendered[-keep:], **GREEDY})
    assert chat["usage"]["prompt_tokens"] == keep
    assert chat["choices"][0]["message"]["content"] == tail["choices"][0]["text"]


def test_an_embedding_input_keeps_its_last_tokens(gateway: GatewayProcess) -> None:
    ids = prompt_ids(50, first=20)
    cut = post(
        gateway, "/v1/embeddings", {"model": "e", "input": [ids, ids[:5]], "truncate_prompt_tokens": 10}
    )
    tails = post(gateway, "/v1/embeddings", {"model": "e", "input": [ids[-10:], ids[:5]]})
    assert cut["usage"]["prompt_tokens"] == 10 + 5
    for mine, theirs in zip(cut["data"], tails["data"], strict=True):
        assert mine["embedding"] == pytest.approx(theirs["embedding"], abs=1e-5)
    # -1: the context length; a text longer than it is embedded from its last CONTEXT tokens.
    text = "rain on the hills " * 200
    assert (
        refused(gateway, "/v1/embeddings", {"model": "e", "input": text})["code"] == "context_length_exceeded"
    )
    whole_context = post(
        gateway, "/v1/embeddings", {"model": "e", "input": text, "truncate_prompt_tokens": -1}
    )
    assert whole_context["usage"]["prompt_tokens"] == CONTEXT


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "Hi", "truncate_prompt_tokens": 0}),
        ("/v1/completions", {"prompt": "Hi", "truncate_prompt_tokens": -2}),
        ("/v1/completions", {"prompt": "Hi", "truncate_prompt_tokens": CONTEXT + 1}),
        ("/v1/completions", {"prompt": "Hi", "truncate_prompt_tokens": "8"}),
        ("/v1/completions", {"prompt": "Hi", "truncate_prompt_tokens": 8, "echo": True}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "truncate_prompt_tokens": 0},
        ),
        ("/v1/embeddings", {"input": "Hi", "truncate_prompt_tokens": CONTEXT + 1}),
        ("/v1/embeddings", {"input": "Hi", "truncate_prompt_tokens": 0}),
    ],
)
def test_a_cut_it_cannot_make_is_a_400_naming_it(
    gateway: GatewayProcess, path: str, body: dict[str, Any]
) -> None:
    model = "e" if path == "/v1/embeddings" else "m"
    error = refused(gateway, path, {"model": model, **body, **({} if model == "e" else {"max_tokens": 2})})
    assert error["param"] == "truncate_prompt_tokens" and error["type"] == "invalid_request_error", error
