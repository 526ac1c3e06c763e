"""API keys: keys file errors, digests, scopes, the rate limiter, reloads, and the request hook.

The hook tests drive the real app through Quart's test client without starting its lifecycle, so
no worker is spawned: auth answers before any route would need one.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from quart import Quart

from gateway.cluster.counters import TokenBucket
from gateway.config.api_keys import (
    ApiKey,
    check_bind_allowed,
    digest_of,
    env_keys,
    is_loopback,
    parse_keys_file,
)
from gateway.config.registry import ConfigError, Registry, parse_registry
from gateway.http.app import create_app
from gateway.http.auth import Authenticator
from wire.states import WorkerState

ALICE = "alice-key-0123456789"
ADMIN = "admin-key-0123456789"
ENV_KEY = "env-key-0123456789ab"


@pytest.fixture(autouse=True)
def no_env_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GATEWAY_API_KEYS", raising=False)
    monkeypatch.delenv("GATEWAY_ADMIN_KEYS", raising=False)


def make_registry(tmp_path: Path, keys_file: str | None = "keys.yaml") -> Registry:
    server: dict[str, Any] = {"api_keys_file": keys_file} if keys_file else {}
    models = [
        {"name": "alpha", "engine": "transformers", "path": "m/alpha", "aliases": ["a"]},
        {"name": "beta", "engine": "transformers", "path": "m/beta"},
    ]
    return parse_registry({"server": server, "models": models}, tmp_path / "models.yaml")


KEYS = f"""
keys:
  - name: alice
    key_sha256: {hashlib.sha256(ALICE.encode()).hexdigest().upper()}
    models: [a]
  - name: ops
    key: {ADMIN}
    admin: true
    models: ["*"]
"""


def write_keys(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    path.chmod(0o600)
    return path


# ---- the keys file ------------------------------------------------------------------------------


def test_keys_file_parses_digests_and_scopes(tmp_path: Path) -> None:
    registry = make_registry(tmp_path)
    alice, ops = parse_keys_file(write_keys(tmp_path, KEYS), registry)
    assert alice == ApiKey("alice", digest_of(ALICE), frozenset({"alpha"}), False, None)
    assert alice.allows("alpha") and not alice.allows("beta")  # the alias scoped the real name
    assert ops.admin and ops.models is None and ops.allows("beta")


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("{name: x, models: [alpha]}", "key 'x' (entry #1): give exactly one of 'key' and 'key_sha256'"),
        (f"{{name: x, key: {ALICE}, key_sha256: {'a' * 64}, models: [alpha]}}", "exactly one of"),
        ("{name: x, key: short, models: [alpha]}", "key 'x' (entry #1), field 'key': a key must be at least"),
        ("{name: x, key_sha256: nothex, models: [alpha]}", "field 'key_sha256'"),
        (f"{{name: x, key: {ALICE}}}", "an inference key needs 'models'"),
        (f"{{name: x, key: {ALICE}, models: [alpha], colour: red}}", "field 'colour': Extra inputs"),
        (f"{{key: {ALICE}, models: [alpha]}}", "entry #1, field 'name': Field required"),
        (
            f"{{name: x, key: {ALICE}, models: [gamma]}}",
            "key 'x' (entry #1), field 'models': unknown model 'gamma'",
        ),
        (f"{{name: x, key: {ALICE}, models: [alpha], rate_limit_rpm: 0}}", "field 'rate_limit_rpm'"),
        # The key label of requests without a key: a key of that name would mix with them.
        (f"{{name: anonymous, key: {ALICE}, models: [alpha]}}", "field 'name': 'anonymous' is what metrics"),
    ],
)
def test_keys_file_errors_name_file_entry_and_field(tmp_path: Path, entry: str, expected: str) -> None:
    path = write_keys(tmp_path, f"keys:\n  - {entry}\n")
    with pytest.raises(ConfigError) as info:
        parse_keys_file(path, make_registry(tmp_path))
    message = str(info.value)
    assert message.startswith(str(path)) and expected in message
    assert ALICE not in message  # a key never appears in an error


@pytest.mark.parametrize(
    ("text", "expected"),
    [("keys: [\n", "not valid YAML at line"), ("- name: x\n", "expected a mapping with 'keys'")],
)
def test_keys_file_shape_errors(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        parse_keys_file(write_keys(tmp_path, text), make_registry(tmp_path))


def test_missing_keys_file_stops_startup(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read keys file"):
        Authenticator(make_registry(tmp_path), environ={})


def test_duplicate_names_and_secrets_are_refused(tmp_path: Path) -> None:
    twice = KEYS + f"  - {{name: alice, key: {ALICE}x, models: [beta]}}\n"
    write_keys(tmp_path, twice)
    with pytest.raises(ConfigError, match="name 'alice' is used twice"):
        Authenticator(make_registry(tmp_path), environ={})
    write_keys(tmp_path, KEYS)
    with pytest.raises(ConfigError, match="same secret as another key"):
        Authenticator(make_registry(tmp_path), environ={"GATEWAY_API_KEYS": ALICE})


def test_environment_keys(tmp_path: Path) -> None:
    inference, admin = env_keys({"GATEWAY_API_KEYS": f" {ENV_KEY} ,", "GATEWAY_ADMIN_KEYS": ADMIN})
    assert inference.models is None and not inference.admin and inference.digest == digest_of(ENV_KEY)
    assert admin.admin and admin.name == "gateway_admin_keys#1"
    with pytest.raises(ConfigError, match="GATEWAY_API_KEYS: key #2 is shorter than 16"):
        env_keys({"GATEWAY_API_KEYS": f"{ENV_KEY},tiny"})


def test_lookup_compares_digests(tmp_path: Path) -> None:
    write_keys(tmp_path, KEYS)
    auth = Authenticator(make_registry(tmp_path), environ={"GATEWAY_API_KEYS": ENV_KEY})
    assert auth.enabled
    assert [k.name for k in auth.keys] == ["gateway_api_keys#1", "alice", "ops"]
    assert auth.lookup(ALICE).name == "alice"  # type: ignore[union-attr]
    assert auth.lookup(ENV_KEY).name == "gateway_api_keys#1"  # type: ignore[union-attr]
    assert auth.lookup(ALICE + "x") is None and auth.lookup("") is None


def test_no_keys_means_no_auth(tmp_path: Path) -> None:
    assert not Authenticator(make_registry(tmp_path, None), environ={}).enabled


# ---- the bind rule ------------------------------------------------------------------------------


def test_loopback_only_without_keys(tmp_path: Path) -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.org", ""))
    bare = make_registry(tmp_path, None)
    check_bind_allowed(bare, "127.0.0.1", {})
    with pytest.raises(ConfigError, match="refusing to listen on '0.0.0.0' without API keys"):
        check_bind_allowed(bare, "0.0.0.0", {})
    check_bind_allowed(bare, "0.0.0.0", {"GATEWAY_ADMIN_KEYS": ADMIN})
    check_bind_allowed(make_registry(tmp_path), "0.0.0.0", {})


# ---- rate limiting and reloads ------------------------------------------------------------------


def test_token_bucket() -> None:
    bucket = TokenBucket(rpm=2, now=0.0)
    assert bucket.take(0.0) == 0.0 and bucket.take(0.0) == 0.0
    assert bucket.take(0.0) == pytest.approx(30.0)  # one request per 30 s once the burst is spent
    assert bucket.take(15.0) == pytest.approx(15.0)
    assert bucket.take(30.0) == 0.0
    assert bucket.take(1000.0) == 0.0 and bucket.take(1000.0) == 0.0 and bucket.take(1000.0) > 0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_keys_file_reload_and_broken_file_keeps_old_keys(tmp_path: Path) -> None:
    path = write_keys(tmp_path, KEYS)
    clock = Clock()
    auth = Authenticator(make_registry(tmp_path), environ={}, clock=clock)
    path.write_text(KEYS.replace("name: alice", "name: alicia"))
    auth.maybe_reload()
    assert auth.lookup(ALICE).name == "alice"  # type: ignore[union-attr]  # checked once a second
    clock.now += 1.0
    auth.maybe_reload()
    assert auth.lookup(ALICE).name == "alicia"  # type: ignore[union-attr]
    path.write_text("keys: [{name: broken}]\n")
    clock.now += 1.0
    auth.maybe_reload()
    assert auth.lookup(ALICE).name == "alicia"  # type: ignore[union-attr]


# ---- the request hook, through the app ----------------------------------------------------------


@pytest.fixture()
def app(tmp_path: Path) -> Iterator[Quart]:
    keys = KEYS + f"  - {{name: limited, key: {ALICE}-rl, models: [beta], rate_limit_rpm: 1}}\n"
    write_keys(tmp_path, keys)
    app = create_app(make_registry(tmp_path))
    yield app
    gateway = app.extensions["gateway"]
    asyncio.run(gateway.link.close())
    shutil.rmtree(gateway.runtime_dir, ignore_errors=True)


def call(app: Quart, method: str, path: str, key: str | None = None, **kwargs: Any) -> tuple[int, Any, Any]:
    async def go() -> tuple[int, Any, Any]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = await app.test_client().open(path, method=method, headers=headers, **kwargs)
        body = (
            await response.get_json()
            if response.mimetype == "application/json"
            else await response.get_data()
        )
        return response.status_code, body, response.headers

    return asyncio.run(go())


def test_hook_denies_by_default(app: Quart) -> None:
    assert call(app, "GET", "/health/live")[0] == 200
    # Load balancers probe readiness without a key; they learn nothing about models.
    assert call(app, "GET", "/health/ready")[:2] == (503, {"status": "not_ready"})
    for path in ("/v1/models", "/health/ready/alpha", "/metrics", "/admin/workers", "/no/such/route"):
        status, body, headers = call(app, "GET", path)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", path
        assert headers["WWW-Authenticate"] == "Bearer"
    status, body, _ = call(app, "GET", "/v1/models", key=ALICE + "x")
    assert status == 401 and body["error"]["type"] == "authentication_error"


def test_hook_scopes_models_and_admin(app: Quart) -> None:
    status, body, _ = call(app, "GET", "/v1/models", key=ALICE)
    assert status == 200 and [m["id"] for m in body["data"]] == ["alpha"]
    assert [m["id"] for m in call(app, "GET", "/v1/models", key=ADMIN)[1]["data"]] == ["alpha", "beta"]
    status, body, _ = call(app, "GET", "/v1/models/beta", key=ALICE)
    assert status == 404 and body["error"]["code"] == "model_not_found"
    for model in ("beta", "no-such-model"):  # the same answer: a key cannot probe for models
        request = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        status, body, _ = call(app, "POST", "/v1/chat/completions", key=ALICE, json=request)
        assert status == 404 and body["error"]["message"] == f"The model '{model}' does not exist"
    status, body, _ = call(app, "GET", "/admin/workers", key=ALICE)
    assert status == 403 and body["error"]["code"] == "permission_denied"
    assert call(app, "GET", "/admin/workers", key=ADMIN)[0] == 200
    status, body, _ = call(app, "GET", "/health/ready", key=ALICE)
    assert status == 503 and list(body["models"]) == ["alpha"]  # workers not started; only its models
    status, body, _ = call(app, "GET", "/health/ready/alpha", key=ALICE)
    assert status == 503 and body == {"model": "alpha", "ready": False, "state": "starting"}
    for model in ("beta", "no-such-model"):  # the same answer: a key cannot probe for models
        assert call(app, "GET", f"/health/ready/{model}", key=ALICE)[1]["error"]["code"] == "model_not_found"


def test_hook_rate_limit(app: Quart) -> None:
    assert call(app, "GET", "/v1/models", key=ALICE + "-rl")[0] == 200
    status, body, headers = call(app, "GET", "/v1/models", key=ALICE + "-rl")
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
    assert 55 <= int(headers["Retry-After"]) <= 60


def test_metrics_per_app_registry(app: Quart, tmp_path: Path) -> None:
    other = create_app(make_registry(tmp_path))  # a second app in one process must not clash
    try:
        call(app, "GET", "/v1/models", key=ALICE)
        # A key scoped to some models may not read every model's metrics; an admin key may.
        assert call(app, "GET", "/metrics", key=ALICE)[0] == 403
        status, text, _ = call(app, "GET", "/metrics", key=ADMIN)
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(text.decode())}
        requests = {
            (s.labels["model"], s.labels["endpoint"], s.labels["status"]): s.value
            for s in families["gateway_requests"].samples
            if s.name == "gateway_requests_total"
        }
        assert requests[("", "/v1/models", "200")] == 1
        states = {
            (s.labels["model"], s.labels["replica"], s.labels["state"]): s.value
            for s in families["gateway_worker_state"].samples
        }
        assert states[("alpha", "0", "starting")] == 1 and states[("alpha", "0", "ready")] == 0
        # Every state has its sample, 0 or 1: a dashboard can sum any of them.
        assert {state for _, _, state in states} == {s.value for s in WorkerState}
        assert "process_cpu_seconds_total" in text.decode()
        assert {s.labels["model"] for s in families["gateway_queue_depth"].samples} == {"alpha", "beta"}
        assert "gateway_kv_cache_usage_ratio" not in families  # no engine reported it
    finally:
        gateway = other.extensions["gateway"]
        asyncio.run(gateway.link.close())
        shutil.rmtree(gateway.runtime_dir, ignore_errors=True)
