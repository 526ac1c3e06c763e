"""Tokenization routes and chat templates: Hugging Face semantics, registry overrides, errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.harness import GatewayProcess
from tests.integration.conftest import demo_entry, write_registry

STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('system messages are not supported') }}{% endif %}"
    "[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    root = tmp_path_factory.mktemp("tpl")
    bare = root / "no-template"
    shutil.copytree(demo_model_dir, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    registry = write_registry(
        root / "models.yaml",
        [
            demo_entry("m", demo_model_dir),
            demo_entry("strict", demo_model_dir, chat_template=STRICT_TEMPLATE),
            demo_entry("bare", bare),
        ],
    )
    with GatewayProcess(registry) as gw:
        yield gw


def post(gateway: GatewayProcess, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(gateway.url + path, json=body, timeout=30)


def test_tokenize_matches_the_models_tokenizer(gateway: GatewayProcess, demo_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    text = "The quick brown fox, 42 times."
    reply = post(gateway, "/tokenize", {"model": "m", "prompt": text}).json()
    assert reply["tokens"] == tokenizer.encode(text, add_special_tokens=True)
    assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == 2048
    plain = post(gateway, "/tokenize", {"model": "m", "prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    back = post(gateway, "/detokenize", {"model": "m", "tokens": plain["tokens"]}).json()
    assert back["prompt"] == text


def test_chat_template_renders_like_hugging_face(gateway: GatewayProcess, demo_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    reply = post(gateway, "/tokenize", {"model": "m", "messages": MESSAGES}).json()
    assert reply["tokens"] == tokenizer.encode(expected, add_special_tokens=False)
    # usage.prompt_tokens of a chat completion counts exactly those tokens.
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as client:
        chat = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3)  # type: ignore[arg-type]
        assert chat.usage is not None and chat.usage.prompt_tokens == reply["count"]
        assert chat.usage.completion_tokens == 3


def test_registry_template_override_and_raise_exception(gateway: GatewayProcess) -> None:
    user_only = [{"role": "user", "content": "hi"}]
    tokens = post(gateway, "/tokenize", {"model": "strict", "messages": user_only}).json()["tokens"]
    assert (
        post(gateway, "/detokenize", {"model": "strict", "tokens": tokens}).json()["prompt"] == "[user]hi>>"
    )
    refused = post(gateway, "/v1/chat/completions", {"model": "strict", "messages": MESSAGES})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "invalid_messages" and "system messages are not supported" in error["message"]


def test_model_without_template_gets_a_clear_400(gateway: GatewayProcess) -> None:
    refused = post(gateway, "/v1/chat/completions", {"model": "bare", "messages": MESSAGES})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "chat_template_missing"
    completion = post(gateway, "/v1/completions", {"model": "bare", "prompt": "still works", "max_tokens": 2})
    assert completion.status_code == 200


def test_tokenize_errors(gateway: GatewayProcess) -> None:
    assert post(gateway, "/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    both = post(gateway, "/tokenize", {"model": "m", "prompt": "x", "messages": MESSAGES})
    assert both.status_code == 400
    out_of_vocab = post(gateway, "/detokenize", {"model": "m", "tokens": [10**9]})
    assert out_of_vocab.status_code == 400 and out_of_vocab.json()["error"]["code"] == "invalid_tokens"
    deep: dict[str, object] = {"x": 1}
    for _ in range(40):  # past the wire's 32 levels of free-form JSON, within the body's 64
        deep = {"x": deep}
    too_deep = post(gateway, "/tokenize", {"model": "m", "messages": MESSAGES, "chat_template_kwargs": deep})
    assert too_deep.status_code == 400 and too_deep.json()["error"]["param"] == "chat_template_kwargs"
