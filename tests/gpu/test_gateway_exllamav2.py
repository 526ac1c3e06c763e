"""The gateway serving exllamav2 workers on real GPUs, through HTTP, as clients see it.

Runs in the pytest process on the GPU machine; each test starts a real gateway (tests.harness)
whose workers load their models on the GPUs named in a registry written to tmp.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.support import (
    SKIP_REASON,
    greedy,
    record,
    run_job,
    stream_completion,
    wait_idle,
    write_registry,
)

if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import httpx  # noqa: E402
import torch  # noqa: E402

from tests.gpu.support import gateway_env  # noqa: E402
from tests.harness import GatewayProcess  # noqa: E402

pytestmark = pytest.mark.gpu

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village,"
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")


def entry(name: str, path: Path, gpus: list[int], **settings: Any) -> dict[str, Any]:
    base = {"max_seq_len": 2048, "max_batch_size": 4, "max_chunk_size": 512}
    return {"name": name, "engine": "exllamav2", "path": str(path), "gpus": gpus, **base, **settings}


def start(tmp_path: Path, models: list[dict[str, Any]]) -> GatewayProcess:
    config = write_registry(tmp_path / "models.yaml", models)
    return GatewayProcess(config, env=gateway_env(), ready_timeout=300, log_path=tmp_path / "gateway.log")


def completion(
    client: httpx.Client, model: str, prompt: str = PROMPT, max_tokens: int = 32
) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = client.post("/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    with start(tmp_path_factory.mktemp("gw-one"), [entry("tiny", tiny_model, [0])]) as gw:
        yield gw


@pytest.fixture
def client(gateway: GatewayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url) as http:
        yield http


def test_completion_matches_the_engine(client: httpx.Client, tiny_engine: Any) -> None:
    body = completion(client, "tiny", max_tokens=32)
    ids = tiny_engine.encode(PROMPT, True)
    direct = run_job(tiny_engine, ids, greedy(32))
    assert body["choices"][0]["text"] == direct.text
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == 32


def test_chat_completion(client: httpx.Client) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 24}
    response = client.post("/v1/chat/completions", json={**body, "temperature": 0}, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")


def test_streaming_matches_non_streaming(client: httpx.Client) -> None:
    whole = completion(client, "tiny", max_tokens=64)["choices"][0]["text"]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    streamed = stream_completion(client, "/v1/completions", body)
    assert streamed.text == whole
    assert len(streamed.chunk_times) >= 16, "tokens must arrive as a stream, not in one lump"
    assert streamed.finish_reason == "length" and streamed.usage and streamed.usage["completion_tokens"] == 64
    gaps = sorted(b - a for a, b in zip(streamed.chunk_times, streamed.chunk_times[1:], strict=False))
    record("gateway stream tiny", ttft_ms=1000 * streamed.ttft, gap_p50_ms=1000 * gaps[len(gaps) // 2])


def test_concurrent_requests_to_one_model(client: httpx.Client) -> None:
    prompts = [f"Story {i}: {PROMPT}" for i in range(4)]
    solo = [completion(client, "tiny", p)["choices"][0]["text"] for p in prompts]
    started = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: completion(client, "tiny", p)["choices"][0]["text"], prompts))
    record("gateway 4 concurrent tiny", wall_s=time.perf_counter() - started)
    assert together == solo


def test_client_disconnect_cancels_the_job(gateway: GatewayProcess, client: httpx.Client) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1900, "temperature": 0, "ignore_eos": True}
    cut = stream_completion(client, "/v1/completions", body, max_chunks=3)
    assert len(cut.chunk_times) == 3
    started = time.monotonic()
    workers = wait_idle(gateway, timeout=10)
    record("gateway disconnect", idle_after_s=time.monotonic() - started)
    assert workers[0]["stats"].get("jobs_cancelled", 0) >= 1, workers[0]["stats"]
    # The worker is free at once: a short request is not stuck behind 1900 zombie tokens.
    started = time.perf_counter()
    completion(client, "tiny", max_tokens=8)
    assert time.perf_counter() - started < 2.0


def test_two_models_on_one_gpu(tiny_model: Path, tiny_model_b: Path, tmp_path: Path) -> None:
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
    models = [entry("tiny-a", tiny_model, [0]), entry("tiny-b", tiny_model_b, [1])]
    with start(tmp_path, models) as gw:
        workers = {w["model"]: w for w in gw.workers()}
    for name, gpu in (("tiny-a", 0), ("tiny-b", 1)):
        devices = workers[name]["info"]["devices"]
        assert len(devices) == 1 and devices[0]["visible_as"] == str(gpu), devices
    assert workers["tiny-a"]["info"]["devices"][0]["uuid"] != workers["tiny-b"]["info"]["devices"][0]["uuid"]


@TWO_GPUS
def test_one_model_autosplit_over_two_gpus(big_model: Path, tmp_path: Path) -> None:
    # An 8B model fits one H200; reserving most of each GPU makes autosplit spill onto the second.
    total_gb = torch.cuda.get_device_properties(0).total_memory / 1024**3
    reserve = round(total_gb - 12)
    with start(tmp_path, [entry("big", big_model, [0, 1], max_seq_len=4096, reserve_vram_gb=reserve)]) as gw:
        with httpx.Client(base_url=gw.url) as http:
            assert completion(http, "big", max_tokens=16)["usage"]["completion_tokens"] == 16
        devices = gw.workers()[0]["info"]["devices"]
    used = [d["memory_used_mib"] for d in devices]
    record("gateway autosplit 8B", reserve_gb=reserve, memory_used_mib=used)
    assert [d["visible_as"] for d in devices] == ["0", "1"]
    assert min(used) > 2000, f"the model did not spread over both GPUs: {used} MiB"


def test_first_request_after_ready_is_warm(big_model: Path, tmp_path: Path) -> None:
    with start(tmp_path, [entry("big", big_model, [0], max_seq_len=4096)]) as gw:
        with httpx.Client(base_url=gw.url) as http:
            seconds = []
            for _ in range(10):
                started = time.perf_counter()
                completion(http, "big", max_tokens=64)
                seconds.append(time.perf_counter() - started)
        info = gw.workers()[0]["info"]
    median = statistics.median(seconds)
    record("gateway first vs tenth 8B", first_s=seconds[0], tenth_s=seconds[9], median_s=median,
           warmup_s=info.get("warmup_s"), load_s=info.get("load_s"))  # fmt: skip
    assert seconds[0] <= 1.5 * seconds[9], seconds
