"""Two hosts in network namespaces: a remote worker behind a veth link that is cut and restored.

The gateway runs in this namespace; the worker runs in a namespace of its own, reaching the
gateway's CURVE listener over a veth pair (test-only addresses 10.213.N.0/24 that this test makes
and removes). Skips, saying why, where namespaces cannot be made (no root, no iproute2).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import REPO_ROOT, GatewayProcess, free_port, wait_until
from tests.integration.conftest import demo_entry, write_registry


def run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=20)


@pytest.fixture()
def namespace() -> Iterator[tuple[str, str, str]]:
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("network namespaces need root and iproute2 (ip)")
    tag = uuid.uuid4().hex[:6]
    name, host_end, ns_end = f"llmgw-{tag}", f"vgw{tag}", f"vwk{tag}"
    subnet = f"10.213.{int(tag[:2], 16)}"
    try:
        run("ip", "netns", "add", name)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"cannot create a network namespace here: {getattr(exc, 'stderr', exc)!r}")
    try:
        run("ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        run("ip", "link", "set", ns_end, "netns", name)
        run("ip", "addr", "add", f"{subnet}.1/24", "dev", host_end)
        run("ip", "link", "set", host_end, "up")
        run("ip", "netns", "exec", name, "ip", "addr", "add", f"{subnet}.2/24", "dev", ns_end)
        run("ip", "netns", "exec", name, "ip", "link", "set", ns_end, "up")
        run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield name, host_end, f"{subnet}.1"
    finally:
        subprocess.run(["ip", "link", "del", host_end], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def state_of(gateway: GatewayProcess, worker_id: str) -> str | None:
    found = [w for w in gateway.workers() if w["id"] == worker_id]
    return str(found[0]["state"]) if found else None


def wait_state(gateway: GatewayProcess, worker_id: str, state: str, timeout: float) -> None:
    wait_until(lambda: state_of(gateway, worker_id) == state, f"{worker_id} to be {state}", timeout,
               context=gateway.events)  # fmt: skip


def worker_info(gateway: GatewayProcess) -> dict[str, Any]:
    return next(w for w in gateway.workers() if w["id"] == "far@host-b")


def idle_info(gateway: GatewayProcess) -> dict[str, Any] | None:
    info = worker_info(gateway)
    return info if info["active_jobs"] == 0 else None


def test_link_cut_and_restored(namespace: tuple[str, str, str], tmp_path: Path, demo_model_dir: Path) -> None:
    netns, host_end, gateway_ip = namespace
    keys, authorized = tmp_path / "keys", tmp_path / "authorized"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway",
            "keys",
            str(keys),
            "--name",
            "gateway",
            "--name",
            "worker",
            "--models",
            "*",
        ],
        check=True,
        cwd=REPO_ROOT,
        capture_output=True,
    )
    authorized.mkdir()
    shutil.copy(keys / "worker.key", authorized)
    port = free_port()
    config = write_registry(
        tmp_path / "models.yaml",
        [demo_entry("far", demo_model_dir, remote=True)],
        heartbeat_timeout_s=2,
        remote_workers={
            "bind": f"tcp://{gateway_ip}:{port}",
            "secret_key_file": str(keys / "gateway.key_secret"),
            "authorized_keys_dir": str(authorized),
        },
    )
    worker_cmd = [
        "ip", "netns", "exec", netns, sys.executable, "-m", "model_worker",
        "--connect", f"tcp://{gateway_ip}:{port}", "--config", str(config), "--model", "far",
        "--worker-id", "far@host-b", "--curve-secret-key", str(keys / "worker.key_secret"),
        "--gateway-public-key", str(keys / "gateway.key"),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with GatewayProcess(config, wait_ready=False) as gateway:
        gateway.wait_until_live()
        with open(tmp_path / "worker.log", "wb") as log:
            worker = subprocess.Popen(
                worker_cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            wait_state(gateway, "far@host-b", "ready", 90)
            at_ready = worker_info(gateway)["stats"]  # sent with Ready: the warm-up's jobs included
            body = {"model": "far", "prompt": "across hosts", "max_tokens": 4}
            assert httpx.post(gateway.url + "/v1/completions", json=body, timeout=30).status_code == 200

            def request_counted() -> dict[str, Any] | None:
                info = idle_info(gateway)
                finished = info["stats"]["jobs_finished"] if info else 0
                return info if finished > at_ready["jobs_finished"] else None

            # An idle heartbeat may predate the request: wait for one that counts it finished.
            before = wait_until(request_counted, "the request to be counted", context=gateway.events)

            stream_body = {**body, "max_tokens": 1500, "ignore_eos": True, "stream": True}
            with httpx.stream(
                "POST", gateway.url + "/v1/completions", json=stream_body, timeout=30
            ) as response:
                lines = response.iter_lines()
                next(lines)
                # Frozen while the cable is out, its job is still running when the link returns, however
                # fast this machine generates: the cancel, not the job's own end, is what is tested.
                worker.send_signal(signal.SIGSTOP)
                run("ip", "link", "set", host_end, "down")  # the cable is pulled
                events = [line for line in lines if line.startswith(("event:", "data:"))]
            assert events[-3] == "event: error"
            assert "lost contact" in json.loads(events[-2][6:])["error"]["message"]
            assert state_of(gateway, "far@host-b") == "lost"

            run("ip", "link", "set", host_end, "up")  # and plugged back in
            worker.send_signal(signal.SIGCONT)
            wait_state(gateway, "far@host-b", "ready", 30)

            def stale_job_cancelled() -> dict[str, Any] | None:
                info = idle_info(gateway)
                return (
                    info
                    if info and info["stats"]["jobs_cancelled"] > before["stats"]["jobs_cancelled"]
                    else None
                )

            # The job of the failed request was cancelled, not resumed: it never finishes.
            info = wait_until(stale_job_cancelled, "the stale job to be cancelled", context=gateway.events)
            assert info["stats"]["jobs_finished"] == before["stats"]["jobs_finished"], info["stats"]
            assert httpx.post(gateway.url + "/v1/completions", json=body, timeout=30).status_code == 200
        finally:
            worker.kill()
            worker.wait(10)
