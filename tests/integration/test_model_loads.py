"""Loading models the way llama-swap users expect: a limit on loads at once, exclusive GPU groups
that swap models, per-model environment, and hf:// models on a host that cannot reach the hub.

Runs in the pytest process against one real gateway (fault-injection engine, so a model's `env`
can slow its own load where the test can see it).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.harness import GatewayProcess, pid_alive
from tests.integration.conftest import demo_entry, write_registry

FAULTY = "test:tests.fault_engines.FaultyEngine"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    root = tmp_path_factory.mktemp("loads")
    config = write_registry(
        root / "models.yaml",
        [
            # Its own env slows its own load (1 s): the other models load as usual.
            demo_entry(
                "first", demo_model_dir, engine=FAULTY, exclusive_group="g", env={"FAULT_LOAD_DELAY_S": "1"}
            ),
            demo_entry("second", demo_model_dir, engine=FAULTY),
            demo_entry("swapper", demo_model_dir, engine=FAULTY, exclusive_group="g", load="on_demand"),
            demo_entry("from-hub", "hf://example-org/absent-model", load="on_demand"),  # type: ignore[arg-type],
        ],  # fmt: skip
        max_concurrent_loads=1,
        model_cache_dir=str(root / "cache"),
    )
    env = {"GATEWAY_ALLOW_TEST_ENGINES": "1", "HF_HUB_OFFLINE": "1"}
    with GatewayProcess(config, env=env) as gw:
        yield gw


def workers_of(gateway: GatewayProcess, model: str) -> list[dict[str, object]]:
    return [w for w in gateway.workers() if w["model"] == model]


def complete(gateway: GatewayProcess, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "hello", "max_tokens": 4}
    return httpx.post(gateway.url + "/v1/completions", json=body, timeout=60)


def test_one_load_at_a_time_and_env_per_model(gateway: GatewayProcess) -> None:
    log = gateway.log()
    events = [
        (m.group(1) or m.group(3), "spawned" if m.group(1) else "ready")
        for m in re.finditer(r"spawned worker (\w+)#0|worker ((\w+)#0) ready", log)
    ]
    # max_concurrent_loads: 1: the second startup model spawns only after the first is ready.
    assert events[:4] in (
        [("first", "spawned"), ("first", "ready"), ("second", "spawned"), ("second", "ready")],
        [("second", "spawned"), ("second", "ready"), ("first", "spawned"), ("first", "ready")],
    ), events
    # FAULT_LOAD_DELAY_S reached the first model's worker only (its load reports the injected delay).
    assert re.search(r"worker first#0 loading: \d+% \(injected slow load\)", log)
    assert not re.search(r"worker second#0 loading: \d+% \(injected", log)


def test_exclusive_group_swaps_models(gateway: GatewayProcess) -> None:
    (first,) = workers_of(gateway, "first")
    assert first["state"] == "ready" and workers_of(gateway, "swapper")[0]["state"] == "unloaded"
    reply = complete(gateway, "swapper")  # loads on demand, after its group's other model is gone
    assert reply.status_code == 200, reply.text
    assert workers_of(gateway, "first")[0]["state"] == "unloaded"
    assert not pid_alive(int(first["pid"]))  # type: ignore[arg-type]
    log = gateway.log()
    assert log.index("exclusive group g: unloading first to load swapper") < log.index(
        "spawned worker swapper#0"
    )
    # Unloaded by the swap, on purpose: the gateway is still ready, and the model says it is not.
    assert httpx.get(gateway.url + "/health/ready", timeout=5).status_code == 200
    assert httpx.get(gateway.url + "/health/ready/first", timeout=5).status_code == 503
    assert complete(gateway, "second").status_code == 200  # outside the group: untouched


def test_hub_model_on_an_offline_host_fails_clearly(gateway: GatewayProcess) -> None:
    started = time.monotonic()
    reply = complete(gateway, "from-hub")
    # Generous: the refusal needs no process and no network (milliseconds); a download that tried
    # anyway would wait for network timeouts, and a hang for the client's 60 s.
    assert reply.status_code == 503 and time.monotonic() - started < 20
    message = reply.json()["error"]["message"]
    assert "cannot download hf://example-org/absent-model: this host is offline (HF_HUB_OFFLINE=1)" in message
    assert "huggingface-cli download example-org/absent-model" in message
    (worker,) = workers_of(gateway, "from-hub")
    assert worker["state"] == "failed" and worker["pid"] is None


def test_hub_model_is_downloaded_before_its_worker_starts(tmp_path: Path, demo_model_dir: Path) -> None:
    """hf:// through the real huggingface_hub client, against a local stand-in for the hub (the
    real one is not reachable from the test hosts): downloaded once into the model cache, with
    progress, then loaded and served."""
    from tests.hub_stub import HubStub

    with HubStub("demo-org/demo-small", demo_model_dir) as hub:
        config = write_registry(
            tmp_path / "models.yaml",
            [demo_entry("hub-model", "hf://demo-org/demo-small@main")],  # type: ignore[arg-type]
            model_cache_dir="cache",
        )
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0"}
        with GatewayProcess(config, env=env) as gateway:
            assert complete(gateway, "hub-model").status_code == 200
            log = gateway.log()
        files = [path for method, path in hub.requests if method == "GET" and "/resolve/" in path]
    fetched = {path.rsplit("/", 1)[1] for path in files}
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= fetched
    folder = tmp_path / "cache" / "demo-org--demo-small" / "main"
    assert (folder / "model.safetensors").read_bytes() == (demo_model_dir / "model.safetensors").read_bytes()
    assert "downloading hf://demo-org/demo-small@main into" in log
    assert re.search(r"hf://demo-org/demo-small@main: (\d+)/\1 files", log), log[-3000:]
    assert log.index("downloaded hf://demo-org/demo-small@main") < log.index("spawned worker hub-model#0")
