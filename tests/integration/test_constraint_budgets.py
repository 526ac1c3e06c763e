"""Output constraints cannot stall a worker: a regular expression too large is refused at once, one
too slow to compile is refused at its time budget, and the worker's other streams never pause.

A real gateway and CPU worker; the constraint is sent as a JSON schema string pattern, as in the
review that found a 30,000-repeat pattern killing a worker.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import GatewayProcess
from tests.integration.conftest import demo_entry, write_registry


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    limits = {"max_concurrent_jobs": 8, "max_constraint_compile_s": 0.2, "max_constraint_states": 4096}
    config = write_registry(
        tmp_path_factory.mktemp("budgets") / "models.yaml", [demo_entry("m", demo_model_dir, limits=limits)]
    )
    with GatewayProcess(config) as gw:
        yield gw


def schema_with(pattern: str) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {
            "name": "code",
            "schema": {
                "type": "object",
                "properties": {"code": {"type": "string", "pattern": pattern}},
                "required": ["code"],
            },  # fmt: skip
        },
    }


def constrained(gateway: GatewayProcess, pattern: str) -> tuple[httpx.Response, float]:
    # The schema lets whitespace in at five places, up to 12 characters each: a random model may
    # spend 60 tokens there, so the budget leaves room to close the object.
    body = {"model": "m", "messages": [{"role": "user", "content": "a code"}], "max_tokens": 120,
            "response_format": schema_with(pattern)}  # fmt: skip
    started = time.monotonic()
    response = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=60)
    return response, time.monotonic() - started


def test_constraints_over_budget_are_refused_and_other_streams_never_pause(gateway: GatewayProcess) -> None:
    gaps: list[float] = []
    stream_done = threading.Event()

    def stream() -> None:
        body = {"model": "m", "prompt": "go", "max_tokens": 1200, "ignore_eos": True, "stream": True,
                "logprobs": 0}  # fmt: skip
        last = None
        with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
        stream_done.set()

    # The compiler's process starts with the first constraint (a second of CPU, importing the
    # libraries); started here, before the stream, so the gaps measure compiling alone.
    warm, _ = constrained(gateway, "^[0-9]{3}$")
    assert warm.status_code == 200, warm.text
    runner = threading.Thread(target=stream)
    runner.start()
    time.sleep(0.5)
    # Far too large: refused before anything is built.
    huge, huge_s = constrained(gateway, "^[a-z]{1,30000}$")
    # Small enough to try, too slow for the 0.2 s budget (about 3,500 states).
    slow, slow_s = constrained(gateway, "^[a-z]{1,3500}$")
    # An ordinary pattern compiles off the loop and the request is served.
    fine, _ = constrained(gateway, "^[a-z]{2,8}$")
    runner.join(120)
    assert stream_done.is_set()

    assert huge.status_code == 400 and huge_s < 1.0, huge.text
    assert "max_constraint_states" in huge.json()["error"]["message"]
    assert huge.json()["error"]["param"] == "response_format"
    assert slow.status_code == 400 and slow_s < 2.0, slow.text
    assert "could not be compiled within 0.2s" in slow.json()["error"]["message"]
    assert fine.status_code == 200, fine.text
    assert fine.json()["choices"][0]["finish_reason"] == "stop", fine.text
    code = json.loads(fine.json()["choices"][0]["message"]["content"])["code"]
    assert 2 <= len(code) <= 8 and code.isalpha()
    # The stream kept going all along: no gap near a compile's duration, and the worker never restarted.
    # (On a thread, the slow compile's half second of GIL showed here as one half-second gap.)
    assert len(gaps) > 1000 and max(gaps) < 0.2, max(gaps)
    workers = gateway.workers()
    assert workers[0]["restarts"] == 0 and workers[0]["state"] == "ready"
