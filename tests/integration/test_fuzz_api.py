"""Fuzzing the HTTP API from its own OpenAPI description: no input may produce a 5xx.

Runs schemathesis (hypothesis underneath) in the pytest process against a real gateway with a
real CPU worker. Half the generated bodies get a served model's name, so fuzzed parameters reach
the worker and the engine, not only the 404 path. Then bodies a schema cannot describe (bytes that
are not UTF-8, deep nesting, lone surrogates, numbers past any bound) in random places of valid
requests: each gets a 400 naming the field, and the gateway logs no traceback.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.harness import GatewayProcess
from tests.integration.conftest import demo_entry, write_registry


@pytest.fixture(scope="module")
def fuzz_gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    entry = demo_entry("m", demo_model_dir, max_seq_len=256, defaults={"max_tokens": 8})
    # Fuzzed bodies may ask for store: true; their responses stay in the test's folder.
    config = write_registry(tmp_path_factory.mktemp("fuzz") / "models.yaml", [entry],
                            responses={"path": "responses.sqlite3"})  # fmt: skip
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
                body = response.json()
                if case.path.startswith("/v1/messages"):  # Anthropic's error shape on its routes
                    assert body["type"] == "error" and {"type", "message"} <= set(body["error"])
                else:
                    assert {"message", "type", "param", "code"} <= set(body["error"])

        call()
        checked.append(f"{operation.method.upper()} {operation.path}")
    assert "POST /v1/chat/completions" in checked
    # The fuzzer must have reached the engine (200s) and the validators (400s), not only 404s.
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert {200, 400} <= statuses[f"POST {path}"], sorted(statuses.items())


CHAT: dict[str, Any] = {
    "model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stop": ["zz"],
    "top_k": 5, "seed": 1, "min_tokens": 0, "logit_bias": {"5": 1.0}, "user": "u",
}  # fmt: skip
TEXT: dict[str, Any] = {"model": "m", "prompt": ["a", "b"], "max_tokens": 4, "top_k": 3, "stop": "zz"}
STRING_FIELDS = {"/v1/chat/completions": [("messages", 0, "content"), ("stop", 0), ("model",), ("user",)],
                 "/v1/completions": [("prompt", 1), ("stop",), ("model",)]}  # fmt: skip
INT_FIELDS = {"/v1/chat/completions": ["max_tokens", "top_k", "seed", "min_tokens"],
              "/v1/completions": ["max_tokens", "top_k"]}  # fmt: skip
SURROGATE = "\ud800"  # json.dumps writes it as the escape the review sent


def put(body: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    target: Any = body
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value


@st.composite
def hostile_requests(draw: st.DrawFn) -> tuple[str, bytes, str | None]:
    """(route, raw body, the field a 400 must name or None)."""
    route = draw(st.sampled_from(sorted(STRING_FIELDS)))
    body = json.loads(json.dumps(CHAT if route.endswith("chat/completions") else TEXT))
    kind = draw(st.sampled_from(["surrogate", "huge int", "deep", "bad utf-8", "long int"]))
    if kind == "surrogate":
        path = draw(st.sampled_from(STRING_FIELDS[route]))
        put(body, path, draw(st.text(max_size=3)) + SURROGATE + draw(st.text(max_size=3)))
        return route, json.dumps(body).encode(), ".".join(str(p) for p in path)
    if kind == "huge int":
        field = draw(st.sampled_from(INT_FIELDS[route]))
        body[field] = draw(st.integers(min_value=2**63, max_value=10**40))  # past every bound
        return route, json.dumps(body).encode(), field
    if kind == "deep":
        depth = draw(st.integers(min_value=65, max_value=200_000))
        raw = json.dumps(body).encode()
        return route, raw[:-1] + b', "x": ' + b"[" * depth + b"]" * depth + b"}", None
    if kind == "long int":
        raw = json.dumps(body).encode()
        return route, raw[:-1] + b', "top_k": ' + b"9" * draw(st.integers(4301, 20000)) + b"}", None
    raw = bytearray(json.dumps(body).encode())
    where = draw(st.integers(min_value=0, max_value=len(raw)))
    raw[where:where] = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80"]))
    return route, bytes(raw), None


def test_hostile_bodies_get_a_400_naming_the_field(fuzz_gateway: GatewayProcess) -> None:
    seen: set[str] = set()

    @given(request=hostile_requests())
    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    def call(request: tuple[str, bytes, str | None]) -> None:
        route, raw, field = request
        response = httpx.post(fuzz_gateway.url + route, content=raw, timeout=60,
                              headers={"Content-Type": "application/json"})  # fmt: skip
        assert response.status_code == 400, (route, raw[:200], response.text[:300])
        error = response.json()["error"]
        assert {"message", "type", "param", "code"} <= set(error)
        if field is not None:
            assert error["param"] == field, (raw[:200], error)
        seen.add(error["message"].split(":")[0])

    call()
    assert len(seen) >= 5  # the kinds of damage were all tried
    log = fuzz_gateway.log()
    assert "Traceback" not in log and " ERROR " not in log
