"""The worker's per-step trace (GATEWAY_STEP_TRACE in a model's `env`): one JSON line per engine
step, with the step's time, its jobs, tokens and prompt tokens prefilled, the loop's time around
it, and how long each Step frame waited before the link thread took it.

Runs in the pytest process against one real gateway with the transformers demo model; the trace is
the file the worker writes.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.harness import GatewayProcess, wait_until
from tests.integration.conftest import demo_entry, write_registry

TOKENS = 12


def test_every_step_of_a_stream_is_traced_with_the_link_threads_wait(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    config = write_registry(
        tmp_path / "models.yaml", [demo_entry("m", demo_model_dir, env={"GATEWAY_STEP_TRACE": str(trace)})]
    )
    with GatewayProcess(config) as gw:
        body = {"model": "m", "prompt": "hello there, how are you", "max_tokens": TOKENS, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            chunks = [line for line in response.iter_lines() if line.startswith("data: {")]
        assert len(chunks) >= 1
        prompt_tokens = json.loads(chunks[-1][len("data: ") :])["usage"]["prompt_tokens"]
        # The trace is buffered in the worker: a stop closes it.
    lines = wait_until(lambda: trace.exists() and trace.read_text().splitlines(), "the trace's lines")
    steps = [json.loads(line) for line in lines]
    assert sum(step["tokens"] for step in steps) == TOKENS
    assert sum(step["first"] for step in steps) == 1
    # The demo engine prefills the whole prompt, in the step that gives the first token.
    assert [step["prefill"] for step in steps if step["first"]] == [prompt_tokens] and prompt_tokens > 1
    assert sum(step["prefill"] for step in steps) == prompt_tokens
    assert all(step["cached"] == 0 for step in steps)  # the CPU engine keeps no prefix cache
    assert all(step["jobs"] == 1 and step["step_ms"] > 0 for step in steps)
    assert all(step["outside_ms"] is None or step["outside_ms"] >= 0 for step in steps)
    assert all(step["sleeps"] >= 0 for step in steps)
    assert [step["sleeps_outside"] is None for step in steps] == [True] + [False] * (len(steps) - 1)
    # A step's frame is taken after its line is written, so its wait shows on a later line (one
    # line may show several frames): every Step frame but the last one's, and any heartbeats.
    assert sum(step.get("link_frames", 0) for step in steps) >= len(steps) - 1
    waits = [step["link_ms"] for step in steps if "link_frames" in step]
    assert waits and all(wait >= 0 for wait in waits), steps


def _burst(url: str, count: int) -> None:
    """`count` completions sent at once: each client's connection is open before a barrier lets
    them all go, as an SDK's pool holds them."""
    body = {"model": "m", "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
    ready = threading.Barrier(count)

    def send(_: int) -> int:
        with httpx.Client(base_url=url, timeout=60) as client:
            client.get("/v1/models")
            ready.wait()
            return client.post("/v1/completions", json=body).status_code

    with ThreadPoolExecutor(count) as pool:
        assert list(pool.map(send, range(count))) == [200] * count


def _first_steps(trace: Path) -> list[dict[str, int]]:
    lines = wait_until(lambda: trace.exists() and trace.read_text().splitlines(), "the trace's lines")
    return [step for step in map(json.loads, lines) if step["first"]]


def test_an_idle_worker_takes_a_burst_of_requests_into_one_first_step(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """limits.admission_window_ms: requests sent together reach the worker one gateway admission
    apart; an idle worker waits for the rest of them, so that all are prefilled in its first step."""
    trace = tmp_path / "trace.jsonl"
    limits = {"max_concurrent_jobs": 32, "max_queued_requests": 64, "admission_window_ms": 100}
    entry = demo_entry("m", demo_model_dir, env={"GATEWAY_STEP_TRACE": str(trace)}, limits=limits)
    with GatewayProcess(write_registry(tmp_path / "models.yaml", [entry])) as gw:
        _burst(gw.url, 4)
    first = _first_steps(trace)
    assert [(step["jobs"], step["first"]) for step in first] == [(4, 4)], first
