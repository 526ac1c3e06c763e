"""Per-key rate limits and token budgets shared by two real gateways through a real Redis.

Runs in the pytest process: a redis-server on a free loopback port (Debian's package, installed by
.ci/run), and two gateways, each with its own CPU worker, that name it in `server.redis_url`. Then
Redis is stopped (each gateway falls back to its own counts, with a log line) and started again
(sharing resumes, with a log line).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import GatewayProcess, wait_until
from tests.integration.conftest import demo_entry, write_registry
from tests.redis_server import RedisServer

LIMITED = "limited-0123456789abcd"  # 3 requests a minute, across both gateways
THRIFTY = "thrifty-0123456789abcd"  # 30 tokens a day, across both gateways
OPS = "ops-0123456789abcdefgh"
PAIR = "pair-0123456789abcdefg"  # 2 requests a minute; used only while Redis is down, then after
KEYS = f"""
keys:
  - name: limited
    key: {LIMITED}
    models: ["*"]
    rate_limit_rpm: 3
  - name: thrifty
    key: {THRIFTY}
    models: ["*"]
    budget_tokens_per_day: 30
  - name: pair
    key: {PAIR}
    models: ["*"]
    rate_limit_rpm: 2
  - name: ops
    key: {OPS}
    admin: true
    models: ["*"]
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("redis")
    redis_server = RedisServer(folder)
    redis_server.start()
    (folder / "keys.yaml").write_text(KEYS)
    (folder / "keys.yaml").chmod(0o600)
    config = write_registry(
        folder / "models.yaml", [demo_entry("demo-a", demo_model_dir)],
        api_keys_file="keys.yaml", redis_url=redis_server.url,
    )  # fmt: skip
    with GatewayProcess(config, wait_ready=False) as one, GatewayProcess(config, wait_ready=False) as two:
        for gateway in (one, two):
            wait_until(lambda g=gateway: ready(g), f"gateway on port {gateway.port} is ready", timeout=180)
        yield {"redis": redis_server, "gateways": (one, two)}
    redis_server.stop()


def ready(gateway: GatewayProcess) -> bool:
    assert gateway.process is not None and gateway.process.poll() is None, gateway.log()
    try:
        headers = {"Authorization": f"Bearer {OPS}"}
        return httpx.get(gateway.url + "/health/ready", headers=headers, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def chat(gateway: GatewayProcess, key: str, **extra: Any) -> httpx.Response:
    body = {"model": "demo-a", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **extra}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_a_rate_limit_holds_across_gateways(cluster: dict[str, Any]) -> None:
    one, two = cluster["gateways"]
    statuses = [chat(gw, LIMITED).status_code for gw in (one, two, one)]
    assert statuses == [200, 200, 200]
    refused = chat(two, LIMITED)  # the 4th in a minute, on the gateway that has seen only one
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1


def test_a_budget_spent_on_one_gateway_is_spent_on_the_other(cluster: dict[str, Any]) -> None:
    one, two = cluster["gateways"]
    spent = chat(one, THRIFTY, max_tokens=30, ignore_eos=True)
    assert spent.status_code == 200 and spent.json()["usage"]["total_tokens"] >= 30
    # Usage reaches Redis in batches (every 0.5 s): the other gateway refuses once it is there.
    refused = wait_until(
        lambda: (r := chat(two, THRIFTY)).status_code == 429 and r, "gateway two sees the spend"
    )
    assert refused.json()["error"]["code"] == "insufficient_quota"


def test_without_redis_each_gateway_counts_alone_and_sharing_resumes(cluster: dict[str, Any]) -> None:
    one, two = cluster["gateways"]
    redis_server: RedisServer = cluster["redis"]
    redis_server.stop()
    try:
        # Requests go on, and `pair`'s 2 a minute are counted by each gateway alone: 4 pass.
        assert [chat(gw, PAIR).status_code for gw in (one, one, two, two)] == [200] * 4
        for gateway in (one, two):
            assert "Redis unreachable" in gateway.log()
        assert chat(one, PAIR).status_code == 429  # still limited, by the gateway's own count
    finally:
        redis_server.start()
    # A call after the retry interval finds Redis again; `pair` then starts afresh there.
    for gateway in (one, two):
        wait_until(
            lambda g=gateway: (
                chat(g, LIMITED).status_code in (200, 429) and "Redis reachable again" in g.log()
            ),
            "sharing resumes",
        )
