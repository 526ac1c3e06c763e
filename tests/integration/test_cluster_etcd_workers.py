"""Cluster mode on etcd, end to end: listening workers register themselves, a gateway follows.

A second test runs two gateways on one etcd: one leads; retiring a worker (a decision taken once
for the whole cluster, gateway.cluster.decisions) asked of the follower is refused at once with
409 not_leader naming the leader, also just after the leader was SIGKILLed (its lease lives on
until its TTL runs out); the follower takes over within the lease's TTL, and then the retire,
asked of it twice at once, happens exactly once.

Real processes: etcd (Debian's etcd-server, on free loopback ports), `model-worker --listen`
(transformers on the demo model, tcp with CURVE) that registers itself in etcd from its registry
file's `server.cluster.etcd`, and a gateway with `server.cluster.backend: etcd` that finds the
worker in etcd, connects and serves. A worker SIGKILLed leaves the gateway's view when its lease
expires; a worker started later is found, connected and served. Every wait is on an event.
"""

from __future__ import annotations

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

from tests.etcd_server import EtcdServer, etcd_cluster_section
from tests.harness import REPO_ROOT, GatewayProcess, free_port, wait_until
from tests.integration.conftest import demo_entry, write_registry

TTL_S = 3
# etcd looks for expired leases every 500 ms; the delete then reaches the watch and the gateway.
EXPIRY_SLACK_S = 2.0
# A follower asked for a decision while another gateway leads answers within one etcd read; a
# handover (what it waited before) is the TTL, a second and a retry interval: over 4 s here.
QUICK_REFUSAL_S = 2.5


class EtcdCluster:
    def __init__(self, root: Path, model_dir: Path, etcd: EtcdServer) -> None:
        self.root = root
        self.keys = root / "keys"
        subprocess.run(
            [sys.executable, "-m", "gateway", "keys", str(self.keys),
             "--name", "gateway", "--name", "worker-a", "--name", "worker-b"],
            check=True, cwd=REPO_ROOT, capture_output=True,
        )  # fmt: skip
        self.config = write_registry(
            root / "models.yaml",
            [demo_entry("shared", model_dir, remote=True,
                        limits={"max_concurrent_jobs": 4, "worker_queued_jobs": 2})],
            heartbeat_timeout_s=2.0,
            cluster=etcd_cluster_section(etcd, self.keys, "/etcd-workers-test/", TTL_S),
        )  # fmt: skip
        self.workers: list[subprocess.Popen[bytes]] = []

    def start_worker(self, name: str, replica: int) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable, "-m", "model_worker", "--listen", f"tcp://127.0.0.1:{free_port()}",
            "--config", str(self.config), "--model", "shared", "--worker-id", f"shared@{name}",
            "--replica", str(replica),
            "--curve-secret-key", str(self.keys / f"worker-{name}.key_secret"),
            "--gateway-public-key", str(self.keys / "gateway.key"),
        ]  # fmt: skip
        with open(self.root / f"worker-{name}.log", "wb") as log:
            process = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        self.workers.append(process)
        return process

    def worker_log(self, name: str) -> str:
        return (self.root / f"worker-{name}.log").read_text(errors="replace")[-20000:]


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def cluster(tmp_path: Path, demo_model_dir: Path, etcd: EtcdServer) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path, demo_model_dir, etcd)
    try:
        yield cluster
    finally:
        for process in cluster.workers:
            if process.poll() is None:
                process.kill()
                process.wait(30)


def _row(gateway: GatewayProcess, worker_id: str) -> dict[str, Any] | None:
    found = [w for w in gateway.workers() if w["id"] == worker_id]
    return found[0] if found else None


def _complete(gateway: GatewayProcess) -> httpx.Response:
    return httpx.post(
        gateway.url + "/v1/completions",
        json={"model": "shared", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True},
        timeout=60,
    )


def test_workers_found_in_etcd_are_served_and_forgotten_when_their_lease_expires(
    cluster: EtcdCluster,
) -> None:
    first = cluster.start_worker("a", 0)
    with GatewayProcess(cluster.config) as gateway:  # ready once the worker found in etcd is
        row = _row(gateway, "shared@a")
        assert row is not None and row["state"] == "ready", row
        reply = _complete(gateway)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        assert "registered in etcd" in cluster.worker_log("a")

        # SIGKILL: no goodbye, no revoke. The link sees it lost; the lease's expiry makes it leave.
        first.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        first.wait(10)
        wait_until(
            lambda: _row(gateway, "shared@a") is None,
            "the killed worker to leave the gateway's view",
            TTL_S + EXPIRY_SLACK_S + 5,
            poll_s=0.05,
            context=gateway.events,
        )
        gone_after = time.monotonic() - killed_at
        assert gone_after < TTL_S + EXPIRY_SLACK_S, gone_after
        assert _complete(gateway).status_code == 503  # no worker of the model now

        # A worker that registers later is found, connected, and served.
        cluster.start_worker("b", 1)
        wait_until(
            lambda: (_row(gateway, "shared@b") or {}).get("state") == "ready",
            "the later worker to be ready in the gateway",
            120,
            poll_s=0.1,
            context=lambda: cluster.worker_log("b") + "\n---\n" + gateway.events(),
        )
        reply = _complete(gateway)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4


def _view(gateway: GatewayProcess) -> dict[str, Any]:
    return httpx.get(gateway.url + "/admin/cluster", timeout=5).json()["leader_election"]


def _leads(gateway: GatewayProcess) -> bool:
    return bool(_view(gateway)["leader"])


def _retire(gateway: GatewayProcess) -> httpx.Response:
    return httpx.post(gateway.url + "/admin/workers/shared@a/retire", params={"grace_s": 1}, timeout=30)


def _assert_refused_at_once_naming(gateway: GatewayProcess, leader_id: str) -> float:
    """A retire asked of `gateway`, a follower while `leader_id` holds a live lease: 409 not_leader
    naming the leader, well within a handover (the TTL and more), since no takeover is due."""
    asked_at = time.monotonic()
    refused = _retire(gateway)
    took = time.monotonic() - asked_at
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "not_leader" and error["type"] == "invalid_request_error", error
    assert f"gateway {leader_id} leads it" in error["message"], error
    assert took < QUICK_REFUSAL_S, took
    return took


def test_a_follower_refuses_while_another_leads_and_decides_once_after_the_takeover(
    cluster: EtcdCluster,
) -> None:
    worker = cluster.start_worker("a", 0)
    with GatewayProcess(cluster.config) as first:
        wait_until(lambda: _leads(first), "the first gateway to lead", 30, context=first.events)
        first_id = _view(first)["identity"]
        with GatewayProcess(cluster.config) as second:
            assert not _leads(second)
            assert (_row(second, "shared@a") or {}).get("state") == "ready"
            took = _assert_refused_at_once_naming(second, first_id)
            print(f"retire asked of the follower while the leader lives -> 409 after {took:.2f} s")

            first.process.send_signal(signal.SIGKILL)  # the leader dies without resigning
            killed_at = time.monotonic()
            first.process.wait(10)
            # Its lease lives on until its TTL runs out: to etcd it leads still, and a follower
            # cannot tell it from a live one, so the answer is the same.
            took = _assert_refused_at_once_naming(second, first_id)
            print(f"retire asked while the dead leader's lease lasts -> 409 after {took:.2f} s")
            wait_until(
                lambda: _leads(second),
                "the follower to take over",
                TTL_S + EXPIRY_SLACK_S + 5,
                poll_s=0.02,
                context=second.events,
            )
            took = time.monotonic() - killed_at
            print(f"leader SIGKILLed -> the follower leads after {took:.2f} s (TTL {TTL_S} s)")
            assert took < TTL_S + EXPIRY_SLACK_S, took

            answers: list[httpx.Response] = []
            asking = [threading.Thread(target=lambda: answers.append(_retire(second))) for _ in range(2)]
            for thread in asking:
                thread.start()
            for thread in asking:
                thread.join(30)
            # One decides. The other finds it claimed, or, when it comes after the retired worker
            # (no job to drain) has left already, finds no such worker.
            outcomes = sorted(str(reply.json().get("outcome", reply.status_code)) for reply in answers)
            assert outcomes in (["already_decided", "done"], ["404", "done"]), [r.text for r in answers]

            # Exactly once: the worker was told once, drains, exits, and leaves every view at once.
            worker.wait(30)
            assert worker.returncode == 0, cluster.worker_log("a")
            assert cluster.worker_log("a").count("retired by the leading gateway") == 1
            wait_until(
                lambda: _row(second, "shared@a") is None,
                "the retired worker to leave the gateway's view",
                TTL_S,
                poll_s=0.05,
                context=second.events,
            )
            again = httpx.post(second.url + "/admin/workers/shared@a/retire", timeout=30)
            assert again.status_code == 404, again.text
