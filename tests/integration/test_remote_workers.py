"""Remote workers over tcp with CURVE: who may join, losing contact, rejoining, refusing to start."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from tests.harness import REPO_ROOT, GatewayProcess, free_port, wait_until
from tests.integration.conftest import demo_entry, write_registry
from wire import messages as wire

SLOW_ON_CUE = "test:tests.fault_engines.FaultyEngine"  # "<<slow>>" in a prompt: 0.05 s a step
TEST_ENGINES = {"GATEWAY_ALLOW_TEST_ENGINES": "1"}


class Setup:
    def __init__(
        self,
        root: Path,
        model_dir: Path,
        heartbeat_timeout_s: float = 2,
        far_engine: dict[str, str] | None = None,
    ) -> None:
        far_engine = far_engine or {}
        self.keys = root / "keys"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway",
                "keys",
                str(self.keys),
                "--name",
                "gateway",
                "--name",
                "good",
                "--name",
                "bad",
                "--models",
                "far",
            ],
            check=True,
            cwd=REPO_ROOT,
            capture_output=True,
        )
        self.authorized = root / "authorized"
        self.authorized.mkdir()
        shutil.copy(self.keys / "good.key", self.authorized)
        self.port = free_port()
        self.config = write_registry(
            root / "models.yaml",
            [demo_entry("local", model_dir), demo_entry("far", model_dir, remote=True, **far_engine)],
            heartbeat_timeout_s=heartbeat_timeout_s,
            remote_workers={
                "bind": f"tcp://127.0.0.1:{self.port}",
                "secret_key_file": str(self.keys / "gateway.key_secret"),
                "authorized_keys_dir": str(self.authorized),
            },
        )
        self.root = root
        self.env = {**os.environ, **TEST_ENGINES} if far_engine else None

    def worker(self, name: str, key: str, *extra: str) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable, "-m", "model_worker", "--connect", f"tcp://127.0.0.1:{self.port}",
            "--config", str(self.config), "--model", "far", "--worker-id", name,
            "--curve-secret-key", str(self.keys / f"{key}.key_secret"),
            "--gateway-public-key", str(self.keys / "gateway.key"), *extra,
        ]  # fmt: skip
        with open(self.root / f"{name}.log", "wb") as log:  # the child keeps its own copy of the fd
            return subprocess.Popen(cmd, cwd=REPO_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Setup:
    return Setup(tmp_path_factory.mktemp("remote"), demo_model_dir)


@pytest.fixture(scope="module")
def gateway(setup: Setup) -> Iterator[GatewayProcess]:
    with GatewayProcess(setup.config, wait_ready=False) as gw:
        gw.wait_until_live()
        yield gw


@pytest.fixture(scope="module")
def good_worker(setup: Setup, gateway: GatewayProcess) -> Iterator[subprocess.Popen[bytes]]:
    worker = setup.worker("far@good", "good")
    wait_until(
        lambda: _state(gateway, "far@good") == "ready", "the remote worker to join", context=gateway.events
    )
    gateway.wait_until_ready(60)  # the local model's worker too: /health/ready covers every model
    yield worker
    worker.kill()
    worker.wait(10)


def _state(gateway: GatewayProcess, worker_id: str) -> str | None:
    found = [w for w in gateway.workers() if w["id"] == worker_id]
    return str(found[0]["state"]) if found else None


def _idle(gateway: GatewayProcess, worker_id: str) -> dict[str, Any] | None:
    """The worker once its heartbeat shows no job: its counters then include every job it ran."""
    (worker,) = [w for w in gateway.workers() if w["id"] == worker_id]
    return worker if worker["active_jobs"] == 0 and worker["queued_jobs"] == 0 else None


def test_authorized_worker_joins_and_serves(
    gateway: GatewayProcess, good_worker: subprocess.Popen[bytes]
) -> None:
    info = next(w for w in gateway.workers() if w["id"] == "far@good")
    assert info["remote"] is True and info["pid"] == good_worker.pid and info["model"] == "far"
    reply = httpx.post(
        gateway.url + "/v1/completions",
        json={"model": "far", "prompt": "hi", "max_tokens": 5, "ignore_eos": True},
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 5
    assert httpx.get(gateway.url + "/health/ready", timeout=5).status_code == 200


def test_unknown_key_and_plaintext_cannot_exchange_a_message(
    setup: Setup, gateway: GatewayProcess, good_worker: subprocess.Popen[bytes]
) -> None:
    intruder = setup.worker("far@intruder", "bad")
    ctx = zmq.Context()
    plain = ctx.socket(zmq.DEALER)
    plain.setsockopt(zmq.IDENTITY, b"far@plain")
    E = zmq.Event
    outcomes = E.HANDSHAKE_FAILED_NO_DETAIL | E.HANDSHAKE_FAILED_PROTOCOL | E.HANDSHAKE_FAILED_AUTH
    handshakes = plain.get_monitor_socket(outcomes | E.HANDSHAKE_SUCCEEDED)
    plain.connect(f"tcp://127.0.0.1:{setup.port}")
    plain.send(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, "far@plain", 1)))
    try:
        # The intruder learns at its handshake that it was refused, and exits before loading anything.
        assert intruder.wait(30) == 3
        assert "refused this worker's CURVE key" in (setup.root / "far@intruder.log").read_text()
        # The plaintext peer's handshake fails (a mechanism the listener does not speak): its Hello
        # never left its queue. Its own socket says so, instead of a pause and a hope.
        assert handshakes.poll(30_000), "the plaintext handshake neither failed nor succeeded"
        event = recv_monitor_message(handshakes)["event"]
        assert event != E.HANDSHAKE_SUCCEEDED, event
        ids = {w["id"] for w in gateway.workers()}
        assert "far@intruder" not in ids and "far@plain" not in ids
        log = gateway.log()
        assert "far@intruder" not in log and "far@plain" not in log
    finally:
        intruder.kill()
        intruder.wait(10)
        plain.disable_monitor()
        handshakes.close(0)
        plain.close(0)
        ctx.term()


def test_lost_contact_fails_requests_then_rejoins_without_duplicates(
    gateway: GatewayProcess, good_worker: subprocess.Popen[bytes]
) -> None:
    body = {"model": "far", "prompt": "long", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    before = wait_until(lambda: _idle(gateway, "far@good"), "the remote worker to be idle")
    events: list[str] = []
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        next(lines)
        os.kill(good_worker.pid, signal.SIGSTOP)  # the host vanishes: no frames, no FIN
        events = [line for line in lines if line.startswith(("event:", "data:"))]
    # Ended by the heartbeat timeout (2 s), which names the lost contact: not by a deadline or the
    # client's own timeout (event order, no wall-clock bound).
    assert events[-3] == "event: error" and "lost contact" in json.loads(events[-2][6:])["error"]["message"]
    assert _state(gateway, "far@good") == "lost"
    assert httpx.get(gateway.url + "/health/ready", timeout=5).status_code == 503
    refused = httpx.post(gateway.url + "/v1/completions", json={"model": "far", "prompt": "x"}, timeout=10)
    assert refused.status_code == 503

    os.kill(good_worker.pid, signal.SIGCONT)  # the link is back
    wait_until(lambda: _state(gateway, "far@good") == "ready", "the worker to rejoin", context=gateway.events)
    # The job of the ended request was cancelled on rejoin, not resumed: nothing runs twice. The
    # worker counts it cancelled, and its 1500 tokens never finish.

    def stale_job_cancelled() -> dict[str, Any] | None:
        now = _idle(gateway, "far@good")
        return now if now and now["stats"]["jobs_cancelled"] > before["stats"]["jobs_cancelled"] else None

    worker = wait_until(stale_job_cancelled, "the stale job to be cancelled", context=gateway.events)
    assert worker["stats"]["jobs_finished"] == before["stats"]["jobs_finished"], worker["stats"]
    assert worker["pid"] == good_worker.pid
    reply = httpx.post(
        gateway.url + "/v1/completions", json={"model": "far", "prompt": "hi", "max_tokens": 3}
    )
    assert reply.status_code == 200


def test_tcp_listener_without_authorized_keys_refuses_to_start(setup: Setup, tmp_path: Path) -> None:
    empty = tmp_path / "nobody"
    empty.mkdir()
    config = tmp_path / "models.yaml"
    raw = setup.config.read_text().replace(str(setup.authorized), str(empty))
    config.write_text(raw)
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", "0"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
    )
    assert result.returncode == 2
    assert "no authorized worker keys" in result.stderr and "Traceback" not in result.stderr


def test_a_worker_that_exits_on_sigterm_says_so(tmp_path: Path, demo_model_dir: Path) -> None:
    """No request waits for the heartbeat timeout (30 s here) when a remote worker stops on purpose:
    its last frame tells the gateway, which ends what it held and refuses new requests at once."""
    # Its stream must outlast the 1 s drain grace however fast the machine: the slow cue (0.05 s a step).
    setup = Setup(tmp_path, demo_model_dir, heartbeat_timeout_s=30, far_engine={"engine": SLOW_ON_CUE})
    with GatewayProcess(setup.config, wait_ready=False, env=TEST_ENGINES) as gateway:
        gateway.wait_until_live()
        worker = setup.worker("far@leaving", "good", "--shutdown-grace-s", "1", "--log-format", "json")
        try:
            wait_until(
                lambda: _state(gateway, "far@leaving") == "ready",
                "the remote worker to join",
                context=gateway.events,
            )
            body = {
                "model": "far",
                "prompt": "<<slow>> go",
                "max_tokens": 1500,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=30) as response:
                lines = response.iter_lines()
                next(lines)
                worker.send_signal(signal.SIGTERM)
                started = time.monotonic()
                events = [line for line in lines if line.startswith(("event:", "data:"))]
            assert events[-3] == "event: error"  # its drain grace (1 s) ran out
            # Sent while the worker drains: answered when it leaves, not after a heartbeat timeout.
            refused = httpx.post(
                gateway.url + "/v1/completions", json={"model": "far", "prompt": "x"}, timeout=30
            )
            assert refused.status_code == 503, refused.text
            assert worker.wait(20) == 0
            wait_until(lambda: _state(gateway, "far@leaving") == "lost", "the worker to be marked lost", 20)
            # A generous bound (the grace is 1 s), and still short of the 30 s heartbeat timeout
            # that the gateway must not have waited for.
            assert time.monotonic() - started < 25
            (info,) = [w for w in gateway.workers() if w["id"] == "far@leaving"]
            assert "exited (stopped on request)" in info["last_error"]
            # --log-format json: every line the worker wrote is one JSON object naming it.
            lines = (setup.root / "far@leaving.log").read_text().splitlines()
            entries = [json.loads(line) for line in lines if line.strip()]
            assert entries and all(e["worker"] == "far@leaving" and e["model"] == "far" for e in entries)
        finally:
            worker.kill()
            worker.wait(10)
