"""A real, trained model on the GPU engines, through the gateway, checked against transformers.

Runs in the pytest process on the GPU machine, against one gateway whose workers all share one GPU
and serve the same trained weights (scripts/train_small_llama.py, made by gpu_run.sh's real-model
stage; GPU_TEST_TRAINED_MODEL names the FP16 folder, GPU_TEST_TRAINED_EXL2 / _EXL3 its ~4 bpw
conversions by scripts/convert_quantized.py):

    fp16-<mode>      the FP16 folder in each engine mode (exllamav2 paged and unpaged, exllamav3)
    kv-v2-q4/q6/q8   exllamav2 with a quantized K/V cache (cache_mode)
    kv-v3-q4/q8      exllamav3 with a quantized K/V cache (k_bits = v_bits)
    exl2, exl3       the quantized weights

The reference is transformers on the same GPU, in float32, on the same FP16 weights. Greedy text
must be transformers' greedy text, token for token, for 32 tokens of several prompts; where an
engine's fp16 arithmetic picks another token, transformers' top two must have been a near-tie.
Trained weights make that a real test: their distributions are peaked, and the folder's rope_theta
(100000, nested in rope_parameters as transformers 5 writes it) must reach exllamav2, whose own
reading would use 10000. Quantized weights and caches are judged by teacher-forced top-1 agreement
with transformers on held-out text (every prefix of a few windows, one token each), and EXL2 also
by perplexity against the FP16 model served by the same engine.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.support import SKIP_REASON, record

if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)
TRAINED = os.environ.get("GPU_TEST_TRAINED_MODEL")
if not TRAINED:
    pytest.skip(
        "GPU_TEST_TRAINED_MODEL is not set (gpu_run.sh's real-model stage sets it)", allow_module_level=True
    )

import httpx  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from tests.gpu.conftest import require_mode  # noqa: E402
from tests.gpu.support import ENGINE_MODES, mode_unavailable  # noqa: E402
from tests.gpu.support import registry_entry as entry  # noqa: E402
from tests.gpu.support import start_gateway as start  # noqa: E402
from tests.harness import GatewayProcess  # noqa: E402

pytestmark = pytest.mark.gpu

MAX_SEQ_LEN = 1024
GREEDY_TOKENS = 32
CHAT_TOKENS = 24
# fp16 kernels against a float32 reference: logits differ by ~1e-2, so a top-two gap below this
# may flip. Anything wider is a real difference (a wrong rope_theta gives several nats).
CROSS_TIE = 0.1
WINDOWS, WINDOW = 8, 128  # teacher-forced agreement: prefixes of these held-out windows (1,024 cases)
# What quantization may cost on a 34M-parameter model (small models lose more than large ones). Each
# training run makes another model: over seven of them a Q6 cache agreed on 0.912-0.932 of 512 cases and
# Q4 on 0.855-0.898, so the floors leave room for the model and for the count (its standard error is
# about 0.01); a broken cache agrees on far less.
AGREEMENT_MIN = {"fp16": 0.97, "kv-q8": 0.95, "kv-q6": 0.90, "kv-q4": 0.83, "exl2": 0.80, "exl3": 0.80}
EXL2_PPL_RATIO_MAX = 1.15
CHATS = [("What is the capital of France?", "Paris"), ("What is 12 plus 30?", "42"),
         ("What is the capital of Japan?", "Tokyo")]  # fmt: skip
FP16 = {"exllamav2-paged": "fp16-v2p", "exllamav2-unpaged": "fp16-v2u", "exllamav3": "fp16-v3"}
KV = {"kv-v2-q4": ("exllamav2", "Q4"), "kv-v2-q6": ("exllamav2", "Q6"), "kv-v2-q8": ("exllamav2", "Q8"),
      "kv-v3-q4": ("exllamav3", "Q4"), "kv-v3-q8": ("exllamav3", "Q8")}  # fmt: skip
QUANTIZED = {"exl2": ("GPU_TEST_TRAINED_EXL2", "exllamav2"), "exl3": ("GPU_TEST_TRAINED_EXL3", "exllamav3")}


def _v2_mode() -> str:
    return "exllamav2-paged" if mode_unavailable("exllamav2-paged") is None else "exllamav2-unpaged"


def _models(path: Path) -> list[dict[str, Any]]:
    models = [
        entry(FP16[m], path, [0], m, max_seq_len=MAX_SEQ_LEN) for m in ENGINE_MODES if not mode_unavailable(m)
    ]
    for name, (engine, cache_mode) in KV.items():
        mode = _v2_mode() if engine == "exllamav2" else "exllamav3"
        if not mode_unavailable(mode):
            models.append(entry(name, path, [0], mode, max_seq_len=MAX_SEQ_LEN, cache_mode=cache_mode))
    for name, (variable, engine) in QUANTIZED.items():
        mode = _v2_mode() if engine == "exllamav2" else "exllamav3"
        folder = os.environ.get(variable)
        if folder and not mode_unavailable(mode):
            models.append(entry(name, Path(folder), [0], mode, max_seq_len=MAX_SEQ_LEN))
    return models


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    with start(tmp_path_factory.mktemp("gw-trained"), _models(Path(str(TRAINED)))) as gw:
        yield gw


@pytest.fixture(scope="module")
def served(gateway: GatewayProcess) -> set[str]:
    return {w["model"] for w in gateway.workers()}


class Reference:
    """transformers, float32, on the trained FP16 weights (optionally with another rope_theta)."""

    def __init__(self, path: Path, rope_theta: float | None = None) -> None:
        config = AutoConfig.from_pretrained(path)
        if rope_theta is not None:
            config.rope_parameters = {**(config.rope_parameters or {}), "rope_theta": rope_theta}
        self.model = (
            AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).cuda().eval()
        )
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.end_ids = {0, 2}

    @torch.inference_mode()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """Row i: the distribution of token i + 1."""
        logits = self.model(torch.tensor([ids], device="cuda")).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    def greedy(self, ids: list[int], n: int) -> tuple[list[int], list[tuple[list[int], list[float]]]]:
        """n greedy tokens (fewer at an end token) and each step's top two (ids, logprobs)."""
        seq, tops = list(ids), []
        for _ in range(n):
            values, indices = self.logprobs(seq)[-1].topk(2)
            tops.append((indices.tolist(), values.tolist()))
            seq.append(int(indices[0]))
            if seq[-1] in self.end_ids:
                break
        return seq[len(ids) :], tops

    def text(self, token_id: int) -> str:
        """The token's own text as the API lists it: a special token (<|im_start|>) has none."""
        return str(self.tokenizer.decode([token_id], skip_special_tokens=True))


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference(Path(str(TRAINED)))


@pytest.fixture(scope="module")
def prompts(reference: Reference) -> list[list[int]]:
    """Held-out text of a few lengths (long ones make positions matter) and two chats, as ids."""
    text = (Path(str(TRAINED)) / "heldout.txt").read_text(encoding="utf-8")
    ids = reference.tokenizer.encode(text)
    held = [[0, *ids[start : start + length]] for start, length in ((0, 40), (5000, 200), (20000, 600))]
    chats = [
        reference.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q, _ in CHATS[:2]
    ]  # the template starts with <|endoftext|>, the model's BOS
    return held + [reference.tokenizer.encode(text) for text in chats]


def complete(gateway: GatewayProcess, model: str, prompt: list[int] | list[list[int]], **kw: Any) -> Any:
    body = {"model": model, "prompt": prompt, "temperature": 0, **kw}
    response = httpx.post(gateway.url + "/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def need(served: set[str], name: str, mode: str) -> None:
    require_mode(mode)
    if name not in served:
        pytest.skip(f"{name} is not served in this run")


def diverged_at_near_tie(
    reference: Reference, ids: list[int], n: int, got: list[str], finish_reason: str, label: str
) -> bool:
    """Checks the engine's greedy tokens `got` (each token's own text) for the prompt `ids` against
    transformers' n greedy tokens. Returns False when they are the same tokens with the same end;
    True when they part where transformers' top two were a near-tie (fp16 against float32 may flip
    it); fails the test at any other difference."""
    want, tops = reference.greedy(ids, n)
    ended = bool(want) and want[-1] in reference.end_ids
    expected = [reference.text(t) for t in (want[:-1] if ended else want)]
    at = next((k for k, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    if at is None:
        # The same tokens, and the same end: transformers' end token (which the API may list as one
        # more, textless token) or the token limit.
        lengths = (len(expected), len(expected) + 1) if ended else (n,)
        assert len(got) in lengths, (label, got, expected)
        assert finish_reason == ("stop" if ended else "length"), (label, finish_reason)
        return False
    (first, second), (lp1, lp2) = tops[at]
    assert got[at] == reference.text(second) and lp1 - lp2 < CROSS_TIE, (
        f"{label}: token {at} is {got[at]!r}, transformers chose {expected[at]!r} with a top-two gap of "
        f"{lp1 - lp2:.3f} (not a near-tie); text so far {''.join(got[:at])!r}"
    )
    return True


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
def test_fp16_greedy_equals_transformers(
    mode: str, gateway: GatewayProcess, served: set[str], reference: Reference, prompts: list[list[int]]
) -> None:
    need(served, FP16[mode], mode)
    ties = 0
    for i, ids in enumerate(prompts):
        choice = complete(gateway, FP16[mode], ids, max_tokens=GREEDY_TOKENS, logprobs=2)["choices"][0]
        got = choice["logprobs"]["tokens"]
        ties += diverged_at_near_tie(
            reference, ids, GREEDY_TOKENS, got, choice["finish_reason"], f"{mode}, prompt {i}"
        )
    record(f"trained fp16 greedy vs transformers {mode}", prompts=len(prompts), near_ties=ties)
    assert ties <= len(prompts) // 2, f"{ties} of {len(prompts)} prompts diverged at near-ties"


def test_prompts_would_catch_a_wrong_rope_theta(reference: Reference, prompts: list[list[int]]) -> None:
    """exllamav2 0.3.2 on its own would run this folder with rope_theta 10000; transformers with
    that theta must disagree with the right model on these prompts, so the test above can tell."""
    wrong = Reference(Path(str(TRAINED)), rope_theta=10000.0)
    assert reference.model.config.rope_parameters["rope_theta"] == 100000.0
    differ = sum(
        wrong.greedy(ids, GREEDY_TOKENS)[0] != reference.greedy(ids, GREEDY_TOKENS)[0] for ids in prompts
    )
    record("trained rope_theta 10000 vs 100000", prompts_that_differ=differ, prompts=len(prompts))
    assert differ >= 2, "these prompts do not show a wrong rope_theta; lengthen them"


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
def test_trained_chat_answers(
    mode: str, gateway: GatewayProcess, served: set[str], reference: Reference
) -> None:
    """/v1/chat/completions renders the folder's chat template as transformers does and answers with
    transformers' greedy tokens. Whether the answer is right is the training's doing (a 2-minute run
    may teach 12 + 30 = 44), so it is recorded, not asserted."""
    need(served, FP16[mode], mode)
    ties, right = 0, []
    for question, answer in CHATS:
        body = {"model": FP16[mode], "messages": [{"role": "user", "content": question}], "temperature": 0,
                "max_tokens": CHAT_TOKENS, "logprobs": True}  # fmt: skip
        response = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        reply = response.json()["choices"][0]
        got = [entry["token"] for entry in reply["logprobs"]["content"]]
        rendered = reference.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        ids = reference.tokenizer.encode(rendered)
        ties += diverged_at_near_tie(
            reference, ids, CHAT_TOKENS, got, reply["finish_reason"], f"{mode}, {question!r}"
        )
        right.append(answer in reply["message"]["content"])
    record(f"trained chat vs transformers {mode}", chats=len(CHATS), near_ties=ties, right_answers=sum(right))
    assert ties <= 1, f"{ties} of {len(CHATS)} chats diverged at near-ties"


def _agreement(gateway: GatewayProcess, model: str, reference: Reference) -> float:
    """Teacher-forced top-1 agreement with transformers: every prefix of WINDOWS held-out windows,
    one greedy token each, against transformers' argmax at that position."""
    ids = reference.tokenizer.encode((Path(str(TRAINED)) / "heldout.txt").read_text(encoding="utf-8"))
    step = (len(ids) - WINDOW) // WINDOWS
    cases: list[tuple[list[int], str]] = []  # (prefix, transformers' next token)
    for w in range(WINDOWS):
        window = [0, *ids[w * step : w * step + WINDOW]]
        want = reference.logprobs(window).argmax(dim=-1).tolist()
        cases += [(window[: k + 1], reference.text(want[k])) for k in range(len(window) - 1)]
    # 16 prompts a request: a request the model's 32 job slots could never hold is refused.
    chunks = [cases[i : i + 16] for i in range(0, len(cases), 16)]

    def agreeing(chunk: list[tuple[list[int], str]]) -> int:
        prefixes = [prefix for prefix, _ in chunk]
        body = complete(gateway, model, prefixes, max_tokens=1, ignore_eos=True, logprobs=1)
        # The token's own text (its id decoded alone, as transformers' side is): the streamed text
        # of one token can differ, completing a character the prompt began.
        got = {c["index"]: c["logprobs"]["tokens"][0] for c in body["choices"]}
        return sum(got[k] == want for k, (_, want) in enumerate(chunk))

    with ThreadPoolExecutor(4) as pool:
        return sum(pool.map(agreeing, chunks)) / len(cases)


def _perplexity(gateway: GatewayProcess, model: str, reference: Reference) -> float:
    ids = reference.tokenizer.encode((Path(str(TRAINED)) / "heldout.txt").read_text(encoding="utf-8"))
    total, count = 0.0, 0
    for offset in range(0, 4 * 512, 512):
        window = [0, *ids[offset : offset + 512]]
        body = complete(gateway, model, window, max_tokens=0, echo=True, logprobs=1)
        values = [v for v in body["choices"][0]["logprobs"]["token_logprobs"] if v is not None]
        total, count = total - sum(values), count + len(values)
    return math.exp(total / count)


@pytest.mark.parametrize("name", ["fp16", *KV])
def test_kv_cache_precision_tracks_fp16(
    name: str, gateway: GatewayProcess, served: set[str], reference: Reference
) -> None:
    model = FP16[_v2_mode()] if name == "fp16" else name
    need(served, model, _v2_mode() if name == "fp16" or KV[name][0] == "exllamav2" else "exllamav3")
    agreement = _agreement(gateway, model, reference)
    record(f"trained top-1 agreement {model}", agreement=agreement)
    floor = AGREEMENT_MIN["fp16" if name == "fp16" else "kv-" + name.rsplit("-", 1)[1]]
    assert agreement >= floor, f"{model}: {agreement:.3f} of tokens agree with transformers (floor {floor})"


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_weights_track_fp16(
    name: str, gateway: GatewayProcess, served: set[str], reference: Reference
) -> None:
    variable, engine = QUANTIZED[name]
    if not os.environ.get(variable):
        pytest.skip(f"{variable} is not set (the conversion did not run or failed)")
    need(served, name, _v2_mode() if engine == "exllamav2" else "exllamav3")
    agreement = _agreement(gateway, name, reference)
    values: dict[str, float] = {"agreement": agreement}
    if name == "exl2":  # exllamav2 scores prompts (echo with logprobs); exllamav3 does not
        values["ppl"] = _perplexity(gateway, "exl2", reference)
        values["fp16_ppl"] = _perplexity(gateway, FP16[_v2_mode()], reference)
        values["ppl_ratio"] = values["ppl"] / values["fp16_ppl"]
    record(f"trained quantized {name}", **values)
    assert agreement >= AGREEMENT_MIN[name], values
    assert values.get("ppl_ratio", 1.0) <= EXL2_PPL_RATIO_MAX, values
