"""API keys and Prometheus metrics on a real gateway: two CPU workers, a keys file, an env key.

Runs in the pytest process against one module-scoped gateway. Covers deny-by-default, both ways
of sending a key, model scopes, admin scope, rate limits, keys-file reloads without a restart,
the loopback-only rule without keys, and /metrics after real requests.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import REPO_ROOT, GatewayProcess, wait_until
from tests.integration.conftest import demo_entry, write_registry

ALICE = "alice-0123456789abcdef"  # demo-a only, stored as a digest
OPS = "ops-0123456789abcdefgh"  # admin
LIMITED = "limited-0123456789abcd"  # demo-b, 2 requests per minute
ENV_KEY = "env-0123456789abcdefgh"  # GATEWAY_API_KEYS: every model
BOB = "bob-0123456789abcdefghi"  # added while the gateway runs
PROM = "prom-0123456789abcdefgh"  # metrics only
THRIFTY = "thrifty-0123456789abcd"  # demo-b, 30 tokens a day, low priority

KEYS = f"""
keys:
  - name: alice
    key_sha256: {hashlib.sha256(ALICE.encode()).hexdigest()}
    models: [demo-a]
  - name: ops
    key: {OPS}
    admin: true
  - name: limited
    key: {LIMITED}
    models: [demo-b]
    rate_limit_rpm: 2
  - name: prometheus
    key: {PROM}
    metrics: true
  - name: thrifty
    key: {THRIFTY}
    models: [demo-b]
    budget_tokens_per_day: 30
    priority: low
"""


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    folder = tmp_path_factory.mktemp("auth")
    (folder / "keys.yaml").write_text(KEYS)
    (folder / "keys.yaml").chmod(0o600)
    config = write_registry(
        folder / "models.yaml",
        [demo_entry("demo-a", demo_model_dir), demo_entry("demo-b", demo_model_dir)],
        api_keys_file="keys.yaml",
    )
    env = {"GATEWAY_API_KEYS": ENV_KEY, "GATEWAY_ADMIN_KEYS": ""}
    with GatewayProcess(config, env=env, wait_ready=False) as gw:
        wait_until_ready(gw, bearer(OPS), timeout=120)
        yield gw


def wait_until_ready(gw: GatewayProcess, headers: dict[str, str], timeout: float) -> None:
    """The harness's own wait sends no key; this one does."""

    def ready() -> bool:
        assert gw.process is not None and gw.process.poll() is None, gw.log()  # died: fail now
        return httpx.get(gw.url + "/health/ready", headers=headers, timeout=2).status_code == 200

    wait_until(ready, "the gateway to be ready", timeout, context=gw.events, retry_on=(httpx.HTTPError,))


def get(gw: GatewayProcess, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.get(gw.url + path, headers=headers or {}, timeout=10)


def chat(gw: GatewayProcess, key: str, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **extra}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=bearer(key), timeout=60)


def test_live_is_open_everything_else_needs_a_key(gateway: GatewayProcess) -> None:
    assert get(gateway, "/health/live").status_code == 200
    # Readiness too, for load balancers: ready or not, and nothing about the models.
    assert get(gateway, "/health/ready").json() == {"status": "ready"}
    for path in ("/v1/models", "/health/ready/demo-a", "/metrics", "/admin/workers"):
        response = get(gateway, path)
        assert response.status_code == 401, path
        assert response.json()["error"] == {
            "message": response.json()["error"]["message"],
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    assert get(gateway, "/v1/models", bearer(ALICE + "x")).status_code == 401
    assert get(gateway, "/health/ready", bearer(ALICE)).status_code == 200


def test_bearer_and_x_api_key_with_model_scopes(gateway: GatewayProcess) -> None:
    for headers in (bearer(ALICE), {"x-api-key": ALICE}):
        models = get(gateway, "/v1/models", headers).json()["data"]
        assert [m["id"] for m in models] == ["demo-a"]
    assert [m["id"] for m in get(gateway, "/v1/models", bearer(ENV_KEY)).json()["data"]] == [
        "demo-a",
        "demo-b",
    ]
    assert chat(gateway, ALICE, "demo-a").status_code == 200
    refused = chat(gateway, ALICE, "demo-b")
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
    assert get(gateway, "/v1/models/demo-b", bearer(ALICE)).status_code == 404


def test_admin_routes_need_an_admin_key(gateway: GatewayProcess) -> None:
    response = get(gateway, "/admin/workers", bearer(ALICE))
    assert response.status_code == 403 and response.json()["error"]["code"] == "permission_denied"
    workers = get(gateway, "/admin/workers", bearer(OPS)).json()["workers"]
    assert sorted(w["id"] for w in workers) == ["demo-a#0", "demo-b#0"]


def test_rate_limited_key_gets_429_with_retry_after(gateway: GatewayProcess) -> None:
    statuses = [get(gateway, "/v1/models", bearer(LIMITED)) for _ in range(3)]
    assert [r.status_code for r in statuses] == [200, 200, 429]
    assert statuses[2].json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(statuses[2].headers["Retry-After"]) <= 30
    # Counted with the model asked for, where the request names one (body or path): the per-key
    # panel filtered by model shows the key's 429s for it.
    assert chat(gateway, LIMITED, "demo-b").status_code == 429
    assert get(gateway, "/v1/models/demo-b", bearer(LIMITED)).status_code == 429
    samples = metric_samples(gateway)
    for model, endpoint in [("", "/v1/models"), ("demo-b", "/v1/chat/completions"),
                            ("demo-b", "/v1/models/<path:model_id>")]:  # fmt: skip
        labels = {("model", model), ("endpoint", endpoint), ("status", "429")}
        assert samples.get(("gateway_requests_total", frozenset(labels))) == 1, (model, endpoint)
    for model, count in [("", 1), ("demo-b", 2)]:
        labels = {("key", "limited"), ("model", model), ("status", "429")}
        assert samples.get(("gateway_key_requests_total", frozenset(labels))) == count, model


def test_keys_file_edit_is_picked_up_without_restart(gateway: GatewayProcess) -> None:
    keys_file = gateway.config_path.parent / "keys.yaml"
    try:
        keys_file.write_text(KEYS + f"  - {{name: bob, key: {BOB}, models: ['*']}}\n")
        wait_until(
            lambda: get(gateway, "/v1/models", bearer(BOB)).status_code == 200, "the new key to be picked up"
        )
        keys_file.write_text("keys: [{name: broken}]\n")

        def broken_file_refused() -> bool:  # a request makes the gateway look (once a second at most)
            assert get(gateway, "/v1/models", bearer(BOB)).status_code == 200  # old keys stay
            return "keeping the previous keys" in gateway.log()

        wait_until(broken_file_refused, "the broken keys file to be refused", context=gateway.events)
        assert BOB not in gateway.log() and OPS not in gateway.log()  # keys are never logged
    finally:
        keys_file.write_text(KEYS)


def test_metrics_after_requests(gateway: GatewayProcess) -> None:
    assert chat(gateway, ALICE, "demo-a").status_code == 200
    assert chat(gateway, ALICE, "demo-a", temperature=7).status_code == 400  # refused by the schema
    assert chat(gateway, ALICE, "demo-a", max_tokens=100_000).status_code == 400  # refused by the worker
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST",
        gateway.url + "/v1/chat/completions",
        json={"model": "demo-b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **stream},
        headers=bearer(ENV_KEY),
        timeout=60,
    ) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["usage"]["completion_tokens"] > 0
    # vLLM's tokenizer routes, with and without /v1: the same API, counted either way.
    for path, body in [("tokenize", {"prompt": "Hi"}), ("detokenize", {"tokens": [1, 2]})]:
        for prefix in ("/", "/v1/"):
            reply = httpx.post(gateway.url + prefix + path, json={"model": "demo-a", **body},
                               headers=bearer(ALICE), timeout=30)  # fmt: skip
            assert reply.status_code == 200, reply.text
        refused = httpx.post(gateway.url + "/" + path, json={"model": "demo-a"}, headers=bearer(ALICE))
        assert refused.status_code == 400, refused.text  # no prompt, no tokens
    text = get(gateway, "/metrics", bearer(PROM)).text
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value

    def value(name: str, **labels: str) -> float:
        return samples.get((name, frozenset(labels.items())), 0.0)

    requests = "gateway_requests_total"
    assert value(requests, model="demo-a", endpoint="/v1/chat/completions", status="200") >= 2
    assert value(requests, model="demo-b", endpoint="/v1/chat/completions", status="200") >= 1
    assert value(requests, model="", endpoint="/v1/models", status="401") >= 1
    assert value(requests, model="demo-a", endpoint="/v1/chat/completions", status="400") >= 2
    for endpoint in ("/tokenize", "/v1/tokenize", "/detokenize", "/v1/detokenize"):
        assert value(requests, model="demo-a", endpoint=endpoint, status="200") >= 1, endpoint
    for endpoint in ("/tokenize", "/detokenize"):
        assert value(requests, model="demo-a", endpoint=endpoint, status="400") >= 1, endpoint
    assert value("process_resident_memory_bytes") > 0 and value("process_cpu_seconds_total") > 0
    for model in ("demo-a", "demo-b"):
        assert value("gateway_time_to_first_token_seconds_count", model=model) >= 1
        assert value("gateway_time_to_first_token_seconds_bucket", model=model, le="+Inf") >= 1
        assert value("gateway_request_duration_seconds_count", model=model) >= 1
        assert value("gateway_prompt_tokens_total", model=model) > 0
        assert value("gateway_completion_tokens_total", model=model) > 0
        # Queue time apart from time to first token; the engine's phases of each finished job.
        phases = ("request_queue_time", "engine_queue_time", "request_prefill_time", "request_decode_time")
        for phase in phases:
            assert value(f"gateway_{phase}_seconds_count", model=model) >= 1, phase
        pair = {("model", model), ("replica", "0")}  # the replica's index: stable across restarts
        assert value("gateway_worker_up", **dict(pair)) == 1
        assert value("gateway_worker_state", **dict(pair), state="ready") == 1
        for state in ("failed", "unloaded", "lost", "stopped", "restarting", "draining"):
            assert ("gateway_worker_state", frozenset({*pair, ("state", state)})) in samples
            assert value("gateway_worker_state", **dict(pair), state=state) == 0
        assert value("gateway_model_load_duration_seconds", **dict(pair), phase="load") > 0
        assert ("gateway_model_load_duration_seconds", frozenset({*pair, ("phase", "warmup")})) in samples
        assert ("gateway_worker_restarts_total", frozenset(pair)) in samples
        assert ("gateway_queue_depth", frozenset({("model", model)})) in samples
        assert ("gateway_active_jobs", frozenset(pair)) in samples
        # Engine figures travel with heartbeats: batching use and KV-cache use (GPU memory on GPU workers).
        assert ("gateway_jobs_per_step", frozenset(pair)) in samples
        assert ("gateway_kv_cache_usage_ratio", frozenset(pair)) in samples
    assert value("gateway_inter_token_latency_seconds_count", model="demo-b") >= 1


def test_a_scoped_key_cannot_tell_forbidden_models_from_missing_ones(gateway: GatewayProcess) -> None:
    """The review's oracle: {"model": X} alone answered 404 for a forbidden X and 400 for a missing
    one. Both now get the same 404 from the same place, in the same time."""

    def ask(model: str) -> tuple[int, dict[str, Any], float]:
        started = time.perf_counter()
        response = httpx.post(gateway.url + "/v1/chat/completions", json={"model": model},
                              headers=bearer(ALICE), timeout=10)  # fmt: skip
        return response.status_code, response.json(), time.perf_counter() - started

    timings: dict[str, list[float]] = {"demo-b": [], "no-such-model": []}
    for _ in range(40):  # interleaved, so load on the host weighs on both alike
        for model, seconds in timings.items():
            status, body, took = ask(model)
            assert status == 404, body
            expected = {"message": f"The model '{model}' does not exist", "type": "invalid_request_error",
                        "param": "model", "code": "model_not_found"}  # fmt: skip
            assert body == {"error": expected}
            seconds.append(took)
    forbidden, missing = (sorted(v)[len(v) // 2] for v in timings.values())
    assert abs(forbidden - missing) < 0.3 * min(forbidden, missing) + 0.001, (forbidden, missing)
    assert ask("demo-a")[0] == 400  # a model it may use goes on to validation (messages missing)


def test_metrics_and_readiness_show_a_scoped_key_nothing_beyond_its_models(gateway: GatewayProcess) -> None:
    refused = get(gateway, "/metrics", bearer(ALICE))
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
    for key in (PROM, OPS, ENV_KEY):  # metrics, admin, and every-model keys see every model
        assert 'model="demo-b"' in get(gateway, "/metrics", bearer(key)).text
    assert list(get(gateway, "/health/ready", bearer(ALICE)).json()["models"]) == ["demo-a"]
    for model in ("demo-b", "no-such-model"):
        response = get(gateway, f"/health/ready/{model}", bearer(ALICE))
        assert response.status_code == 404
        assert response.json()["error"]["message"] == f"The model '{model}' does not exist"
    assert get(gateway, "/v1/models", bearer(PROM)).json()["data"] == []  # metrics only: no model


def test_a_newline_in_the_path_cannot_forge_a_log_line(gateway: GatewayProcess) -> None:
    forged = "2026-01-01 00:00:00,000 INFO gateway.access: GET /admin/reload 200 FORGED"
    paths = ("/v1/models", "/admin/workers", "/no-such-route")
    for path in paths:  # refused by the key check, or 404
        response = get(gateway, path + "%0A" + forged.replace(" ", "%20"))
        assert response.status_code in (401, 404)

    def logged() -> list[str] | None:  # the access line of each request, its path escaped
        lines = gateway.log().splitlines()
        escaped = [f"gateway.access: GET {path}\\n2026-01-01" for path in paths]
        return lines if all(any(e in line for line in lines) for e in escaped) else None

    lines = wait_until(logged, "the three requests in the access log", context=gateway.events)
    assert not [line for line in lines if line.startswith("2026-01-01")]


def test_non_loopback_bind_without_keys_is_refused(tmp_path: Path, demo_model_dir: Path) -> None:
    config = write_registry(tmp_path / "models.yaml", [demo_entry("demo-a", demo_model_dir)])
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    command = [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--host", "0.0.0.0"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode == 2
    assert "refusing to listen on '0.0.0.0' without API keys" in result.stderr
    assert "Traceback" not in result.stderr


def metric_samples(gw: GatewayProcess) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = get(gw, "/metrics", bearer(PROM)).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_usage_per_key_in_metrics_and_a_spent_budget_is_a_429_until_the_day_turns(
    gateway: GatewayProcess,
) -> None:
    first = chat(gateway, THRIFTY, "demo-b", max_tokens=24, ignore_eos=True)
    assert first.status_code == 200, first.text
    used = first.json()["usage"]["total_tokens"]
    assert used >= 30  # the budget is spent by this one request, which still ran to its end
    refused = chat(gateway, THRIFTY, "demo-b")
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "insufficient_quota" and "30 tokens per day" in error["message"]
    assert 0 < int(refused.headers["Retry-After"]) <= 86_400
    samples = metric_samples(gateway)
    key = {("key", "thrifty"), ("model", "demo-b")}
    assert samples[("gateway_key_tokens_total", frozenset({*key, ("kind", "prompt")}))] > 0
    assert samples[("gateway_key_tokens_total", frozenset({*key, ("kind", "completion")}))] == 24
    assert samples[("gateway_key_requests_total", frozenset({*key, ("status", "200")}))] == 1
    assert samples[("gateway_key_requests_total", frozenset({*key, ("status", "429")}))] == 1
    assert ("gateway_key_requests_total", frozenset({("key", "thrifty"), ("model", ""), ("status", "429")})) \
        not in samples  # fmt: skip
    # Other keys are not affected by thrifty's budget.
    assert chat(gateway, ENV_KEY, "demo-b").status_code == 200


def test_a_priority_header_that_names_no_class_is_a_400_naming_it(gateway: GatewayProcess) -> None:
    body = {"model": "demo-a", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    headers = bearer(ALICE) | {"X-Priority": "urgent"}
    reply = httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "X-Priority"
    headers["X-Priority"] = "low"
    assert (
        httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=60).status_code
        == 200
    )


def test_a_priority_above_the_keys_class_is_a_403_naming_it(gateway: GatewayProcess) -> None:
    """Capping it quietly would serve the request at a class it did not ask for."""
    for key, model, asked in (
        (ALICE, "demo-a", "high"),
        (THRIFTY, "demo-b", "normal"),
        (THRIFTY, "demo-b", "high"),
    ):
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        headers = bearer(key) | {"X-Priority": asked}
        reply = httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert reply.status_code == 403, (key, asked, reply.text)
        error = reply.json()["error"]
        assert error["code"] == "permission_denied" and error["param"] == "X-Priority", error
    body = {"model": "demo-a", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for asked in ("normal", "Normal"):  # its own class, spelt as the 400 check accepts it
        headers = bearer(ALICE) | {"X-Priority": asked}
        assert httpx.post(
            gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=60
        ).is_success


def test_a_request_refused_before_it_was_admitted_uses_no_tokens(gateway: GatewayProcess) -> None:
    """Two prompts: the worker accepts the short one, then refuses the one past max_seq_len. The
    request is a 400 with no output and no usage; the accepted job is cancelled, and nothing is
    counted against the key or the model."""
    key = {("key", "gateway_api_keys#1"), ("model", "demo-a"), ("kind", "prompt")}
    counted = ("gateway_key_tokens_total", frozenset(key))
    model_tokens = ("gateway_prompt_tokens_total", frozenset({("model", "demo-a")}))
    before = metric_samples(gateway)
    body = {"model": "demo-a", "prompt": ["Hi there", "word " * 3000], "max_tokens": 2}
    reply = httpx.post(gateway.url + "/v1/completions", json=body, headers=bearer(ENV_KEY), timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"
    after = metric_samples(gateway)
    assert after.get(counted, 0.0) == before.get(counted, 0.0)
    assert after.get(model_tokens, 0.0) == before.get(model_tokens, 0.0)
    refusals = ("gateway_key_requests_total", frozenset({*key - {("kind", "prompt")}, ("status", "400")}))
    assert after[refusals] == before.get(refusals, 0.0) + 1
