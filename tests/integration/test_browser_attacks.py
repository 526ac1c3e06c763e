"""A keyless gateway against a hostile web page: the review's cross-site "simple" POSTs ran a
completion and unloaded a model, and a foreign Host header (DNS rebinding) was served. Each attack
is sent as a browser would send it; none may reach a model or change anything.

A real gateway (no API keys, loopback) and CPU worker; plain HTTP from the pytest process.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.harness import GatewayProcess
from tests.integration.conftest import demo_entry, write_registry

EVIL = "http://evil.example"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    config = write_registry(
        tmp_path_factory.mktemp("browser") / "models.yaml",
        [demo_entry("m", demo_model_dir)],
        allowed_origins=["https://ui.example"],
    )
    with GatewayProcess(config) as gw:
        yield gw


def completions_served(gateway: GatewayProcess) -> float:
    text = httpx.get(gateway.url + "/metrics", timeout=5).text
    lines = [line for line in text.splitlines() if line.startswith("gateway_requests_total{")]
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in lines if 'status="200"' in line and "completions" in line
    )


def test_cross_site_simple_posts_are_refused(gateway: GatewayProcess) -> None:
    body = '{"model": "m", "prompt": "hi", "max_tokens": 2}'
    before = completions_served(gateway)
    # A <form> or fetch(..., {mode: "no-cors"}) sends text/plain without a preflight.
    for headers in ({"Content-Type": "text/plain", "Origin": EVIL}, {"Content-Type": "text/plain"},
                    {"Content-Type": "application/x-www-form-urlencoded"}):  # fmt: skip
        response = httpx.post(gateway.url + "/v1/completions", content=body, headers=headers, timeout=10)
        assert response.status_code in (403, 415), (headers, response.text)
        assert response.json()["error"]["code"] in ("origin_not_allowed", "unsupported_media_type")
    # JSON from a foreign page needs a preflight the gateway never grants; sent anyway, it is refused.
    json_from_evil = {"Content-Type": "application/json", "Origin": EVIL}
    response = httpx.post(gateway.url + "/v1/completions", content=body, headers=json_from_evil, timeout=10)
    assert response.status_code == 403 and response.json()["error"]["code"] == "origin_not_allowed"
    assert completions_served(gateway) == before
    served = httpx.post(
        gateway.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert served.status_code == 200 and completions_served(gateway) == before + 1  # the count counts


def test_cross_site_admin_action_without_a_body_is_refused(gateway: GatewayProcess) -> None:
    response = httpx.post(gateway.url + "/admin/models/m/unload", headers={"Origin": EVIL}, timeout=10)
    assert response.status_code == 403 and response.json()["error"]["code"] == "origin_not_allowed"
    assert response.headers.get("Access-Control-Allow-Origin") is None
    assert [w["state"] for w in gateway.workers()] == ["ready"]


def test_dns_rebinding_host_is_refused_without_keys(gateway: GatewayProcess) -> None:
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example"):
        response = httpx.get(gateway.url + "/v1/models", headers={"Host": host}, timeout=10)
        assert response.status_code == 403 and response.json()["error"]["code"] == "host_not_allowed", host
    for host in ("localhost", "127.0.0.1", "[::1]:8000", "app.localhost"):
        response = httpx.get(gateway.url + "/v1/models", headers={"Host": host}, timeout=10)
        assert response.status_code == 200, host


def test_same_origin_and_allowed_origins_still_work(gateway: GatewayProcess) -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    own = gateway.url.replace("http://", "")
    for origin in (f"http://{own}", "https://ui.example"):
        response = httpx.post(
            gateway.url + "/v1/completions", json=body, headers={"Origin": origin}, timeout=30
        )
        assert response.status_code == 200, (origin, response.text)
    # curl and SDKs send no Origin; JSON with a charset is JSON.
    with_charset = {"Content-Type": "application/json; charset=utf-8"}
    response = httpx.post(
        gateway.url + "/v1/completions", content=json.dumps(body), headers=with_charset, timeout=30
    )
    assert response.status_code == 200, response.text
