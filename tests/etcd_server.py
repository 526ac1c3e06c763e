"""A real etcd for the cluster tests.

Runs in the pytest process. `EtcdServer` starts Debian's etcd (package etcd-server; .ci/run
installs it) on free loopback ports with a data folder under the test's temp dir, and can kill it
(SIGKILL, as a crash) and start it again on the same ports and data. `etcd_cluster_section` is
the registry's `server.cluster` that the cluster tests give their gateways and workers.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import free_port, wait_until


class EtcdServer:
    def __init__(self, folder: Path) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            if os.environ.get("CI"):
                pytest.fail("etcd is missing: .ci/run installs Debian's etcd-server package")
            pytest.skip("etcd is not installed (apt-get install etcd-server)")
        self.binary = binary
        self.folder = folder
        self.name = "test"  # the member's name in its one-member cluster
        self.ip = "127.0.0.1"
        self.client_port = free_port()
        self.peer_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.ip}:{self.client_port}"

    def arguments(self) -> list[str]:
        """etcd's command line: a one-member cluster on `ip`'s two ports, its data in the folder."""
        client, peer = f"http://{self.endpoint}", f"http://{self.ip}:{self.peer_port}"
        return [
            self.binary, "--name", self.name, "--data-dir", str(self.folder / "data"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}", "--initial-cluster-state", "new",
            "--logger", "zap", "--log-outputs", "stderr",
        ]  # fmt: skip

    def command(self, arguments: list[str]) -> list[str]:
        """How the command line is run (here as it is; tests.cluster_ha runs it on a host of its LAN)."""
        return arguments

    def start(self) -> None:
        with (self.folder / "etcd.log").open("ab") as log:  # the child keeps its own copy of the fd
            self.process = subprocess.Popen(self.command(self.arguments()), stdout=log, stderr=log)
        wait_until(self._healthy, "etcd to answer /health", context=self.log)

    def _healthy(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"etcd exited with {self.process.returncode}:\n{self.log()}")
        try:
            response = httpx.get(f"http://{self.endpoint}/health", timeout=1)
        except httpx.HTTPError:
            return False
        return response.status_code == 200 and response.json().get("health") == "true"

    def kill(self) -> None:
        """SIGKILL: as a crash; the data folder stays for the next start."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None

    def log(self) -> str:
        path = self.folder / "etcd.log"
        return path.read_text(errors="replace") if path.exists() else ""


def etcd_cluster_section(etcd: EtcdServer, keys: Path, prefix: str, ttl_s: float) -> dict[str, Any]:
    """`server.cluster` on backend etcd: the gateway's key from `keys` (`gateway keys`), leases of
    `ttl_s` for workers and the leader, and short timeouts and retries, so a test sees handovers
    within seconds."""
    return {
        "backend": "etcd",
        "secret_key_file": str(keys / "gateway.key_secret"),
        "etcd": {"endpoints": [etcd.endpoint], "prefix": prefix,
                 "worker_ttl_s": ttl_s, "leader_ttl_s": ttl_s,
                 "request_timeout_s": 0.5, "retry_interval_s": 0.2},
    }  # fmt: skip
