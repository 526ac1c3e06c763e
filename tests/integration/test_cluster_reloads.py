"""Cluster mode on etcd: a registry reload that changes what workers read is carried out by the
leading gateway alone (gateway.workers.cluster_reloads), once, one replica at a time, end to end.

Real processes: etcd (Debian's etcd-server, on free loopback ports), two gateways with
`server.cluster.backend: etcd`, and two `model-worker --listen` workers of one remote model
(tcp with CURVE) that register themselves and load at start. The test rewrites the registry file
(a new `max_seq_len`, which the workers read) and asks for a reload:

- at the follower: the leader restarts each worker in place (Unload, then Load, reading the file
  again), the second only once the first is ready again, while requests at both gateways keep
  being served; the same reload asked of the leader afterwards restarts nothing more;
- at the leader, SIGKILLed while the first worker reloads (a slow load: the fault engine's
  FAULT_LOAD_DELAY_S): the follower takes over within the lease's TTL and finishes the reload,
  each worker restarted exactly once, while requests at the follower are served throughout.

And, in this process, the records themselves: one change asked twice is asked once, a finished
reload is recorded with each worker's incarnation, and a pending key that is no request is skipped.

Every wait is on an event.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.cluster.etcd_reloads import EtcdReloads
from gateway.cluster.etcd_session import EtcdSession
from gateway.cluster.reload_request import ReloadRequest
from gateway.cluster.settings import EtcdSettings
from tests.etcd_server import EtcdServer, etcd_cluster_section
from tests.harness import REPO_ROOT, GatewayProcess, free_port, wait_until
from tests.integration.conftest import demo_entry, write_registry

TTL_S = 3
TEST_ENGINES = {"GATEWAY_ALLOW_TEST_ENGINES": "1"}
FAULTY = "test:tests.fault_engines.FaultyEngine"
UNLOADING = "unloading on request of the leading gateway"
NEW_SETTINGS = "loading with the registry file's new settings"
WORKERS = ("shared@a", "shared@b")


class ReloadCluster:
    def __init__(self, root: Path, model_dir: Path, etcd: EtcdServer, load_delay_s: float) -> None:
        self.root = root
        self.keys = root / "keys"
        self.model_dir = model_dir
        self.etcd = etcd
        self.load_delay_s = load_delay_s
        subprocess.run(
            [sys.executable, "-m", "gateway", "keys", str(self.keys),
             "--name", "gateway", "--name", "worker"],
            check=True, cwd=REPO_ROOT, capture_output=True,
        )  # fmt: skip
        self.config = self.write(max_seq_len=2048)
        self.workers: list[subprocess.Popen[bytes]] = []

    def write(self, max_seq_len: int) -> Path:
        entry = demo_entry(
            "shared", self.model_dir, remote=True, engine=FAULTY, max_seq_len=max_seq_len,
            env={"FAULT_LOAD_DELAY_S": str(self.load_delay_s)},
            limits={"max_concurrent_jobs": 4, "request_timeout_s": 120},
        )  # fmt: skip
        return write_registry(
            self.root / "models.yaml",
            [entry],
            heartbeat_timeout_s=2.0,
            shutdown_grace_s=2,
            cluster=etcd_cluster_section(self.etcd, self.keys, "/reload-test/", TTL_S),
        )

    def start_worker(self, name: str) -> None:
        cmd = [
            sys.executable, "-m", "model_worker", "--listen", f"tcp://127.0.0.1:{free_port()}",
            "--config", str(self.config), "--model", "shared", "--worker-id", f"shared@{name}",
            "--curve-secret-key", str(self.keys / "worker.key_secret"),
            "--gateway-public-key", str(self.keys / "gateway.key"),
        ]  # fmt: skip
        with open(self.root / f"worker-{name}.log", "wb") as log:
            self.workers.append(
                subprocess.Popen(
                    cmd,
                    cwd=REPO_ROOT,
                    env={**os.environ, **TEST_ENGINES},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )

    def worker_log(self, worker_id: str) -> str:
        return (self.root / f"worker-{worker_id.split('@')[1]}.log").read_text(errors="replace")


@pytest.fixture
def make_cluster(tmp_path: Path, demo_model_dir: Path) -> Iterator[Any]:
    etcd = EtcdServer(tmp_path)
    etcd.start()
    made: list[ReloadCluster] = []

    def make(load_delay_s: float) -> ReloadCluster:
        cluster = ReloadCluster(tmp_path, demo_model_dir, etcd, load_delay_s)
        made.append(cluster)
        for name in ("a", "b"):
            cluster.start_worker(name)
        return cluster

    try:
        yield make
    finally:
        for cluster in made:
            for process in cluster.workers:
                if process.poll() is None:
                    process.kill()
                    process.wait(30)
        etcd.kill()


def _row(gateway: GatewayProcess, worker_id: str) -> dict[str, Any]:
    found = [w for w in gateway.workers() if w["id"] == worker_id]
    return found[0] if found else {}


def _reloaded(gateway: GatewayProcess, worker_id: str) -> bool:
    row = _row(gateway, worker_id)
    return row.get("state") == "ready" and row["info"].get("max_seq_len") == 1024


def _workers_reload(gateway: GatewayProcess) -> str:
    """The status of the leader's restarts for the gateway's latest reload, as it reads etcd."""
    latest = httpx.get(gateway.url + "/admin/reload", timeout=5).json()
    return str(latest["workers_reload"]["status"])


def _leads(gateway: GatewayProcess) -> bool:
    view = httpx.get(gateway.url + "/admin/cluster", timeout=5).json()["leader_election"]
    return bool(view["leader"])


def _full_log(gateway: GatewayProcess) -> str:
    """The whole log, also after the gateway stopped (`log()` keeps only its tail)."""
    return gateway.log_path.read_text(errors="replace")


@contextlib.contextmanager
def _two_gateways(cluster: ReloadCluster) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    """Started in turn, so the first leads; each ready once it serves both workers."""
    with GatewayProcess(cluster.config, env=TEST_ENGINES) as leader:
        wait_until(lambda: _leads(leader), "the first gateway to lead", 30, context=leader.events)
        with GatewayProcess(cluster.config, env=TEST_ENGINES) as follower:
            for gateway in (leader, follower):
                for worker_id in WORKERS:
                    wait_until(
                        lambda gateway=gateway, worker_id=worker_id: (
                            _row(gateway, worker_id).get("state") == "ready"
                        ),
                        f"{worker_id} to be ready at port {gateway.port}",
                        180,
                        context=gateway.events,
                    )
            yield leader, follower


@contextlib.contextmanager
def _asking(gateways: list[GatewayProcess]) -> Iterator[list[Any]]:
    """Completions sent one after another, to each gateway in turn, until the block ends; yields
    every answer's status, or its body when it failed (0 for a gateway that did not answer)."""
    statuses: list[Any] = []
    done = threading.Event()

    def ask() -> None:
        turn = 0
        while not done.is_set():
            live = [g for g in gateways if g.process is not None and g.process.poll() is None]
            gateway = live[turn % len(live)]
            turn += 1
            try:
                reply = httpx.post(
                    gateway.url + "/v1/completions",
                    json={"model": "shared", "prompt": "Hello", "max_tokens": 2},
                    timeout=60,
                )
            except httpx.HTTPError:
                if gateway.process is not None and gateway.process.poll() is not None:
                    continue  # the gateway this test killed
                statuses.append(0)
                continue
            statuses.append(200 if reply.status_code == 200 else reply.text)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    try:
        yield statuses
    finally:
        done.set()
        thread.join(90)


def _reload(gateway: GatewayProcess) -> dict[str, Any]:
    reply = httpx.post(gateway.url + "/admin/reload", params={"wait": 30}, timeout=60)
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    assert body["status"] == "applied" and body["changed"] == ["shared"], body
    return body


def test_a_reload_at_the_follower_restarts_each_worker_once_one_at_a_time(make_cluster: Any) -> None:
    cluster: ReloadCluster = make_cluster(0.0)
    with _two_gateways(cluster) as (leader, follower), _asking([leader, follower]) as statuses:
        cluster.write(max_seq_len=1024)
        body = _reload(follower)
        asked = body["workers_reload"]
        assert asked["workers"] == list(WORKERS) and asked["models"] == ["shared"], asked
        assert asked["status"] in ("restarting", "applied"), asked
        assert (
            asked["leader"] == httpx.get(leader.url + "/admin/cluster").json()["leader_election"]["identity"]
        )
        for gateway in (leader, follower):
            for worker_id in WORKERS:
                wait_until(
                    lambda gateway=gateway, worker_id=worker_id: _reloaded(gateway, worker_id),
                    f"{worker_id} to serve with the new max_seq_len at port {gateway.port}",
                    120,
                    context=gateway.events,
                )
        wait_until(lambda: _workers_reload(follower) == "applied", "the reload to finish", 30)
        assert "applied: model(s) shared" in _full_log(leader)

        # The same reload asked of the leader: its routes follow; no worker is restarted again.
        again = _reload(leader)["workers_reload"]
        assert again["workers"] == [], again
        served_during = len(statuses)

    assert served_during > 0 and set(statuses) == {200}, statuses
    log = _full_log(leader)
    assert "decided:" not in _full_log(follower)  # the follower asked; the leader decided
    for worker_id in WORKERS:
        assert cluster.worker_log(worker_id).count(UNLOADING) == 1
        assert cluster.worker_log(worker_id).count(NEW_SETTINGS) == 1
        assert log.count(f"decided: unload {worker_id}") == 1
        assert log.count(f"decided: load {worker_id}") == 1
    # One replica at a time: the second is unloaded only after the first is ready again.
    first, second = sorted(WORKERS, key=lambda w: log.index(f"decided: unload {w}"))
    assert log.index(f"decided: load {first}") < log.index(
        f"worker {first} ready", log.index(f"decided: load {first}")
    )
    assert log.index(f"worker {first} ready", log.index(f"decided: load {first}")) < log.index(
        f"decided: unload {second}"
    )


def test_the_leader_killed_mid_reload_the_next_leader_finishes_it_once(make_cluster: Any) -> None:
    cluster: ReloadCluster = make_cluster(4.0)  # each load takes 4 s: the kill lands in one
    with _two_gateways(cluster) as (leader, follower), _asking([follower]) as statuses:
        cluster.write(max_seq_len=1024)
        _reload(leader)  # asked of the leader itself, which then dies: the request outlives it
        wait_until(
            lambda: any(NEW_SETTINGS in cluster.worker_log(w) for w in WORKERS),
            "the first worker to begin loading its new settings",
            60,
            context=leader.events,
        )
        assert leader.process is not None
        leader.process.send_signal(signal.SIGKILL)
        leader.process.wait(10)
        wait_until(lambda: _leads(follower), "the follower to take over", TTL_S + 10, context=follower.events)
        for worker_id in WORKERS:
            wait_until(
                lambda worker_id=worker_id: _reloaded(follower, worker_id),
                f"{worker_id} to serve with the new max_seq_len",
                120,
                context=follower.events,
            )
        wait_until(lambda: "applied: model(s) shared" in _full_log(follower), "the new leader to finish", 30)

    assert statuses and set(statuses) == {200}, statuses
    for worker_id in WORKERS:  # exactly once, across the handover
        assert cluster.worker_log(worker_id).count(UNLOADING) == 1
        assert cluster.worker_log(worker_id).count(NEW_SETTINGS) == 1


def test_one_change_is_asked_once_a_key_that_is_no_request_is_skipped_and_its_decisions_go_with_it(
    tmp_path: Path,
) -> None:
    etcd = EtcdServer(tmp_path)
    etcd.start()

    async def scenario() -> None:
        settings = EtcdSettings(endpoints=[etcd.endpoint], prefix="/records/")
        reloads = EtcdReloads(settings)
        writer = EtcdSession(settings.endpoints, settings.request_timeout_s)  # not a gateway
        try:
            first = ReloadRequest("fp1", ("a",), {"a@x": "7-0"}, "gw-1")
            assert await reloads.ask(first) == first
            # The same change from another gateway, which saw other incarnations: the first stands.
            assert await reloads.ask(ReloadRequest("fp1", ("a",), {"a@x": "7-1"}, "gw-2")) == first
            await writer.call("put", b"/records/reloads/pending/junk", b"not json")
            assert await reloads.pending() == [first]
            assert not await reloads.finished("fp1")
            for decision in ("reload/fp1/unload/a@x/7-0", "reload/fp2/unload/b@x/8-0"):
                await writer.call("put", f"/records/decisions/{decision}".encode(), b"gw-1 term 5")
            assert await reloads.claimed("fp1") == {"reload/fp1/unload/a@x/7-0"}
            await reloads.finish(first, {"a@x": "7-1"}, "gw-1")
            assert await reloads.finished("fp1") and await reloads.applied("fp1") == {"a@x": "7-1"}
            # Its decisions are gone with it; another change's stay.
            assert await reloads.claimed("fp1") == set()
            assert await reloads.claimed("fp2") == {"reload/fp2/unload/b@x/8-0"}
        finally:
            await writer.close()
            await reloads.close()

    try:
        asyncio.run(scenario())
    finally:
        etcd.kill()
