"""Fallbacks: a model whose queue is full, or whose worker is not ready, hands the request to the
model its registry entry names; the response, the access log and the metrics say so.

Real gateway, real CPU workers. `big` runs one job at a time with no queue, and a slow prompt
(the fault engine's <<slow>> marker) holds its one slot; `lonely` never finishes loading (its
load is delayed far past the test); both fall back to `small`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.harness import GatewayProcess
from tests.integration.conftest import demo_entry, write_registry

FAULTY = "test:tests.fault_engines.FaultyEngine"
ASK = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    config = write_registry(
        tmp_path_factory.mktemp("fallbacks") / "models.yaml",
        [
            demo_entry(
                "big",
                demo_model_dir,
                engine=FAULTY,
                fallbacks=["small"],
                limits={"max_concurrent_jobs": 1, "max_queued_requests": 0},
            ),
            demo_entry("small", demo_model_dir),
            demo_entry(
                "lonely",
                demo_model_dir,
                engine=FAULTY,
                fallbacks=["small"],
                env={"FAULT_LOAD_DELAY_S": "900"},
            ),
        ],  # fmt: skip
        readiness="any",
    )
    with GatewayProcess(config, env={"GATEWAY_ALLOW_TEST_ENGINES": "1"}) as gw:
        deadline = time.monotonic() + 120
        while not all(httpx.get(f"{gw.url}/health/ready/{m}").status_code == 200 for m in ("big", "small")):
            assert time.monotonic() < deadline, "big and small never became ready"
            time.sleep(0.2)
        yield gw


@pytest.fixture(scope="module")
def client(gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def fallbacks_counted(gateway: GatewayProcess, model: str, reason: str) -> float:
    metrics = httpx.get(gateway.url + "/metrics").text
    pattern = rf'gateway_fallbacks_total\{{fallback="small",model="{model}",reason="{reason}"\}} (\S+)'
    found = re.search(pattern, metrics)
    return float(found.group(1)) if found else 0.0


def test_a_model_without_a_ready_worker_falls_back(client: openai.OpenAI, gateway: GatewayProcess) -> None:
    reply = client.chat.completions.create(model="lonely", messages=ASK, max_tokens=4)  # type: ignore[arg-type]
    assert reply.model == "small" and reply.choices[0].message.content
    chunks = list(client.chat.completions.create(model="lonely", messages=ASK, max_tokens=4, stream=True))  # type: ignore[arg-type]
    assert {c.model for c in chunks} == {"small"}
    with anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0) as sdk:
        assert sdk.messages.create(model="lonely", max_tokens=4, messages=ASK).model == "small"  # type: ignore[arg-type]
    assert fallbacks_counted(gateway, "lonely", "no_ready_worker") == 3
    assert "fallback_from=lonely(no_ready_worker)" in gateway.log()


def test_a_model_with_a_full_queue_falls_back(client: openai.OpenAI, gateway: GatewayProcess) -> None:
    slow = {"model": "big", "prompt": "<<slow>> tell a long story", "max_tokens": 400, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", gateway.url + "/v1/completions", json=slow, timeout=60) as holding:
        assert holding.status_code == 200
        lines = holding.iter_lines()  # kept: a dropped iterator would close the stream
        next(lines)  # admitted: big's one slot is taken, and it has no queue
        before = fallbacks_counted(gateway, "big", "queue_full")
        reply = client.completions.create(model="big", prompt="Hello", max_tokens=4)
        assert reply.model == "small" and reply.choices[0].text
    assert fallbacks_counted(gateway, "big", "queue_full") == before + 1
    assert "fallback_from=big(queue_full)" in gateway.log()
    # With its slot free again (the held stream's client left), big answers itself.
    deadline = time.monotonic() + 30
    while any(w["in_flight"] for w in gateway.workers() if w["model"] == "big"):
        assert time.monotonic() < deadline, "big's slot was never given back"
        time.sleep(0.1)
    assert client.completions.create(model="big", prompt="Hello", max_tokens=2).model == "big"
