"""Cluster mode, embeddings: two gateways share two listening replicas of an embedding model, and a
replica busy with one gateway's large embedding request is busy in the other gateway's view too (as
another gateway's request; in the first gateway's view, as its own), so that gateway sends its own
requests to the idle replica.

Real processes and sockets: two transformers workers on the demo embedding model, listening on tcp
with CURVE (ports 8140-8141), and two gateways (ports 8142-8143) that find them through a static
`server.cluster` list. What each gateway knows of a worker is read from its own /admin/workers: the
load of the worker's last report, and the part of it that is its own (`yours`).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.demo.embedding_model import make_demo_embedding_model
from tests.harness import REPO_ROOT, GatewayProcess, make_keys, wait_until
from tests.integration.conftest import demo_entry, write_registry

WORKER_PORTS = (8140, 8141)
GATEWAY_PORTS = (8142, 8143)
WORKER_IDS = ("e@r0", "e@r1")
BIG = [[7] * 256] * 800  # two hundred engine batches of 4: seconds of work on a CPU


class EmbeddingCluster:
    def __init__(self, root: Path, model_dir: Path) -> None:
        self.root = root
        self.keys = root / "keys"
        make_keys(self.keys, "gateway", "worker")
        limits = {"max_concurrent_jobs": 4, "worker_queued_jobs": 0, "request_timeout_s": 120}
        workers = [
            {"worker_id": worker_id, "model": "e", "endpoint": f"tcp://127.0.0.1:{port}", "replica": replica,
             "public_key_file": str(self.keys / "worker.key")}
            for replica, (worker_id, port) in enumerate(zip(WORKER_IDS, WORKER_PORTS, strict=True))
        ]  # fmt: skip
        self.config = write_registry(
            root / "models.yaml",
            [demo_entry("e", model_dir, task="embed", max_seq_len=512, max_batch_size=4, remote=True,
                        limits=limits)],
            heartbeat_interval_s=0.1, heartbeat_timeout_s=5.0,
            cluster={"backend": "static", "secret_key_file": str(self.keys / "gateway.key_secret"),
                     "workers": workers},
        )  # fmt: skip

    def start_worker(self, index: int) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable, "-m", "model_worker", "--listen", f"tcp://127.0.0.1:{WORKER_PORTS[index]}",
            "--config", str(self.config), "--model", "e", "--worker-id", WORKER_IDS[index],
            "--curve-secret-key", str(self.keys / "worker.key_secret"),
            "--gateway-public-key", str(self.keys / "gateway.key"),
        ]  # fmt: skip
        with open(self.root / f"worker{index}.log", "wb") as log:  # the child keeps its own copy
            return subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    root = tmp_path_factory.mktemp("cluster-embed")
    cluster = EmbeddingCluster(root, make_demo_embedding_model(root / "demo-embed", seed=2))
    workers = [cluster.start_worker(index) for index in range(2)]
    try:
        with (
            GatewayProcess(cluster.config, port=GATEWAY_PORTS[0]) as first,
            GatewayProcess(cluster.config, port=GATEWAY_PORTS[1]) as second,
        ):
            for gateway in (first, second):
                wait_until(lambda g=gateway: all(w["state"] == "ready" for w in _views(g)),  # type: ignore[misc]
                           "both replicas to be ready", context=gateway.events)  # fmt: skip
            yield first, second
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait(60)


def _views(gateway: GatewayProcess) -> list[dict[str, Any]]:
    found = {w["id"]: w for w in gateway.workers()}
    return [found[worker_id] for worker_id in WORKER_IDS if worker_id in found] if len(found) == 2 else []


def _view(gateway: GatewayProcess, index: int) -> dict[str, Any]:
    worker = {w["id"]: w for w in gateway.workers()}[WORKER_IDS[index]]
    assert worker["load"] is not None, worker
    return worker  # type: ignore[no-any-return]


def _busy_load(gateway: GatewayProcess, index: int) -> dict[str, Any] | None:
    load = _view(gateway, index)["load"]
    return load if load["active"] + load["queued"] else None  # type: ignore[no-any-return]


def _busy_replicas(gateway: GatewayProcess) -> list[int]:
    return [index for index in range(2) if _busy_load(gateway, index)]


class Embedding(threading.Thread):
    def __init__(self, gateway: GatewayProcess, token_ids: list[list[int]]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = gateway.url + "/v1/embeddings", {"model": "e", "input": token_ids}
        self.status: int | None = None

    def run(self) -> None:
        self.status = httpx.post(self.url, json=self.body, timeout=120).status_code


def test_a_replica_busy_embedding_for_one_gateway_is_routed_around_by_the_other(
    gateways: tuple[GatewayProcess, GatewayProcess],
) -> None:
    first, second = gateways
    big = Embedding(first, BIG)
    big.start()  # both replicas idle: either may take it (a tie)
    [busy] = wait_until(lambda: _busy_replicas(first), "a replica busy in the first gateway's view",
                        context=first.events)  # fmt: skip
    idle = 1 - busy
    mine = _busy_load(first, busy)
    assert mine is not None and mine["yours"] == mine["active"] + mine["queued"] == 1, mine  # all its own
    theirs = wait_until(lambda: _busy_load(second, busy), "that replica busy in the second gateway's view",
                        context=second.events)  # fmt: skip
    assert theirs["active"] + theirs["queued"] == 1 and theirs["yours"] == 0, theirs  # another's
    idle_before = _view(second, idle)["stats"]["jobs_finished"]  # the inputs it embedded so far
    small = [[7] * 16] * 3
    reply = httpx.post(second.url + "/v1/embeddings", json={"model": "e", "input": small}, timeout=120)
    assert reply.status_code == 200 and len(reply.json()["data"]) == 3, reply.text
    assert big.is_alive(), "the large request ended first: make it larger"
    # The idle replica embedded the small request (on the busy one it would have waited for the
    # large one; without the busy one's load the two are a tie, which either may win).
    wait_until(lambda: _view(second, idle)["stats"]["jobs_finished"] >= idle_before + len(small),
               "the idle replica to have embedded the second gateway's request",
               context=second.events)  # fmt: skip
    big.join(120)
    assert big.status == 200
    for gateway in gateways:
        wait_until(lambda g=gateway: not _busy_replicas(g),  # type: ignore[misc]
                   "both replicas idle again in each gateway's view", context=gateway.events)  # fmt: skip
