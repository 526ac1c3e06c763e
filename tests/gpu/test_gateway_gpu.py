"""The gateway serving GPU workers, through HTTP, as clients see it: every engine mode.

Runs in the pytest process on the GPU machine; each gateway is a real process (tests.harness)
whose workers load their models on the GPUs named in a registry written to tmp. Most tests run
once per engine mode against one gateway per mode (module scope).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.support import (
    NEAR_TIE,
    SKIP_REASON,
    first_difference,
    greedy,
    record,
    run_job,
    steps_by_request,
    stream_completion,
    wait_idle,
)

if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import httpx  # noqa: E402
import torch  # noqa: E402

from tests.gpu.conftest import require_mode  # noqa: E402
from tests.gpu.support import ENGINE_MODES, PAGED_MODES, TINY_SETTINGS  # noqa: E402
from tests.gpu.support import registry_entry as entry  # noqa: E402
from tests.gpu.support import start_gateway as start  # noqa: E402
from tests.harness import GatewayProcess, wait_until  # noqa: E402

pytestmark = pytest.mark.gpu

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village,"
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
MODE_LOG = {"exllamav2-paged": "exllamav2 paged on", "exllamav2-unpaged": "exllamav2 unpaged on",
            "exllamav3": "exllamav3 on"}  # fmt: skip


def completion(
    client: httpx.Client, model: str, prompt: str = PROMPT, max_tokens: int = 32, **kw: Any
) -> Any:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **kw,
    }
    response = client.post("/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module", params=list(ENGINE_MODES))
def served(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, GatewayProcess]]:
    """(mode, gateway) serving the tiny model as "tiny" in that mode."""
    mode = request.param
    require_mode(mode)
    with start(tmp_path_factory.mktemp(f"gw-{mode}"), [entry("tiny", tiny_model, [0], mode)]) as gw:
        yield mode, gw


@pytest.fixture
def client(served: tuple[str, GatewayProcess]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served[1].url) as http:
        yield http


Served = tuple[str, GatewayProcess]


def test_completion_matches_the_engine(
    served: Served, client: httpx.Client, engine_pool: Any, tiny_model: Path
) -> None:
    mode, _ = served
    engine = engine_pool.get(mode, tiny_model, TINY_SETTINGS)
    body = completion(client, "tiny", max_tokens=32)
    ids = engine.encode(PROMPT, True)
    direct = run_job(engine, ids, greedy(32))
    assert body["choices"][0]["text"] == direct.text
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == 32


def test_a_cut_prompt_matches_the_engine_on_its_last_tokens(
    served: Served, client: httpx.Client, engine_pool: Any, tiny_model: Path
) -> None:
    """truncate_prompt_tokens: the job sees the prompt's last k tokens, as the engine run on them."""
    mode, _ = served
    engine = engine_pool.get(mode, tiny_model, TINY_SETTINGS)
    ids = engine.encode(PROMPT, True)
    keep = len(ids) // 2
    body = completion(client, "tiny", max_tokens=16, truncate_prompt_tokens=keep)
    direct = run_job(engine, ids[-keep:], greedy(16))
    assert body["choices"][0]["text"] == direct.text
    assert body["usage"]["prompt_tokens"] == keep


def test_mode_is_visible_in_admin_workers_and_the_log(served: tuple[str, GatewayProcess]) -> None:
    mode, gw = served
    info = gw.workers()[0]["info"]
    assert info["engine"] == ENGINE_MODES[mode][0]
    assert info["paged"] is (mode != "exllamav2-unpaged")
    assert info["max_batch_size"] == (1 if mode == "exllamav2-unpaged" else 8)
    assert info["attention"] in ("flash-attn", "triton-paged") and info["cache_size"] >= 2048
    assert MODE_LOG[mode] in gw.log_path.read_text(errors="replace"), "the worker's log names its mode"


def test_chat_completion(client: httpx.Client) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 24}
    response = client.post("/v1/chat/completions", json={**body, "temperature": 0}, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")


def test_streaming_matches_non_streaming(served: tuple[str, GatewayProcess], client: httpx.Client) -> None:
    whole = completion(client, "tiny", max_tokens=64)["choices"][0]["text"]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    streamed = stream_completion(client, "/v1/completions", body)
    assert streamed.text == whole
    assert len(streamed.chunk_times) >= 16, "tokens must arrive as a stream, not in one lump"
    assert streamed.finish_reason == "length" and streamed.usage and streamed.usage["completion_tokens"] == 64
    gaps = sorted(b - a for a, b in zip(streamed.chunk_times, streamed.chunk_times[1:], strict=False))
    record(
        f"gateway stream tiny {served[0]}",
        ttft_ms=1000 * streamed.ttft,
        gap_p50_ms=1000 * gaps[len(gaps) // 2],
    )


def _cached_prompt_tokens(client: httpx.Client, model: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get("/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "gateway_prompt_tokens_cached_total" and sample.labels.get("model") == model
    )


def test_a_repeated_prompt_is_found_in_the_cache_and_counted(served: Served, client: httpx.Client) -> None:
    """A paged engine keeps a prompt's full pages: the second time the prompt comes, its usage says
    how many tokens came from the cache, and /metrics counts exactly those."""
    mode, _ = served
    if mode not in PAGED_MODES:
        pytest.skip("only the paged modes keep a prompt's pages for the next job")
    prompt = f"{mode} cache check. " + PROMPT * 40  # a few full 256-token pages
    before = _cached_prompt_tokens(client, "tiny")
    first = completion(client, "tiny", prompt=prompt, max_tokens=4)["usage"]
    second = completion(client, "tiny", prompt=prompt, max_tokens=4)["usage"]
    cached = [u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in (first, second)]
    record(f"gateway prefix cache tiny {mode}", prompt_tokens=second["prompt_tokens"], cached=cached)
    assert cached[0] < 256 and cached[1] >= 256 * (second["prompt_tokens"] // 256) - 256, cached
    assert _cached_prompt_tokens(client, "tiny") - before == sum(cached)


def _tokens(body: dict[str, Any]) -> tuple[list[str], list[dict[str, float]]]:
    logprobs = body["choices"][0]["logprobs"]
    return logprobs["tokens"], logprobs["top_logprobs"]


def test_concurrent_requests_match_solo_requests(
    served: tuple[str, GatewayProcess], client: httpx.Client
) -> None:
    """Eight concurrent greedy requests give what each gives alone (up to fp16 near-ties in a batch)."""
    prompts = [f"Story {i}: {PROMPT}" * (1 + i % 3) for i in range(8)]
    solo = [_tokens(completion(client, "tiny", p, max_tokens=128, logprobs=2)) for p in prompts]
    started = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: _tokens(completion(client, "tiny", p, max_tokens=128, logprobs=2)),
                                 prompts))  # fmt: skip
    record(f"gateway 8 concurrent tiny {served[0]}", wall_s=time.perf_counter() - started)
    for i, ((alone, tops), (batched, _)) in enumerate(zip(solo, together, strict=True)):
        at = first_difference(alone, batched)
        if at is None:
            continue
        assert served[0] != "exllamav2-unpaged", f"unpaged jobs run alone, yet request {i} differs at {at}"
        ranked = sorted(tops[at].items(), key=lambda kv: -kv[1])
        assert batched[at] in dict(ranked[:2]) and ranked[0][1] - ranked[1][1] < NEAR_TIE, (i, at, ranked)


def test_n_choices_are_distinct_samples(served: tuple[str, GatewayProcess], client: httpx.Client) -> None:
    """n > 1: the choices are separate jobs batched together, seeded seed, seed + 1, ..."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "seed": 7, "n": 3,
            "ignore_eos": True}  # fmt: skip
    response = client.post("/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    first = response.json()
    texts = [c["text"] for c in sorted(first["choices"], key=lambda c: c["index"])]
    assert len(texts) == 3 and len(set(texts)) == 3, texts
    assert all(c["finish_reason"] == "length" for c in first["choices"])
    assert first["usage"]["completion_tokens"] == 72


def test_disconnect_storm_returns_every_cache_page(served: tuple[str, GatewayProcess]) -> None:
    """Sixteen streams (twice the batch) are cut after two chunks: every job is cancelled, and the
    worker's stats show every cache page free again."""
    mode, gw = served
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}

    def cut(_: int) -> int:
        with httpx.Client(base_url=gw.url) as http:
            return len(stream_completion(http, "/v1/completions", body, max_chunks=2).chunk_times)

    before = gw.workers()[0]["stats"]
    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(cut, range(16))) == [2] * 16
    started = time.monotonic()

    def pages_all_free() -> dict[str, Any] | None:
        stats: dict[str, Any] = wait_idle(gw, timeout=20)[0]["stats"]
        return stats if stats["cache_pages_free"] == stats["cache_pages_total"] else None

    stats = wait_until(pages_all_free, "every cache page to be free", 20)
    cancelled = stats["jobs_cancelled"] - before["jobs_cancelled"]
    record(f"gateway disconnect storm {mode}", idle_after_s=time.monotonic() - started, cancelled=cancelled,
           pages_total=stats["cache_pages_total"])  # fmt: skip
    assert stats["cache_pages_total"] > 0 and stats["cache_pages_free"] == stats["cache_pages_total"], stats
    assert cancelled >= 16, stats
    with httpx.Client(base_url=gw.url) as http:  # the worker is free at once, not busy with zombies
        started = time.perf_counter()
        completion(http, "tiny", max_tokens=8)
        assert time.perf_counter() - started < 2.0


def test_two_models_on_one_gpu(tiny_model: Path, tiny_model_b: Path, tmp_path: Path) -> None:
    require_mode("exllamav2-paged")
    models = [entry("tiny-a", tiny_model, [0]), entry("tiny-b", tiny_model_b, [0])]
    with start(tmp_path, models) as gw, httpx.Client(base_url=gw.url) as http:
        with ThreadPoolExecutor(2) as pool:
            a, b = pool.map(lambda m: completion(http, m)["choices"][0]["text"], ["tiny-a", "tiny-b"])
        assert a != b, "two different models answered alike: requests went to one worker"
        workers = gw.workers()
    assert len({w["pid"] for w in workers}) == 2
    uuids = {d["uuid"] for w in workers for d in w["info"]["devices"]}
    assert all(len(w["info"]["devices"]) == 1 for w in workers) and len(uuids) == 1


@TWO_GPUS
def test_models_on_two_gpus_are_pinned(tiny_model: Path, tiny_model_b: Path, tmp_path: Path) -> None:
    require_mode("exllamav2-paged")
    models = [entry("tiny-a", tiny_model, [0]), entry("tiny-b", tiny_model_b, [1])]
    with start(tmp_path, models) as gw:
        workers = {w["model"]: w for w in gw.workers()}
    for name, gpu in (("tiny-a", 0), ("tiny-b", 1)):
        devices = workers[name]["info"]["devices"]
        assert len(devices) == 1 and devices[0]["visible_as"] == str(gpu), devices
    assert workers["tiny-a"]["info"]["devices"][0]["uuid"] != workers["tiny-b"]["info"]["devices"][0]["uuid"]


@TWO_GPUS
def test_one_model_autosplit_over_two_gpus(big_model: Path, tmp_path: Path) -> None:
    require_mode("exllamav2-paged")
    # An 8B model (16 GB) fits one GPU; leaving 12 GB of the first one's free memory makes autosplit
    # spill onto the second. Free, not total: engines of earlier tests in this session may hold some.
    free_gb = torch.cuda.mem_get_info(0)[0] / 1024**3
    reserve = round(free_gb - 12)
    model = entry("big", big_model, [0, 1], max_seq_len=4096, reserve_vram_gb=reserve, max_chunk_size=2048)
    with start(tmp_path, [model]) as gw:
        with httpx.Client(base_url=gw.url) as http:
            assert completion(http, "big", max_tokens=16)["usage"]["completion_tokens"] == 16
        devices = gw.workers()[0]["info"]["devices"]
    used = [d["memory_used_mib"] for d in devices]
    record("gateway autosplit 8B", reserve_gb=reserve, memory_used_mib=used)
    assert [d["visible_as"] for d in devices] == ["0", "1"]
    assert min(used) > 2000, f"the model did not spread over both GPUs: {used} MiB"


@pytest.mark.parametrize("mode", PAGED_MODES)
def test_first_request_after_ready_is_warm(mode: str, big_model: Path, tmp_path: Path) -> None:
    require_mode(mode)
    model = entry("big", big_model, [0], mode, max_seq_len=4096, max_chunk_size=2048)
    trace = tmp_path / "steps.jsonl"  # where a slow request spent its steps, recorded beside the times
    model["env"] = {"GATEWAY_STEP_TRACE": str(trace)}
    with start(tmp_path, [model]) as gw:
        with httpx.Client(base_url=gw.url) as http:
            seconds = []
            for _ in range(10):
                started = time.perf_counter()
                completion(http, "big", max_tokens=64)
                seconds.append(time.perf_counter() - started)
        worker = gw.workers()[0]
    median = statistics.median(seconds)
    steps = steps_by_request(trace)
    record(f"gateway first vs tenth 8B {mode}", first_s=seconds[0], tenth_s=seconds[9], median_s=median,
           warmup_s=worker.get("warmup_s"), load_s=worker.get("load_s"), seconds=seconds,
           steps_by_request=steps,
           library_env={k: v for k, v in os.environ.items() if k.startswith("EXL3_")})  # fmt: skip
    # What the warm-up must have paid (a kernel compiled or tuned for a shape, a graph captured, the
    # allocator grown) is a one-time cost in some step of the first request: no step of it may be
    # far longer than its usual one. The host's pace, which drifts by half from one request to the
    # next on the hosts seen (one whole request's steps 31.5 ms at the median, the next 19.9), is
    # the looser bound on the whole request.
    first = steps[0]
    assert first["longest_ms"] <= max(150.0, 5 * first["step_ms"]), (first, seconds)
    assert seconds[0] <= 2 * statistics.median(seconds[1:]), seconds


def _streams_tok_s(url: str, model: str, streams: int, max_tokens: int = 128) -> float:
    """Total generated tokens per second of `streams` concurrent greedy completions."""

    def one(_: int) -> int:
        with httpx.Client(base_url=url) as http:
            body = completion(http, model, max_tokens=max_tokens, ignore_eos=True)
            return int(body["usage"]["completion_tokens"])

    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        tokens = sum(pool.map(one, range(streams)))
    return tokens / (time.perf_counter() - started)


@TWO_GPUS
@pytest.mark.parametrize("split", ["layers", "tensor_parallel"])
def test_exllamav3_over_two_gpus(split: str, big_model: Path, tmp_path: Path) -> None:
    """The 8B shape over two GPUs by layers (the registry's gpus list) or tensor-parallel, against
    the same model on one GPU, at one stream and at 64; both splits must use both GPUs."""
    require_mode("exllamav3")
    # The cache as the benchmark sizes it: 64 jobs of a short prompt and 128 tokens take 64 pages, and
    # the default (max_seq_len x max_batch_size: 262,144 tokens, 32 GB in FP16) would not fit a split.
    settings: dict[str, Any] = {"max_seq_len": 4096, "max_chunk_size": 2048, "max_batch_size": 64,
                                "cache_size": 32768}  # fmt: skip
    if split == "tensor_parallel":
        settings["tensor_parallel"] = True
    else:  # GB per GPU: an autosplit would keep the 8B shape whole on one large GPU. Weights (16 GB),
        # the cache (4 GB) and the prefill's transients fit 32 GB over the two.
        settings["gpu_split"] = [14.0, 18.0]
    one_gpu = {**settings, "tensor_parallel": False, "gpu_split": None}
    models = {"one": entry("one", big_model, [0], "exllamav3", **one_gpu),
              "two": entry("two", big_model, [0, 1], "exllamav3", **settings)}  # fmt: skip
    for model in models.values():  # 64 streams must run as 64 jobs, not 32 and a queue
        model["limits"]["max_concurrent_jobs"] = 64
    expected_log = "tensor-parallel over 2 GPUs" if split == "tensor_parallel" else "layers split over 2 GPUs"
    figures: dict[str, float] = {}
    for name, model in models.items():
        with start(tmp_path / name, [model]) as gw:
            devices = gw.workers()[0]["info"]["devices"]
            figures[f"{name}_1"] = _streams_tok_s(gw.url, name, 1)
            figures[f"{name}_64"] = _streams_tok_s(gw.url, name, 64)
            if name == "two":
                used = [d["memory_used_mib"] for d in devices]
                assert min(used) > 2000, f"the model did not spread over both GPUs: {used} MiB"
                assert expected_log in gw.log_path.read_text(errors="replace")
    ratios = {
        "ratio_1": figures["two_1"] / figures["one_1"],
        "ratio_64": figures["two_64"] / figures["one_64"],
    }
    record(f"exllamav3 8B over two GPUs ({split})", **figures, **ratios)
