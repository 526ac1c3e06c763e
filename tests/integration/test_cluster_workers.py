"""Cluster mode: one listening worker (`model-worker --listen`) shared by two gateways.

Real processes and sockets: a transformers worker on the demo model, listening on tcp with CURVE,
and two gateways that find it through a static `server.cluster` list. The worker enforces its own
cap across both gateways; a gateway killed with SIGKILL mid-stream leaves the worker running, the
other gateway's streams finish, and the killed gateway's jobs are cancelled in the worker within a
heartbeat timeout (read from the load the worker reports to the surviving gateway). Without a
leader (a static list), a reload that changes what the worker reads is refused; one that changes
only what gateways read is applied, and the worker keeps serving. Two more gateways with
`server.reuse_port` share one port on the host and both serve the worker's model, each also on a
port of its own (`--own-port`) where its metrics count what it served, while a gateway without the
setting is refused the shared port with a clear error.
"""

from __future__ import annotations

import json
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
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import REPO_ROOT, GatewayProcess, free_port, make_keys, wait_until
from tests.integration.conftest import demo_entry, write_registry

WORKER_ID = "shared@w1"
HEARTBEAT_TIMEOUT_S = 2.0
MAX_JOBS, WORKER_QUEUE = 2, 1


class Cluster:
    def __init__(
        self, root: Path, model_dir: Path, worker_queue: int = WORKER_QUEUE, **server: object
    ) -> None:
        self.root = root
        self.keys = root / "keys"
        make_keys(self.keys, "gateway", "worker")
        self.port = free_port()
        limits = {
            "max_concurrent_jobs": MAX_JOBS,
            "worker_queued_jobs": worker_queue,
            "max_queued_requests": 16,
        }
        self.config = write_registry(
            root / "models.yaml",
            [demo_entry("shared", model_dir, remote=True, limits=limits)],
            **{"heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S, **server},
            cluster={
                "backend": "static",
                "secret_key_file": str(self.keys / "gateway.key_secret"),
                "workers": [
                    {"worker_id": WORKER_ID, "model": "shared", "endpoint": f"tcp://127.0.0.1:{self.port}",
                     "public_key_file": str(self.keys / "worker.key")},
                ],
            },
        )  # fmt: skip

    def start_worker(self) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable, "-m", "model_worker", "--listen", f"tcp://127.0.0.1:{self.port}",
            "--config", str(self.config), "--model", "shared", "--worker-id", WORKER_ID,
            "--curve-secret-key", str(self.keys / "worker.key_secret"),
            "--gateway-public-key", str(self.keys / "gateway.key"),
        ]  # fmt: skip
        with open(self.root / "worker.log", "wb") as log:  # the child keeps its own copy of the fd
            return subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)

    def worker_log(self) -> str:
        return (self.root / "worker.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Cluster:
    return Cluster(tmp_path_factory.mktemp("cluster"), demo_model_dir)


@pytest.fixture(scope="module")
def worker(cluster: Cluster) -> Iterator[subprocess.Popen[bytes]]:
    process = cluster.start_worker()
    yield process
    process.terminate()
    process.wait(60)


@pytest.fixture(scope="module")
def gateways(
    cluster: Cluster, worker: subprocess.Popen[bytes]
) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    with GatewayProcess(cluster.config) as first, GatewayProcess(cluster.config) as second:
        yield first, second


def _shared(gateway: GatewayProcess) -> dict[str, Any] | None:
    found = [w for w in gateway.workers() if w["id"] == WORKER_ID]
    return found[0] if found else None


def _load(gateway: GatewayProcess) -> dict[str, Any]:
    worker = _shared(gateway)
    assert worker is not None and worker["load"] is not None, worker
    return dict(worker["load"], heartbeats=worker["heartbeats"], stats=worker["stats"])


def _others(load: dict[str, Any]) -> int:
    """Other gateways' jobs, as the gateway reads them (WorkerLoad.others): `yours` is counted by the
    worker's link thread as it sends the heartbeat, the rest by its engine thread a moment before, so
    a Generate read in between makes the difference -1 until the next report."""
    return max(int(load["active"] + load["queued"] - load["yours"]), 0)


class Stream(threading.Thread):
    """One streamed completion read on its own thread: its status, its data lines, when it began."""

    def __init__(self, gateway: GatewayProcess, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = gateway.url + "/v1/completions"
        self.body = {"model": "shared", "prompt": "Once upon a time", "max_tokens": max_tokens,
                     "ignore_eos": True, "stream": True,
                     "stream_options": {"include_usage": True}}  # fmt: skip
        self.status: int | None = None
        self.data: list[str] = []
        self.error: str | None = None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=120) as response:
                self.status = response.status_code
                if response.status_code != 200:
                    self.error = response.read().decode()
                    return
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        self.data.append(line[6:])
                        self.started.set()
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.started.set()

    @property
    def finished(self) -> bool:
        return bool(self.data) and self.data[-1] == "[DONE]"

    def completion_tokens(self) -> int:
        usage = [json.loads(d)["usage"] for d in self.data[:-1] if json.loads(d).get("usage")]
        return int(usage[-1]["completion_tokens"]) if usage else 0


def test_one_worker_serves_two_gateways_within_its_own_cap(
    gateways: tuple[GatewayProcess, GatewayProcess], worker: subprocess.Popen[bytes]
) -> None:
    first, second = gateways
    for gateway in gateways:
        reply = httpx.post(
            gateway.url + "/v1/completions",
            json={"model": "shared", "prompt": "hi", "max_tokens": 4, "ignore_eos": True},
        )
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    streams = [Stream(gateway, 120) for gateway in (first, second) for _ in range(3)]
    for stream in streams:
        stream.start()
    seen: list[dict[str, Any]] = []
    both = wait_until(
        lambda: next(
            (ld for ld in (_load(first), _load(second)) if (seen.append(ld) or True) and _others(ld)), None
        ),
        "the worker to report jobs of both gateways",
        poll_s=0.05,
    )
    assert both["max_jobs"] == MAX_JOBS and both["max_queue"] == WORKER_QUEUE
    for stream in streams:
        while stream.is_alive():
            seen.append(_load(first))
            stream.join(0.1)
    # Six streams, a cap of 2 running and 1 waiting: never more on the worker, from either view.
    assert max(ld["active"] for ld in seen) == MAX_JOBS, seen  # reached, never passed
    assert max(ld["queued"] for ld in seen) <= WORKER_QUEUE, seen
    # Each either ran to its end or was told to come back later (never a broken stream).
    for stream in streams:
        assert stream.status in (200, 429), (stream.status, stream.error)
        if stream.status == 200:
            assert stream.finished and stream.completion_tokens() == 120, stream.data[-3:]
        else:
            assert "worker_full" in (stream.error or "") or "queue_full" in (stream.error or ""), stream.error
    assert any(s.status == 200 for s in streams[:3]) and any(s.status == 200 for s in streams[3:])
    assert worker.poll() is None


def test_a_reload_that_changes_what_the_worker_reads_is_refused_without_a_leader(
    cluster: Cluster, gateways: tuple[GatewayProcess, GatewayProcess]
) -> None:
    first, _ = gateways
    original = cluster.config.read_text()
    registry = yaml.safe_load(original)
    try:
        registry["models"][0]["max_seq_len"] = 1024  # read by the worker: only a leader restarts it
        cluster.config.write_text(yaml.safe_dump(registry))
        reply = httpx.post(first.url + "/admin/reload", params={"wait": 30}, timeout=60)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["code"] == "invalid_config", error
        assert str(cluster.config) in error["message"] and "shared" in error["message"], error
        assert "backend static" in error["message"], error

        registry["models"][0]["max_seq_len"] = 2048
        registry["models"][0]["limits"]["max_queued_requests"] = 8  # the gateways' own: applied
        cluster.config.write_text(yaml.safe_dump(registry))
        reply = httpx.post(first.url + "/admin/reload", params={"wait": 30}, timeout=60)
        assert reply.status_code == 200 and reply.json()["retuned"] == ["shared"], reply.text
        assert reply.json()["workers_reload"] is None
        row = _shared(first)  # the listening worker stays, serving
        assert row is not None and row["state"] == "ready", row
        answer = httpx.post(
            first.url + "/v1/completions", json={"model": "shared", "prompt": "hi", "max_tokens": 2}
        )
        assert answer.status_code == 200, answer.text
    finally:
        cluster.config.write_text(original)
        assert httpx.post(first.url + "/admin/reload", params={"wait": 30}, timeout=60).status_code == 200


def test_gateways_that_reuse_the_port_share_it_and_its_requests(
    cluster: Cluster, worker: subprocess.Popen[bytes]
) -> None:
    registry = yaml.safe_load(cluster.config.read_text())
    registry["server"]["reuse_port"] = True
    shared = cluster.root / "reuse-port.yaml"
    shared.write_text(yaml.safe_dump(registry))
    port, own_ports = free_port(), [free_port(), free_port()]
    logs = [cluster.root / f"reuse-port-{i}.log" for i in range(2)]
    first, second = (
        GatewayProcess(shared, port=port, log_path=log, wait_ready=False, args=("--own-port", str(own)))
        for log, own in zip(logs, own_ports, strict=True)
    )
    with first, second:
        # Through a shared port a readiness probe may reach either one: each says in its own log
        # that it listens and that the worker is ready for it.
        def serving(gateway: GatewayProcess) -> bool:
            assert gateway.process is not None and gateway.process.poll() is None, gateway.log()
            return all(line in gateway.log_path.read_text() for line in ("Running on", "-> ready"))

        for gateway in (first, second):
            wait_until(lambda g=gateway: serving(g), "each gateway to listen and see the worker ready")
        ids = [f"reuse-port-{i}" for i in range(16)]
        for rid in ids:  # each on a connection of its own, so the kernel picks a gateway for each
            reply = httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"model": "shared", "prompt": "hi", "max_tokens": 2, "ignore_eos": True},
                headers={"X-Request-ID": rid},
                timeout=60,
            )
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
        served = [{rid for rid in ids if f"request_id={rid} " in log.read_text()} for log in logs]
        # 16 connections all on one of two gateways: a chance of 2 in 2**16.
        assert served[0] | served[1] == set(ids) and not served[0] & served[1], served
        assert served[0] and served[1], served
        # Each one's own port answers for it alone: its metrics count the requests it served.
        for own, mine in zip(own_ports, served, strict=True):
            metrics = httpx.get(f"http://127.0.0.1:{own}/metrics", timeout=10).text
            assert _completions_served(metrics) == len(mine), metrics
        # A gateway that does not ask to share the port is refused it, clearly.
        refused = subprocess.run(
            [sys.executable, "-m", "gateway", "serve", "--config", str(cluster.config), "--port", str(port)],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert refused.returncode == 1, refused.stderr
        assert (
            f"cannot listen on 127.0.0.1:{port}" in refused.stderr and "server.reuse_port" in refused.stderr
        )
        assert "Traceback" not in refused.stderr
    assert worker.poll() is None


def _completions_served(metrics: str) -> float:
    """The gateway_requests counter of /v1/completions answered 200, from a /metrics page."""
    total = 0.0
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "gateway_requests_total" and labels.get("status") == "200":
                total += sample.value if "completions" in labels.get("endpoint", "") else 0.0
    return total


def test_a_killed_gateway_leaves_the_worker_serving_and_its_jobs_cancelled(
    cluster: Cluster, gateways: tuple[GatewayProcess, GatewayProcess], worker: subprocess.Popen[bytes]
) -> None:
    doomed, survivor = gateways
    wait_until(lambda: _load(survivor)["active"] == 0, "the worker to be idle", poll_s=0.05)
    cancelled_before = _load(survivor)["stats"]["jobs_cancelled"]
    kept = Stream(survivor, 600)
    lost = Stream(doomed, 600)
    kept.start()
    lost.start()
    assert lost.started.wait(60) and kept.started.wait(60), (lost.error, kept.error)
    # The survivor sees the doomed gateway's job on the worker before the kill.
    wait_until(lambda: _others(_load(survivor)) == 1, "the other gateway's job in the load", poll_s=0.05)
    doomed.process.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    doomed.process.wait(10)
    assert lost.is_alive() or not lost.finished  # its client saw the connection end, not a finish

    def cancelled() -> dict[str, Any] | None:
        load = _load(survivor)
        return load if _others(load) == 0 and load["stats"]["jobs_cancelled"] > cancelled_before else None

    load = wait_until(
        cancelled, "the killed gateway's job to be cancelled", poll_s=0.05, context=cluster.worker_log
    )
    # Within a heartbeat timeout of the kill (the broken link is usually noticed at the next step).
    assert time.monotonic() - killed_at < HEARTBEAT_TIMEOUT_S + 1.0, load
    assert "is gone" in cluster.worker_log()
    assert kept.is_alive(), "the surviving stream should still be running when the other job is gone"
    kept.join(120)
    lost.join(30)
    assert kept.status == 200 and kept.finished and kept.completion_tokens() == 600, (
        kept.error,
        kept.data[-3:],
    )
    assert not lost.finished
    assert worker.poll() is None  # the worker outlived the gateway
    reply = httpx.post(
        survivor.url + "/v1/completions", json={"model": "shared", "prompt": "hi", "max_tokens": 3}
    )
    assert reply.status_code == 200


def test_gateways_hear_of_each_others_jobs_at_once_not_a_heartbeat_later(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """Each gateway admits by the load the shared worker reports; with heartbeats 30 s apart, a
    change in the jobs it holds still reaches every gateway at once. So a request at one gateway
    while the other fills the worker waits in its gateway (no 429 from a worker it thought free),
    and starts as soon as the other's jobs end, not at the next heartbeat."""
    cluster = Cluster(
        tmp_path, demo_model_dir, worker_queue=0, heartbeat_interval_s=30.0, heartbeat_timeout_s=90.0
    )
    worker = cluster.start_worker()
    try:
        with GatewayProcess(cluster.config) as busy, GatewayProcess(cluster.config) as other:
            filling = [Stream(busy, 200) for _ in range(MAX_JOBS)]
            for stream in filling:
                stream.start()
            for stream in filling:
                assert stream.started.wait(60) and stream.status == 200, stream.error
            # Well within the 30 s heartbeat interval: the worker reported the change itself.
            wait_until(
                lambda: _others(_load(other)) == MAX_JOBS, "the other gateway's jobs in the load",
                timeout=10.0, poll_s=0.05, context=cluster.worker_log,
            )  # fmt: skip
            late = Stream(other, 4)
            late.start()
            for stream in filling:
                stream.join(120)
                assert stream.finished and stream.completion_tokens() == 200, (stream.error, stream.data[-2:])
            late.join(15.0)  # the worker's next heartbeat is 30 s away: this is its own report
            assert not late.is_alive(), "the waiting request did not start once the worker had room"
            assert late.status == 200 and late.finished and late.completion_tokens() == 4, late.error
            assert _others(_load(other)) == 0
    finally:
        worker.terminate()
        worker.wait(60)
