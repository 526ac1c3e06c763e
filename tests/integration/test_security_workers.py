"""Attacks on the worker link, performed for real: authorized remote peers that claim a local worker's
id or another key's worker, keys used for models they were not issued for, a key removed while in
use, a flood of Hellos, and malformed heartbeats. Each must fail to do harm, and be logged.

Runs a real gateway with a local CPU worker, a real remote worker over CURVE tcp, and ZeroMQ DEALER
sockets in the test process that play the attackers with real keys.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
import zmq.auth

from tests.harness import REPO_ROOT, GatewayProcess, free_port, wait_until
from tests.integration.conftest import demo_entry, write_registry
from wire import messages as wire
from wire.states import WorkerState
from wire.stats import EngineInfo

PER_KEY = 3


def make_keys(folder: Path, models: str, *names: str) -> None:
    cmd = [sys.executable, "-m", "gateway", "keys", str(folder), "--models", models]
    for name in names:
        cmd += ["--name", name]
    subprocess.run(cmd, check=True, cwd=REPO_ROOT, capture_output=True)


class Lab:
    def __init__(self, root: Path, model_dir: Path) -> None:
        self.keys, self.authorized = root / "keys", root / "authorized"
        make_keys(self.keys, "far", "gateway", "good", "spare", "doomed")
        make_keys(self.keys, "other", "elsewhere")
        self.authorized.mkdir()
        for name in ("good", "spare", "doomed", "elsewhere"):
            shutil.copy(self.keys / f"{name}.key", self.authorized)
        self.port = free_port()
        self.config = write_registry(
            root / "models.yaml",
            [demo_entry("local", model_dir), demo_entry("far", model_dir, remote=True)],
            heartbeat_timeout_s=2,
            remote_workers={
                "bind": f"tcp://127.0.0.1:{self.port}",
                "secret_key_file": str(self.keys / "gateway.key_secret"),
                "authorized_keys_dir": str(self.authorized),
                "max_workers_per_key": PER_KEY,
            },
        )
        self.root = root
        self.ctx = zmq.Context()

    def peer(self, key: str, identity: str) -> zmq.Socket:
        """An attacker: a DEALER with an authorized key, speaking the protocol by hand."""
        public, secret = zmq.auth.load_certificate(str(self.keys / f"{key}.key_secret"))
        server_public, _ = zmq.auth.load_certificate(str(self.keys / "gateway.key"))
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_public
        sock.connect(f"tcp://127.0.0.1:{self.port}")
        return sock

    def worker(self, name: str, key: str) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable, "-m", "model_worker", "--connect", f"tcp://127.0.0.1:{self.port}",
            "--config", str(self.config), "--model", "far", "--worker-id", name,
            "--curve-secret-key", str(self.keys / f"{key}.key_secret"),
            "--gateway-public-key", str(self.keys / "gateway.key"),
        ]  # fmt: skip
        with open(self.root / f"{name}.log", "wb") as log:
            return subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[Lab]:
    lab = Lab(tmp_path_factory.mktemp("security"), demo_model_dir)
    yield lab
    lab.ctx.destroy(0)


@pytest.fixture(scope="module")
def gateway(lab: Lab) -> Iterator[GatewayProcess]:
    with GatewayProcess(lab.config, wait_ready=False) as gw:
        gw.wait_until_live()
        wait_until(lambda: state(gw, "local#0") == "ready", "the local worker to be ready", context=gw.events)
        yield gw


def state(gateway: GatewayProcess, worker_id: str) -> str | None:
    found = [w for w in gateway.workers() if w["id"] == worker_id]
    return str(found[0]["state"]) if found else None


def complete(gateway: GatewayProcess, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "the same prompt", "max_tokens": 6, "temperature": 0}
    return httpx.post(gateway.url + "/v1/completions", json=body, timeout=30)


def ready_frame() -> bytes:
    info = EngineInfo("transformers", "forged", 2048, 32, 2048, 1024, False, [])
    return wire.encode(wire.Ready(info, 1, 0.0, 0.0, True))


def test_a_remote_peer_cannot_take_over_a_local_model(lab: Lab, gateway: GatewayProcess) -> None:
    expected = complete(gateway, "local").json()["choices"][0]["text"]
    attacker = lab.peer("good", "local#0")  # the local worker's id, spoken over tcp
    for frame in (
        wire.encode(wire.Hello(wire.PROTOCOL_VERSION, "local#0", 4242)),
        ready_frame(),
        wire.encode(wire.Status(WorkerState.READY, "", None)),
        wire.encode(wire.Step([wire.JobOutput("any", "FORGED", [1])])),
    ):
        attacker.send(frame)
    # Frames of one connection are handled in order, each refused like the first (logged) one.
    refusal = "key 'good' claimed the id of local worker 'local#0'; refused"
    wait_until(lambda: refusal in gateway.log(), "the attacker's refusal", context=gateway.events)
    replies = [complete(gateway, "local") for _ in range(20)]
    assert all(r.status_code == 200 for r in replies)
    assert {r.json()["choices"][0]["text"] for r in replies} == {expected}  # the real worker's text
    assert not attacker.poll(500), "the attacker received a frame meant for the local worker"
    assert state(gateway, "local#0") == "ready"
    attacker.close()


def test_keys_serve_only_their_models_and_ids_stay_with_their_key(lab: Lab, gateway: GatewayProcess) -> None:
    worker = lab.worker("far@good", "good")
    try:
        wait_until(
            lambda: state(gateway, "far@good") == "ready",
            "the remote worker to be ready",
            context=gateway.events,
        )
        assert complete(gateway, "far").status_code == 200
        # A key issued for another model cannot join this one.
        evil = lab.peer("elsewhere", "far@evil")
        evil.send(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, "far@evil", 1)))
        wait_until(lambda: "may not serve model 'far'" in gateway.log(), "the refusal of key 'elsewhere'")
        assert state(gateway, "far@evil") is None
        evil.close()
    finally:
        worker.kill()
        worker.wait(10)
    # Once the worker is gone, another authorized key cannot take its id over. (While it is
    # connected, ZeroMQ itself refuses a second peer with the same id.)
    wait_until(
        lambda: state(gateway, "far@good") == "lost",
        "the remote worker to be lost",
        15,
        context=gateway.events,
    )
    thief = lab.peer("spare", "far@good")
    for frame in (wire.encode(wire.Hello(wire.PROTOCOL_VERSION, "far@good", 7)), ready_frame()):
        thief.send(frame)
    wait_until(
        lambda: "key 'spare' claimed remote worker 'far@good' of another key" in gateway.log(), "the refusal"
    )
    # Its Ready came on the same connection right behind the Hello, and met the same refusal.
    assert state(gateway, "far@good") == "lost"  # not revived by the thief
    assert complete(gateway, "far").status_code == 503
    thief.close()


def test_a_removed_key_is_refused_without_a_restart(lab: Lab, gateway: GatewayProcess) -> None:
    worker = lab.worker("far@doomed", "doomed")
    try:
        wait_until(
            lambda: state(gateway, "far@doomed") == "ready",
            "the doomed worker to be ready",
            context=gateway.events,
        )
        (lab.authorized / "doomed.key").unlink()
        # Its frames are refused from now on: it falls silent to the gateway, which marks it lost.
        wait_until(
            lambda: state(gateway, "far@doomed") == "lost",
            "the removed key's worker to be lost",
            15,
            context=gateway.events,
        )
        log = gateway.log()
        assert "worker key(s) removed from" in log and "['doomed']" in log
        assert "frame over tcp refused: unknown key" in log  # a key no longer known is named by its prefix
    finally:
        worker.kill()
        worker.wait(10)


def test_hello_floods_and_bad_heartbeats_are_bounded(lab: Lab, gateway: GatewayProcess) -> None:
    flood = [lab.peer("spare", f"far@flood{i}") for i in range(50)]
    for i, sock in enumerate(flood):
        sock.send(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, f"far@flood{i}", i)))

    def flood_joined() -> int:
        return sum(1 for w in gateway.workers() if str(w["id"]).startswith("far@flood"))

    # The cap was hit (a refusal is logged once it is) after its 3 workers joined.
    wait_until(
        lambda: flood_joined() >= PER_KEY and "max_workers_per_key=3 already use this key" in gateway.log(),
        "the flood to hit max_workers_per_key",
        context=gateway.events,
    )
    assert flood_joined() == PER_KEY  # max_workers_per_key, not 50
    # A heartbeat whose figures are not numbers is dropped; the admin API keeps answering.
    flood[0].send(msgpack.packb(["hb", ["ready", ["x"]]]))
    flood[0].send(msgpack.packb(["hb", ["ready", [-5]]]))
    wait_until(
        lambda: "dropped a bad frame from worker far@flood0" in gateway.log(), "the bad heartbeat dropped"
    )
    assert httpx.get(gateway.url + "/admin/workers", timeout=5).status_code == 200
    metrics = httpx.get(gateway.url + "/metrics", timeout=5)
    assert metrics.status_code == 200 and len(metrics.text) < 200_000
    for sock in flood:
        sock.close()


def test_workers_do_not_receive_api_keys(tmp_path: Path, demo_model_dir: Path) -> None:
    config = write_registry(tmp_path / "models.yaml", [demo_entry("m", demo_model_dir)])
    secrets = {"GATEWAY_API_KEYS": "k" * 20, "GATEWAY_ADMIN_KEYS": "a" * 20}
    with GatewayProcess(config, env={**os.environ, **secrets}, wait_ready=False) as gw:
        gw.wait_until_live()
        headers = {"Authorization": "Bearer " + "a" * 20}
        wait_until(lambda: _worker_pid(gw, headers) is not None, "the worker to start", context=gw.events)
        environ = Path(f"/proc/{_worker_pid(gw, headers)}/environ").read_bytes().split(b"\0")
        assert not [v for v in environ if v.startswith((b"GATEWAY_API_KEYS=", b"GATEWAY_ADMIN_KEYS="))]


def _worker_pid(gateway: GatewayProcess, headers: dict[str, str]) -> int | None:
    workers = httpx.get(gateway.url + "/admin/workers", headers=headers, timeout=5).json()["workers"]
    return workers[0]["pid"] if workers and workers[0]["state"] == "ready" else None
