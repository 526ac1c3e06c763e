"""Fuzzing the HTTP API from its own OpenAPI description: no input may produce a 5xx.

Runs schemathesis (hypothesis underneath) in the pytest process against a real gateway with a
real CPU worker. Half the generated bodies get a served model's name, so fuzzed parameters reach
the worker and the engine, not only the 404 path.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.harness import GatewayProcess
from tests.integration.conftest import demo_entry, write_registry


@pytest.fixture(scope="module")
def fuzz_gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    entry = demo_entry("m", demo_model_dir, max_seq_len=256, defaults={"max_tokens": 8})
    config = write_registry(tmp_path_factory.mktemp("fuzz") / "models.yaml", [entry])
    with GatewayProcess(config) as gateway:
        yield gateway


def test_no_input_causes_a_server_error(fuzz_gateway: GatewayProcess) -> None:
    # Driven through hypothesis directly: schemathesis' pytest plugin does not support pytest 9 yet.
    schema = schemathesis.openapi.from_url(fuzz_gateway.url + "/openapi.json")
    # Every route the app has is in the description (generated from the routes). Routes that change
    # what runs (reload, load, unload) go last, so whatever they do cannot starve the others.
    operations = sorted(
        (result.ok() for result in schema.get_all_operations()),
        key=lambda op: (op.method.upper() == "POST" and op.path.startswith("/admin/"), op.path),
    )
    assert len(operations) >= 7
    checked: list[str] = []
    statuses: dict[str, set[int]] = {}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        def call(case: schemathesis.Case) -> None:
            # crc32, not hash(): str hashes change per process, and so would the bodies that reach "m".
            if (
                isinstance(case.body, dict)
                and "model" in case.body
                and zlib.crc32(repr(case.body).encode()) % 2
            ):
                case.body["model"] = "m"
            response = case.call(base_url=fuzz_gateway.url, timeout=60)
            statuses.setdefault(f"{case.method} {case.path}", set()).add(response.status_code)
            assert response.status_code < 500, (
                f"{case.method} {case.path}: {response.status_code} {response.text[:300]}"
            )
            if response.status_code >= 400:
                assert {"message", "type", "param", "code"} <= set(response.json()["error"])

        call()
        checked.append(f"{operation.method.upper()} {operation.path}")
    assert "POST /v1/chat/completions" in checked
    # The fuzzer must have reached the engine (200s) and the validators (400s), not only 404s.
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert {200, 400} <= statuses[f"POST {path}"], sorted(statuses.items())
