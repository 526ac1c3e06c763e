"""Real clients run unchanged: probes and info routes, guidellm, retries, known extensions,
embeddings and the stateless Responses API, through one real gateway with two CPU workers.

`m` is the demo chat model; `e` is the demo embedding model (sentence-transformers layout, mean
pooling and Normalize). Every extension is checked for its effect (greedy decoding makes a
baseline to compare with) or for a 400 that names it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from gateway.demo.embedding_model import make_demo_embedding_model
from tests.harness import GatewayProcess
from tests.integration.conftest import demo_entry, write_registry

ASK = [{"role": "user", "content": "Tell me about the weather"}]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
}


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_embedding_model(tmp_path_factory.mktemp("models") / "demo-embed", seed=2)


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path, embed_dir: Path
) -> Iterator[GatewayProcess]:
    config = write_registry(
        tmp_path_factory.mktemp("clients") / "models.yaml",
        [
            demo_entry("m", demo_model_dir, tool_call_parser="hermes"),
            demo_entry("e", embed_dir, task="embed", max_seq_len=512),
        ],
    )
    with GatewayProcess(config) as gw:
        yield gw


@pytest.fixture(scope="module")
def client(gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def post(gateway: GatewayProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gateway.url + path, json=body, timeout=60)


def complete(gateway: GatewayProcess, **body: Any) -> dict[str, Any]:
    reply = post(gateway, "/v1/completions", {"model": "m", "prompt": "The weather today", "max_tokens": 24,
                                              "temperature": 0, **body})  # fmt: skip
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]  # type: ignore[no-any-return]


def refused(gateway: GatewayProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = post(gateway, path, body)
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]  # type: ignore[no-any-return]


# ---- probes and info routes ------------------------------------------------------------------


def test_probes_and_info_routes(gateway: GatewayProcess, demo_model_dir: Path) -> None:
    for path in ("/health", "/ping"):
        assert httpx.get(gateway.url + path).status_code == 200
    assert httpx.get(gateway.url + "/version").json()["version"]
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    ids = post(gateway, "/v1/tokenize", {"model": "m", "prompt": "The weather today"}).json()["tokens"]
    assert ids == tokenizer.encode("The weather today")
    assert (
        post(gateway, "/v1/detokenize", {"model": "m", "tokens": ids}).json()["prompt"] == "The weather today"
    )
    info = httpx.get(gateway.url + "/tokenizer_info", params={"model": "m"}).json()
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] == 2048
    # With two models served, the model cannot be guessed.
    assert refused(gateway, "/v1/tokenize", {"prompt": "x"})["param"] == "model"


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_runs_with_no_options(
    gateway: GatewayProcess, demo_model_dir: Path, tmp_path: Path, endpoint: str
) -> None:
    """guidellm with its defaults (it checks GET /health, picks the model from /v1/models, streams
    with continuous usage stats); only the target, a tiny synthetic load and the local tokenizer."""
    report = tmp_path / "report.json"
    command = [
        str(Path(sys.executable).with_name("guidellm")), "run",
        "--backend", f"kind=openai_http,target={gateway.url},request_format={endpoint}",
        "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
        "--tokenizer", f"kind=hf_auto,model={demo_model_dir}",
        "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=3",
        "--output", f"kind=json,path={report}", "--disable-console-interactive",
    ]  # fmt: skip
    run = subprocess.run(
        command, capture_output=True, text=True, timeout=240, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    requests = json.loads(report.read_text())["benchmarks"][0]["requests"]
    assert len(requests["successful"]) == 3 and not requests["errored"] and not requests["incomplete"]


# ---- errors that retrying cannot fix -------------------------------------------------------


def test_sdk_makes_one_attempt_for_errors_retrying_cannot_fix(gateway: GatewayProcess) -> None:
    attempts: list[str] = []
    http = httpx.Client(event_hooks={"request": [lambda request: attempts.append(str(request.url))]})
    # The SDK's defaults: two retries for 408, 409, 429 and 5xx, unless the server says otherwise.
    sdk = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", http_client=http)
    assert sdk.max_retries == 2
    with pytest.raises(openai.APIStatusError) as deadline:
        sdk.completions.create(
            model="m", prompt="x", max_tokens=2000, extra_body={"timeout": 0.001, "ignore_eos": True}
        )
    assert deadline.value.status_code == 408 and deadline.value.response.headers["x-should-retry"] == "false"
    assert len(attempts) == 1
    with pytest.raises(openai.BadRequestError) as too_long:
        sdk.completions.create(model="m", prompt=[5] * 3000, max_tokens=2)
    assert too_long.value.code == "context_length_exceeded"
    assert too_long.value.response.headers["x-should-retry"] == "false" and len(attempts) == 2
    http.close()


# ---- known extensions ------------------------------------------------------------------------


def test_structured_output_extensions_are_enforced(gateway: GatewayProcess) -> None:
    for body in ({"guided_json": CITY}, {"json_schema": CITY}, {"structured_outputs": {"json": CITY}},
                 {"guided_json": json.dumps(CITY)}):  # fmt: skip
        assert json.loads(complete(gateway, max_tokens=40, **body)["text"])["city"] in ("Paris", "Rome")
    pattern = "[0-9]{3}-[a-c]{2}"
    for body in (
        {"guided_regex": pattern},
        {"regex_pattern": pattern},
        {"structured_outputs": {"regex": pattern}},
    ):
        assert re.fullmatch(pattern, complete(gateway, **body)["text"]), body
    negated = "[^0-9]{3}"  # "any other character": an automaton state of its own
    assert re.fullmatch(negated, complete(gateway, guided_regex=negated)["text"], re.DOTALL)
    for body in (
        {"guided_choice": ["sunny", "rainy (cold)"]},
        {"structured_outputs": {"choice": ["sunny", "rainy (cold)"]}},
    ):
        assert complete(gateway, **body)["text"] in ("sunny", "rainy (cold)")
    compact = complete(
        gateway, max_tokens=40, structured_outputs={"json": CITY, "disable_any_whitespace": True}
    )
    assert json.loads(compact["text"]) and not re.search(r"\s", compact["text"])
    for body, param in (({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
                        ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs"),
                        ({"guided_regex": "a", "guided_json": CITY}, "guided_json")):  # fmt: skip
        error = refused(gateway, "/v1/completions", {"model": "m", "prompt": "x", **body})
        assert error["param"] == param, error


def test_sampling_extensions_take_effect(gateway: GatewayProcess, demo_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    greedy = complete(gateway, max_tokens=32, logprobs=0)
    text, tokens = greedy["text"], greedy["logprobs"]["tokens"]
    # banned_strings: a word of the greedy text never appears, in any case.
    word = max(re.findall(r"[A-Za-z]{3,}", text), key=len)
    banned = complete(gateway, max_tokens=32, banned_strings=[word.upper()])["text"]
    assert word.lower() not in banned.lower() and banned != text
    # bad_words: the token of a word the greedy text used is never generated.
    bad = next(
        t
        for t in tokens
        if t.startswith(" ")
        and t.strip().isalpha()
        and len(tokenizer.encode(t, add_special_tokens=False)) == 1
    )
    without = complete(gateway, max_tokens=32, logprobs=0, bad_words=[bad.strip()])
    assert bad not in without["logprobs"]["tokens"]
    # allowed_token_ids: only those tokens come out.
    allowed = sorted(
        {tokenizer.encode(w, add_special_tokens=False)[0] for w in (" the", " a", " of", " and")}
    )
    only = complete(gateway, max_tokens=12, logprobs=0, allowed_token_ids=allowed)
    assert set(only["logprobs"]["tokens"]) <= {tokenizer.decode([i]) for i in allowed}
    # include_stop_str_in_output: the stop string ends the text.
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert complete(gateway, max_tokens=32, stop=[stop])["text"] == text[: text.index(stop)]
    kept = complete(gateway, max_tokens=32, stop=[stop], include_stop_str_in_output=True)
    assert kept["text"] == text[: text.index(stop)] + stop and kept["finish_reason"] == "stop"
    # best_of equal to n is what n already does; anything else is refused by name.
    assert complete(gateway, max_tokens=4, n=2, best_of=2)["index"] == 0
    assert (
        refused(gateway, "/v1/completions", {"model": "m", "prompt": "x", "best_of": 3})["param"] == "best_of"
    )
    assert refused(gateway, "/v1/completions", {"model": "m", "prompt": "x", "prompt_logprobs": -1})["param"]
    # A field nobody knows is still ignored.
    assert complete(gateway, max_tokens=4, some_vendor_field={"x": 1})["text"]


def test_chat_template_switches(gateway: GatewayProcess, demo_model_dir: Path, client: openai.OpenAI) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    history = [*ASK, {"role": "assistant", "content": "It is"}]
    cases = [
        ({"add_generation_prompt": False}, {"add_generation_prompt": False}, ASK),
        ({"add_generation_prompt": False, "continue_final_message": True},
         {"continue_final_message": True}, history),
        ({"chat_template_kwargs": {"enable_thinking": False}},
         {"add_generation_prompt": True, "enable_thinking": False}, ASK),
    ]  # fmt: skip
    for ours, theirs, messages in cases:
        expected = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **theirs)
        got = post(gateway, "/v1/tokenize", {"model": "m", "messages": messages, **ours}).json()["tokens"]
        assert got == list(expected), ours
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=2, extra_body=ours)  # type: ignore[arg-type]
        assert reply.usage is not None and reply.usage.prompt_tokens == len(expected)
    error = refused(
        gateway,
        "/v1/chat/completions",
        {"model": "m", "messages": ASK, "chat_template_kwargs": {"messages": []}},
    )
    assert "messages" in error["message"]
    assert (
        refused(gateway, "/v1/chat/completions", {"model": "m", "messages": ASK, "chat_template": "{{ 1 }}"})[
            "param"
        ]
        == "chat_template"
    )


def test_stream_options(client: openai.OpenAI, gateway: GatewayProcess) -> None:
    error = refused(
        gateway,
        "/v1/chat/completions",
        {"model": "m", "messages": ASK, "stream_options": {"include_usage": True}},
    )
    assert error["param"] == "stream_options"
    stream = client.chat.completions.create(
        model="m", messages=ASK, max_tokens=6, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
    )  # fmt: skip
    counts = [chunk.usage.completion_tokens for chunk in stream if chunk.choices and chunk.usage]
    assert counts and counts == sorted(counts) and counts[-1] == 6


# ---- embeddings ------------------------------------------------------------------------------


def test_embeddings_through_the_sdk(client: openai.OpenAI, embed_dir: Path) -> None:
    from sentence_transformers import SentenceTransformer

    texts = ["The weather today", "Once upon a time, a cat", "x"]
    expected = SentenceTransformer(str(embed_dir), device="cpu").encode(texts)
    # The SDK asks for base64 and decodes it unless an encoding_format is given.
    for extra in ({}, {"encoding_format": "float"}):
        reply = client.embeddings.create(model="e", input=texts, **extra)  # type: ignore[arg-type]
        assert [d.index for d in reply.data] == [0, 1, 2]
        for item, vector in zip(reply.data, expected, strict=True):
            assert len(item.embedding) == len(vector)
            assert max(abs(a - float(b)) for a, b in zip(item.embedding, vector, strict=True)) < 1e-5
            assert abs(sum(a * a for a in item.embedding) - 1.0) < 1e-4  # the model's Normalize module
    tokenizer = AutoTokenizer.from_pretrained(embed_dir)
    assert reply.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts)
    by_ids = client.embeddings.create(model="e", input=[tokenizer.encode(texts[0])], encoding_format="float")
    assert (
        max(abs(a - b) for a, b in zip(by_ids.data[0].embedding, reply.data[0].embedding, strict=True)) < 1e-6
    )
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="e", input="x", dimensions=8)
    assert info.value.body["param"] == "dimensions"  # type: ignore[index]


def test_each_model_answers_only_its_task(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="not an embedding model"):
        client.embeddings.create(model="m", input="x")
    for call in (
        lambda: client.chat.completions.create(model="e", messages=ASK),  # type: ignore[arg-type]
        lambda: client.completions.create(model="e", prompt="x"),
        lambda: client.responses.create(model="e", input="x", store=False),
    ):
        with pytest.raises(openai.BadRequestError, match="embedding model"):
            call()


# ---- responses -------------------------------------------------------------------------------


def test_responses_create_and_stream(client: openai.OpenAI) -> None:
    brief = [{"role": "system", "content": "Be brief."}, *ASK]
    chat = client.chat.completions.create(model="m", messages=brief,
                                          max_tokens=12, temperature=0)  # type: ignore[arg-type]  # fmt: skip
    reply = client.responses.create(model="m", instructions="Be brief.", input=ASK[0]["content"], store=False,
                                    max_output_tokens=12, temperature=0)  # fmt: skip
    assert reply.output_text == chat.choices[0].message.content
    assert reply.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert reply.usage is not None and reply.usage.input_tokens == chat.usage.prompt_tokens  # type: ignore[union-attr]
    schema = {"type": "json_schema", "name": "city", "schema": CITY}
    with client.responses.stream(model="m", input=[{"role": "user", "content": "Where?"}], store=False,
                                 max_output_tokens=40, temperature=0, text={"format": schema}) as stream:  # type: ignore[typeddict-item]  # fmt: skip
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert json.loads(final.output_text)["city"] in ("Paris", "Rome")


def test_responses_api_refuses_what_it_does_not_keep_or_honour(client: openai.OpenAI) -> None:
    for kwargs, param in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                          ({"conversation": "conv_1"}, "conversation"),
                          ({"background": True}, "background"),
                          ({"tools": [{"type": "web_search"}]}, "tools"),
                          ({"prompt": {"id": "pmpt_1"}}, "prompt"),
                          ({"text": {"verbosity": "low"}}, "text.verbosity"),
                          # a chat API sampling setting sent here would otherwise be dropped
                          ({"extra_body": {"seed": 7}}, "seed")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="m", input="x", **kwargs)  # type: ignore[arg-type]
        assert info.value.body["param"] == param  # type: ignore[index]
    # Fields that cannot change this endpoint's text are accepted.
    harmless = {"service_tier": "auto", "parallel_tool_calls": True, "safety_identifier": "u1"}
    reply = client.responses.create(model="m", input="x", store=False, max_output_tokens=2, **harmless)
    assert reply.status in ("completed", "incomplete")
    # Query parameters that would replay or extend a stored response are refused, not ignored.
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.retrieve("resp_1", include=["message.output_text.logprobs"])
    assert str(info.value.body["param"]).startswith("include")  # type: ignore[index]
