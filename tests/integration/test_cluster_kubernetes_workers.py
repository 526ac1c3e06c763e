"""Cluster mode on Kubernetes, end to end: gateway processes follow the EndpointSlices and share a
Lease on the fake API server; a listening worker process serves them.

Runs in the pytest process, which starts the processes and plays the Kubernetes control plane:
the fake API server (tests/fake_kube_api.py, on a thread of its own, https with a bearer token
when the openssl command is there) and, in place of the EndpointSlice controller and the kubelet,
the test itself, which publishes the worker's endpoint in its Service's slice as not ready until
its port accepts a TCP connection (the manifests' readiness probe), then ready, then not ready or
gone. The gateways find the API the way the code does outside a pod, through $KUBECONFIG (server,
CA, token file: what a pod's service account amounts to), and read `server.cluster` as
deploy/kubernetes-cluster/ writes it, with short Lease timings. The worker is `model-worker
--listen` (transformers on the demo model, tcp with CURVE, the cluster's one shared worker key)
with the StatefulSet's `--worker-id MODEL@POD`. Every wait is on an event.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fake_kube_api import FakeKubeApiThread, endpoint_slice, kubeconfig, self_signed_certificate
from tests.harness import REPO_ROOT, GatewayProcess, free_port, wait_until
from tests.integration.conftest import demo_entry, write_registry

NAMESPACE = "llm-gateway"
MODEL = "shared"
POD = "llm-worker-shared-0"  # the StatefulSet llm-worker-shared's first pod
WORKER_ID = f"{MODEL}@{POD}"
SLICE = "llm-workers-shared-x7k2p"  # the controller's name for the headless Service's slice
LEASE = "llm-gateway-leader"
LEASE_DURATION_S, RENEW_DEADLINE_S, RETRY_PERIOD_S = 3, 2.0, 0.5
# A follower asked for a decision while another gateway leads answers within one Lease read.
QUICK_REFUSAL_S = 2.5
# What the worker Service (deploy/kubernetes-cluster/worker-services.yaml) is labelled with, which
# the EndpointSlice controller copies to its slices, next to the labels of its own.
SERVICE_LABELS = {
    "app.kubernetes.io/name": "llm-gateway",
    "app.kubernetes.io/component": "worker",
    "app.kubernetes.io/part-of": "llm-gateway",
    "llm-gateway.io/model": MODEL,
}
CONTROLLER_LABELS = {
    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
    "kubernetes.io/service-name": "llm-workers-shared",
    "service.kubernetes.io/headless": "",
}


class KubernetesCluster:
    def __init__(self, root: Path, model_dir: Path) -> None:
        self.root = root
        keys = root / "keys"
        # One key pair for every gateway and one for every worker, as the manifests' Secrets hold.
        subprocess.run(
            [sys.executable, "-m", "gateway", "keys", str(keys), "--name", "gateway", "--name", "worker"],
            check=True, cwd=REPO_ROOT, capture_output=True,
        )  # fmt: skip
        self.keys = keys
        token = secrets.token_urlsafe(24)
        (root / "token").write_text(token + "\n")
        tls = self_signed_certificate(root)
        self.fake = FakeKubeApiThread(token=token, tls=tls)
        self.kubeconfig = kubeconfig(
            root / "kubeconfig", self.fake.url, NAMESPACE,
            token_file=root / "token", ca_file=tls[0] if tls else None,
        )  # fmt: skip
        self.config = write_registry(
            root / "models.yaml",
            [demo_entry(MODEL, model_dir, remote=True,
                        limits={"max_concurrent_jobs": 4, "worker_queued_jobs": 2})],
            heartbeat_timeout_s=2.0,
            cluster={
                "backend": "kubernetes",
                "kubernetes": {"namespace": NAMESPACE, "lease_name": LEASE,
                               "lease_duration_s": LEASE_DURATION_S, "renew_deadline_s": RENEW_DEADLINE_S,
                               "retry_period_s": RETRY_PERIOD_S, "request_timeout_s": 1.0},
                "secret_key_file": str(keys / "gateway.key_secret"),
                "worker_public_key_file": str(keys / "worker.key"),
            },
        )  # fmt: skip
        self.worker_port = free_port()
        self.worker: subprocess.Popen[bytes] | None = None

    def gateway(self, *, wait_ready: bool = True) -> GatewayProcess:
        return GatewayProcess(self.config, env={"KUBECONFIG": str(self.kubeconfig)}, wait_ready=wait_ready)

    def start_worker(self) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable, "-m", "model_worker", "--listen", f"tcp://127.0.0.1:{self.worker_port}",
            "--config", str(self.config), "--model", MODEL, "--worker-id", WORKER_ID,
            "--curve-secret-key", str(self.keys / "worker.key_secret"),
            "--gateway-public-key", str(self.keys / "gateway.key"),
        ]  # fmt: skip
        with open(self.root / "worker.log", "wb") as log:
            self.worker = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        return self.worker

    def worker_log(self) -> str:
        return (self.root / "worker.log").read_text(errors="replace")[-20000:]

    def probe_worker(self) -> bool:
        """The readiness probe of the manifests: the worker's port accepts a TCP connection."""
        assert self.worker is not None
        if self.worker.poll() is not None:
            raise AssertionError(f"the worker exited with {self.worker.returncode}:\n{self.worker_log()}")
        try:
            socket.create_connection(("127.0.0.1", self.worker_port), timeout=1).close()
        except OSError:
            return False
        return True

    def publish(self, *, ready: bool, pod_exists: bool = True) -> None:
        """The worker Service's slice with the worker pod's endpoint, ready or not; without it
        once the pod is gone (the Service stays)."""
        obj = endpoint_slice(
            SLICE, MODEL, {POD: "127.0.0.1"} if pod_exists else {}, port=self.worker_port,
            not_ready=() if ready else (POD,), labels={**SERVICE_LABELS, **CONTROLLER_LABELS},
        )  # fmt: skip
        self.fake.call(lambda: self.fake.api.apply_slice(obj))

    def unpublish(self) -> None:
        self.fake.call(lambda: self.fake.api.delete_slice(SLICE))

    def lease_holders(self) -> list[str | None]:
        """The leader Lease's holder after each write of it, oldest first (None: released)."""
        events = self.fake.call(lambda: list(self.fake.api.history))
        return [event.obj["spec"].get("holderIdentity") or None for event in events
                if event.obj["metadata"]["name"] == LEASE and event.kind != "DELETED"]  # fmt: skip

    def lease(self) -> dict[str, Any]:
        lease = self.fake.call(lambda: self.fake.api.lease(LEASE))
        assert lease is not None, "no leader Lease"
        return lease

    def count(self, method: str, path_part: str, code: int | None = None) -> int:
        return self.fake.call(lambda: self.fake.api.count(method, path_part, code))


@pytest.fixture
def cluster(tmp_path: Path, demo_model_dir: Path) -> Iterator[KubernetesCluster]:
    cluster = KubernetesCluster(tmp_path, demo_model_dir)
    try:
        yield cluster
    finally:
        if cluster.worker is not None and cluster.worker.poll() is None:
            cluster.worker.kill()
            cluster.worker.wait(30)
        cluster.fake.close()


def _row(gateway: GatewayProcess) -> dict[str, Any] | None:
    found = [w for w in gateway.workers() if w["id"] == WORKER_ID]
    return found[0] if found else None


def _complete(gateway: GatewayProcess) -> httpx.Response:
    return httpx.post(
        gateway.url + "/v1/completions",
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True},
        timeout=60,
    )


def _wait_served(gateways: list[GatewayProcess], what: str, cluster: KubernetesCluster) -> None:
    for gateway in gateways:
        wait_until(
            lambda gateway=gateway: (_row(gateway) or {}).get("state") == "ready",
            f"the worker to be ready in the gateway on port {gateway.port} ({what})",
            120,
            poll_s=0.05,
            context=lambda gateway=gateway: cluster.worker_log() + "\n---\n" + gateway.events(),
        )
        reply = _complete(gateway)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4


def _wait_forgotten(gateways: list[GatewayProcess], what: str) -> float:
    """Seconds until every gateway has forgotten the worker."""
    since = time.monotonic()
    for gateway in gateways:
        wait_until(
            lambda gateway=gateway: _row(gateway) is None,
            f"the gateway on port {gateway.port} to forget the worker ({what})",
            10,
            poll_s=0.05,
            context=gateway.events,
        )
    return time.monotonic() - since


def _cluster_view(gateway: GatewayProcess) -> dict[str, Any]:
    return httpx.get(gateway.url + "/admin/cluster", timeout=5).json()["leader_election"]


def _one_leader(
    first: GatewayProcess, second: GatewayProcess
) -> tuple[GatewayProcess, GatewayProcess] | None:
    """(leader, follower) once exactly one of the two leads."""
    views = [_cluster_view(first)["leader"], _cluster_view(second)["leader"]]
    assert views != [True, True], "two gateways lead at once"
    if views == [True, False]:
        return first, second
    return (second, first) if views == [False, True] else None


def _retire(gateway: GatewayProcess) -> httpx.Response:
    return httpx.post(gateway.url + f"/admin/workers/{WORKER_ID}/retire", params={"grace_s": 1}, timeout=30)


def _assert_quiet(gateways: list[GatewayProcess]) -> None:
    """The API calls (a Lease read every retry period by every gateway, forever) are not logged one
    line each at INFO."""
    for gateway in gateways:
        chatty = [line for line in gateway.log_path.read_text().splitlines() if "HTTP Request:" in line]
        assert not chatty, chatty[:3]


def test_every_gateway_follows_the_worker_through_its_endpoint_slice(cluster: KubernetesCluster) -> None:
    worker = cluster.start_worker()
    cluster.publish(ready=False)  # the pod is scheduled; its readiness probe has not passed yet
    with cluster.gateway(wait_ready=False) as first, cluster.gateway(wait_ready=False) as second:
        gateways = [first, second]
        for gateway in gateways:
            gateway.wait_until_live()
        # Each gateway has listed (the slice, not ready) and watches from that listing: a not-ready
        # endpoint is no worker.
        wait_until(lambda: cluster.count("GET", "watch=true", 200) >= 2, "both gateways to watch")
        assert [_row(gateway) for gateway in gateways] == [None, None]

        wait_until(cluster.probe_worker, "the worker's port to accept connections", 60)
        cluster.publish(ready=True)
        _wait_served(gateways, "its endpoint turned ready", cluster)

        # The readiness probe fails: the endpoint turns not ready, and every gateway lets it go.
        cluster.publish(ready=False)
        took = _wait_forgotten(gateways, "its endpoint turned not ready")
        print(f"endpoint not ready -> forgotten by both gateways in {took:.2f} s")
        for gateway in gateways:
            reply = _complete(gateway)
            assert reply.status_code == 503, reply.text
            assert reply.json() == {
                "error": {
                    "message": f"model '{MODEL}' has no connected worker",
                    "type": "service_unavailable_error",
                    "param": None,
                    "code": "service_unavailable",
                }
            }
        # A gateway letting go is not the worker's end: it serves whoever connects again.
        cluster.publish(ready=True)
        _wait_served(gateways, "its endpoint ready again", cluster)

        # The Service deleted: its slice goes, and with it the worker.
        cluster.unpublish()
        took = _wait_forgotten(gateways, "its slice deleted")
        print(f"slice deleted -> forgotten by both gateways in {took:.2f} s")
        assert worker.poll() is None, cluster.worker_log()

        # A gateway stopped on purpose (SIGTERM: a rolling update) hands the Lease over: it empties
        # the holder as it stops, and the other takes the Lease from that release, not from its expiry
        # (which would show as the leader's name followed straight by the other's).
        leader, follower = wait_until(lambda: _one_leader(first, second), "one gateway to lead", 30)
        leader_id, follower_id = _cluster_view(leader)["identity"], _cluster_view(follower)["identity"]
        stopped_at = time.monotonic()
        assert leader.stop() == 0
        wait_until(lambda: _cluster_view(follower)["leader"], "the other gateway to lead", 10, poll_s=0.02)
        print(f"leader stopped with SIGTERM -> the other leads after {time.monotonic() - stopped_at:.2f} s")
        written = cluster.lease_holders()
        holders = [holder for i, holder in enumerate(written) if i == 0 or holder != written[i - 1]]
        assert holders[-3:] == [leader_id, None, follower_id], holders
    # Every request was authenticated: a gateway without the token would have met 401.
    assert cluster.count("GET", "endpointslices", 401) == 0
    _assert_quiet(gateways)


def test_one_gateway_leads_on_the_lease_retires_once_and_a_survivor_takes_over(
    cluster: KubernetesCluster,
) -> None:
    worker = cluster.start_worker()
    wait_until(cluster.probe_worker, "the worker's port to accept connections", 60)
    cluster.publish(ready=True)
    with cluster.gateway() as first, cluster.gateway() as second:  # ready: each serves the worker
        leader, follower = wait_until(lambda: _one_leader(first, second), "one gateway to lead", 30)
        leader_id, follower_id = _cluster_view(leader)["identity"], _cluster_view(follower)["identity"]
        lease = cluster.lease()["spec"]
        assert lease["holderIdentity"] == leader_id and lease["leaseDurationSeconds"] == LEASE_DURATION_S
        wait_until(lambda: cluster.lease()["spec"]["renewTime"] != lease["renewTime"], "a renewal", 10)
        assert _one_leader(first, second) == (leader, follower)  # renewed, and still the only one

        # The follower refuses at once, and names the leader: it holds a live Lease, so no takeover
        # is due and waiting out a handover (the lease duration and two retry periods) would be vain.
        asked_at = time.monotonic()
        refused = _retire(follower)
        took = time.monotonic() - asked_at
        print(f"retire asked of the follower -> 409 after {took:.2f} s")
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "not_leader"
        assert f"gateway {leader_id} leads it" in refused.json()["error"]["message"]
        assert took < QUICK_REFUSAL_S < LEASE_DURATION_S + 2 * RETRY_PERIOD_S
        done = _retire(leader)
        assert done.status_code == 202, done.text
        assert done.json()["outcome"] == "done" and done.json()["identity"] == leader_id
        again = _retire(leader)
        assert again.status_code == 200, again.text
        assert again.json()["outcome"] == "already_decided"
        assert again.json()["decision"] == done.json()["decision"]
        # Claimed once: one decision Lease created, the second claim refused with AlreadyExists.
        assert cluster.count("POST", "/leases", 201) == 2  # the leader Lease, and the decision
        assert cluster.count("POST", "/leases", 409) >= 1

        worker.wait(30)
        assert worker.returncode == 0, cluster.worker_log()
        assert cluster.worker_log().count("retired by the leading gateway") == 1
        cluster.publish(ready=False, pod_exists=False)  # the pod is gone, and so is its endpoint
        _wait_forgotten([leader, follower], "the retired worker's endpoint removed")

        # The leader dies without resigning: the survivor waits out the Lease, then takes it.
        killed_at = time.monotonic()
        leader.stop(signal.SIGKILL)
        wait_until(
            lambda: _cluster_view(follower)["leader"],
            "the survivor to lead",
            LEASE_DURATION_S + 2 * RETRY_PERIOD_S + 5,
            poll_s=0.02,
            context=follower.events,
        )
        took = time.monotonic() - killed_at
        print(f"leader SIGKILLed -> the survivor leads after {took:.2f} s (lease {LEASE_DURATION_S} s)")
        # Not before the Lease ran out (the last renewal was at most a retry period before the
        # kill), and within the duration plus two retry periods and a margin for the calls.
        assert LEASE_DURATION_S - RETRY_PERIOD_S - 0.2 <= took <= LEASE_DURATION_S + 2 * RETRY_PERIOD_S + 1.0
        lease = cluster.lease()["spec"]
        assert lease["holderIdentity"] == follower_id and lease["leaseTransitions"] == 1
    _assert_quiet([leader, follower])


def test_a_gateway_with_no_credentials_stops_with_a_config_error(cluster: KubernetesCluster) -> None:
    """Outside a pod, with no $KUBECONFIG and no ~/.kube/config: one `config error:` line naming the
    file and what to set, exit 2, no traceback (not a failed ASGI startup)."""
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    env["HOME"] = str(cluster.root)  # no ~/.kube/config there
    config, port = str(cluster.config), str(free_port())
    serve = [sys.executable, "-m", "gateway", "serve", "--config", config, "--port", port]
    done = subprocess.run(serve, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"config error: {cluster.config}: backend kubernetes found no credentials" in done.stderr
    assert "server.cluster.kubernetes.api_server" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
