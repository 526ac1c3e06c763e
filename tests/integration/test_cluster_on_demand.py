"""Cluster mode on etcd: models loaded on demand, exclusive groups and idle unloads, decided by the
leading gateway alone (gateway.workers.cluster_loads), end to end.

Real processes: etcd (Debian's etcd-server, on free loopback ports), two gateways with
`server.cluster.backend: etcd`, and `model-worker --listen` workers of `load: on_demand` models
(transformers on the demo model, tcp with CURVE) that register themselves and stand by without
their model. A request at the follower makes the leader load a worker exactly once, and is served;
the worker idle past `idle_unload_s` is unloaded back to standby; of two models of one exclusive
group on one host, loading the second unloads the first; the leader SIGKILLed while a load it sent
is in flight (a slow load: the fault engine's FAULT_LOAD_DELAY_S) is succeeded within the lease's
TTL, the worker loads once, and the waiting request is served. Every wait is on an event.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.cluster.etcd_session import EtcdSession
from tests.etcd_server import EtcdServer, etcd_cluster_section
from tests.harness import REPO_ROOT, GatewayProcess, free_port, wait_until
from tests.integration.conftest import demo_entry, write_registry

TTL_S = 3
TAKEOVER_SLACK_S = 2.0  # etcd finds an expired lease within 0.5 s; the watch, the campaign, a round
TEST_ENGINES = {"GATEWAY_ALLOW_TEST_ENGINES": "1"}
FAULTY = "test:tests.fault_engines.FaultyEngine"
LOADED = "standby: loading on request of the leading gateway"  # not "unloading ..."
UNLOADED = "unloading on request of the leading gateway"


class OnDemandCluster:
    def __init__(self, root: Path, model_dir: Path, etcd: EtcdServer) -> None:
        self.root = root
        self.etcd = etcd
        self.keys = root / "keys"
        subprocess.run(
            [sys.executable, "-m", "gateway", "keys", str(self.keys), "--name", "gateway",
             "--name", "worker"],
            check=True, cwd=REPO_ROOT, capture_output=True,
        )  # fmt: skip
        limits = {"max_concurrent_jobs": 4, "request_timeout_s": 120}
        on_demand: dict[str, Any] = {"remote": True, "load": "on_demand", "limits": limits}
        self.config = write_registry(
            root / "models.yaml",
            [
                demo_entry("lazy", model_dir, idle_unload_s=2, **on_demand),
                demo_entry("first", model_dir, exclusive_group="g", **on_demand),
                demo_entry("second", model_dir, exclusive_group="g", **on_demand),
                # Slow to load: the leader is killed while the load is in flight.
                demo_entry("slow", model_dir, engine=FAULTY, env={"FAULT_LOAD_DELAY_S": "8"}, **on_demand),
            ],
            heartbeat_timeout_s=2.0,
            cluster=etcd_cluster_section(etcd, self.keys, "/on-demand-test/", TTL_S),
        )  # fmt: skip
        self.workers: list[subprocess.Popen[bytes]] = []

    def start_worker(self, model: str) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable, "-m", "model_worker", "--listen", f"tcp://127.0.0.1:{free_port()}",
            "--config", str(self.config), "--model", model, "--worker-id", f"{model}@w",
            "--curve-secret-key", str(self.keys / "worker.key_secret"),
            "--gateway-public-key", str(self.keys / "gateway.key"),
        ]  # fmt: skip
        with open(self.root / f"worker-{model}.log", "wb") as log:
            process = subprocess.Popen(
                cmd, cwd=REPO_ROOT, env={**os.environ, **TEST_ENGINES}, stdout=log, stderr=subprocess.STDOUT
            )
        self.workers.append(process)
        return process

    def worker_log(self, model: str) -> str:
        return (self.root / f"worker-{model}.log").read_text(errors="replace")


@pytest.fixture
def cluster(tmp_path: Path, demo_model_dir: Path) -> Iterator[OnDemandCluster]:
    etcd = EtcdServer(tmp_path)
    etcd.start()
    cluster = OnDemandCluster(tmp_path, demo_model_dir, etcd)
    try:
        yield cluster
    finally:
        for process in cluster.workers:
            if process.poll() is None:
                process.kill()
                process.wait(30)
        etcd.kill()


def _state(gateway: GatewayProcess, worker_id: str) -> str | None:
    found = [w for w in gateway.workers() if w["id"] == worker_id]
    return found[0]["state"] if found else None


def _leads(gateway: GatewayProcess) -> bool:
    view = httpx.get(gateway.url + "/admin/cluster", timeout=5).json()["leader_election"]
    return bool(view["leader"])


def _decisions(cluster: OnDemandCluster) -> set[str]:
    """The decisions in etcd now, as named when claimed."""
    prefix = "/on-demand-test/decisions/"

    async def read() -> set[str]:
        session = EtcdSession([cluster.etcd.endpoint], 5.0)
        try:
            return {
                kv.key.decode()[len(prefix) :] for kv in await session.call("get_prefix", prefix.encode())
            }
        finally:
            await session.close()

    return asyncio.run(read())


def _complete(gateway: GatewayProcess, model: str) -> httpx.Response:
    return httpx.post(
        gateway.url + "/v1/completions",
        json={"model": model, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True},
        timeout=120,
    )


def _in_every(gateways: list[GatewayProcess], worker_id: str, state: str, what: str, timeout: float) -> None:
    for gateway in gateways:
        wait_until(
            lambda gateway=gateway: _state(gateway, worker_id) == state,
            f"{worker_id} to be {state} in the gateway on port {gateway.port} ({what})",
            timeout,
            context=gateway.events,
        )


@contextlib.contextmanager
def _two_gateways(cluster: OnDemandCluster) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    """Started in turn, so the first leads; both ready at once (every model is on demand)."""
    with GatewayProcess(cluster.config, env=TEST_ENGINES) as leader:
        wait_until(lambda: _leads(leader), "the first gateway to lead", 30, context=leader.events)
        with GatewayProcess(cluster.config, env=TEST_ENGINES) as follower:
            yield leader, follower


def test_a_request_at_the_follower_loads_once_and_an_idle_worker_goes_back_to_standby(
    cluster: OnDemandCluster,
) -> None:
    worker = cluster.start_worker("lazy")
    with _two_gateways(cluster) as (leader, follower):
        _in_every([leader, follower], "lazy@w", "unloaded", "standing by", 120)
        assert LOADED not in cluster.worker_log("lazy")  # nothing loads before it is wanted

        reply = _complete(follower, "lazy")
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        assert cluster.worker_log("lazy").count(LOADED) == 1
        assert leader.log().count("decided: load lazy@w") == 1
        assert "decided:" not in follower.log()  # the follower wanted it; the leader decided
        assert _decisions(cluster) == {f"load/lazy@w/{worker.pid}-1"}

        # Idle past idle_unload_s: the leader unloads it, every gateway sees it stand by again.
        _in_every([leader, follower], "lazy@w", "unloaded", "idle unload", 30)
        assert cluster.worker_log("lazy").count(UNLOADED) == 1
        assert "model unloaded; its memory is free" in cluster.worker_log("lazy")
        assert worker.poll() is None  # the process stays, registered
        # Its load and unload were about a standby period now over: the leader deletes them.
        wait_until(
            lambda: not _decisions(cluster), "the ended decisions to be deleted", 30, context=leader.events
        )

        # Wanted again: loaded again (a new standby period, a new decision), and served.
        reply = _complete(leader, "lazy")
        assert reply.status_code == 200, reply.text
        assert cluster.worker_log("lazy").count(LOADED) == 2


def test_loading_a_model_of_an_exclusive_group_unloads_the_other_on_its_host(
    cluster: OnDemandCluster,
) -> None:
    first = cluster.start_worker("first")
    cluster.start_worker("second")
    with _two_gateways(cluster) as (leader, follower):
        for worker_id in ("first@w", "second@w"):
            _in_every([leader, follower], worker_id, "unloaded", "standing by", 120)
        assert _complete(follower, "first").status_code == 200
        assert _state(follower, "second@w") == "unloaded"

        reply = _complete(follower, "second")
        assert reply.status_code == 200, reply.text
        assert cluster.worker_log("first").count(UNLOADED) == 1
        assert cluster.worker_log("second").count(LOADED) == 1
        # The unload was done before the load began: never both models loaded on the host.
        unloaded_at = leader.log().index("decided: unload first@w")
        assert unloaded_at < leader.log().index("decided: load second@w")
        _in_every([leader, follower], "first@w", "unloaded", "swapped out", 30)

        # A standby worker stopped (SIGTERM) exits at once and leaves every gateway's view.
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 0, cluster.worker_log("first")[-3000:]
        for gateway in (leader, follower):
            wait_until(lambda gateway=gateway: _state(gateway, "first@w") is None,
                       "the stopped worker to leave the view", TTL_S, context=gateway.events)  # fmt: skip


def test_the_leader_killed_during_an_on_demand_load_the_load_happens_once(cluster: OnDemandCluster) -> None:
    cluster.start_worker("slow")
    with _two_gateways(cluster) as (leader, follower):
        _in_every([leader, follower], "slow@w", "unloaded", "standing by", 120)
        answers: list[httpx.Response] = []
        asking = threading.Thread(target=lambda: answers.append(_complete(follower, "slow")))
        asking.start()
        # The leader sent Load: the worker is loading (slowly) when the leader dies.
        wait_until(
            lambda: LOADED in cluster.worker_log("slow"),
            "the worker to begin loading",
            30,
            context=leader.events,
        )
        assert leader.process is not None
        leader.process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        leader.process.wait(10)
        wait_until(lambda: _leads(follower), "the follower to take over", TTL_S + 10, context=follower.events)
        took_over = time.monotonic() - killed_at
        assert took_over < TTL_S + TAKEOVER_SLACK_S, took_over
        print(f"the follower led {took_over:.2f}s after the leader was killed")

        asking.join(120)
        assert answers and answers[0].status_code == 200, answers and answers[0].text
        assert cluster.worker_log("slow").count(LOADED) == 1  # exactly once, across the handover
