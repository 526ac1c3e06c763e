"""Prompt logprobs for scoring: lm-evaluation-harness, unmodified, against transformers' numbers.

lm-eval's `local-completions` model sends token-id prompts with echo, logprobs and max_tokens 1,
and reads the prompt tokens' logprobs back. It runs a small multiple-choice task from a local file
against a real gateway and CPU worker; every loglikelihood it gets must equal what transformers
computes on the same demo model for the same tokens, within 1e-3. Also vLLM's prompt_logprobs and
max_tokens 0, checked against the same reference.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.harness import GatewayProcess
from tests.integration.conftest import demo_entry, write_registry

QUESTIONS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " a small village"], "answer": 0},
    {"question": "Once upon a time, the cat", "choices": [" sat on the mat", " flew"], "answer": 1},
    {"question": "Two plus two equals", "choices": [" four", " five", " twenty-two"], "answer": 0},
]
TASK = """task: demo_mc
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
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    config = write_registry(
        tmp_path_factory.mktemp("scoring") / "models.yaml", [demo_entry("m", demo_model_dir)]
    )
    with GatewayProcess(config) as gw:
        yield gw


@pytest.fixture(scope="module")
def reference(demo_model_dir: Path) -> Any:
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        """Row i: the log-softmax that scores token i + 1, from one forward pass over all of `ids`."""
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def test_lm_eval_loglikelihoods_match_transformers(
    gateway: GatewayProcess,
    demo_model_dir: Path,
    reference: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tmp_path / "demo_mc.yaml").write_text(TASK.format(data=data))
    lm = LocalCompletionsAPI(
        base_url=gateway.url + "/v1/completions", model="m", tokenizer=str(demo_model_dir),
        tokenizer_backend="huggingface", max_retries=1, batch_size=4,
    )  # fmt: skip
    results = simple_evaluate(
        model=lm, tasks=["demo_mc"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True
    )
    assert results is not None
    samples = results["samples"]["demo_mc"]
    assert len(samples) == len(QUESTIONS)
    checked = 0
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"], strict=True):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            ids = context_ids + continuation_ids
            rows = reference(ids)
            expected = sum(float(rows[i - 1, ids[i]]) for i in range(len(context_ids), len(ids)))
            loglikelihood, _ = response[0]
            assert math.isclose(loglikelihood, expected, abs_tol=1e-3), (context, continuation)
            checked += 1
    assert checked == sum(len(q["choices"]) for q in QUESTIONS)
    assert 0.0 <= results["results"]["demo_mc"]["acc,none"] <= 1.0


def test_prompt_logprobs_and_zero_max_tokens(
    gateway: GatewayProcess, demo_model_dir: Path, reference: Any
) -> None:
    ids = AutoTokenizer.from_pretrained(demo_model_dir).encode("The weather today is mild and")
    rows = reference(ids)
    body = {"model": "m", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2}
    echoed = httpx.post(gateway.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    assert echoed["finish_reason"] == "length" and echoed["logprobs"]["token_logprobs"][0] is None
    got = echoed["logprobs"]["token_logprobs"][1:]
    assert len(got) == len(ids) - 1
    assert all(math.isclose(got[i - 1], float(rows[i - 1, ids[i]]), abs_tol=1e-4) for i in range(1, len(ids)))
    tops = echoed["logprobs"]["top_logprobs"]
    # Each prompt token with its top 2 alternatives (3 entries when it is not among them), as vLLM.
    assert tops[0] is None and all(len(t) <= 3 for t in tops[1:])
    tokens = echoed["logprobs"]["tokens"][1:]
    assert all(t[token] == lp for token, lp, t in zip(tokens, got, tops[1:], strict=True))
    assert max(tops[1].values()) == pytest.approx(float(rows[0].max()), abs=1e-4)
    # vLLM's prompt_logprobs: {token id: {logprob, rank, decoded_token}} per prompt token.
    body = {"model": "m", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 1, "temperature": 0}
    scored = httpx.post(gateway.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    prompt = scored["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == len(ids)
    for i in range(1, len(ids)):
        entry = prompt[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(float(rows[i - 1, ids[i]]), abs=1e-4)
        assert entry["rank"] == int((rows[i - 1] > rows[i - 1, ids[i]]).sum()) + 1
    # max_tokens 0 without echo would do nothing: refused.
    refused = httpx.post(gateway.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_remote_tokenizer_backend_reads_tokenizer_info(gateway: GatewayProcess, demo_model_dir: Path) -> None:
    """lm-eval's tokenizer_backend=remote (what `auto` picks when the server has /tokenizer_info)."""
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    assert check_remote_tokenizer_support(gateway.url + "/v1/completions")
    remote = RemoteTokenizer(gateway.url + "/v1/completions")
    local = AutoTokenizer.from_pretrained(demo_model_dir)
    assert remote.eos_token == local.eos_token and remote.bos_token == local.bos_token
    text = "The weather today"
    assert remote.encode(text) == local.encode(text, add_special_tokens=False)
    assert remote.decode(remote.encode(text)) == text
    chat = [{"role": "user", "content": "hi"}]
    # lm-eval renders the served template itself and passes no bos_token unless told.
    rendered = remote.apply_chat_template(chat, bos_token=remote.bos_token)
    assert rendered == local.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
