"""Test harness: a real gateway process on a free port, started and stopped by the tests.

Runs in the pytest process. Owns `GatewayProcess`, which spawns `python -m gateway serve`, waits
for readiness over HTTP, and on exit sends SIGTERM and checks that the gateway exits.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class GatewayProcess:
    def __init__(
        self,
        config_path: Path,
        *,
        env: dict[str, str] | None = None,
        ready_timeout: float = 120.0,
        wait_ready: bool = True,
        log_path: Path | None = None,
    ) -> None:
        self.config_path = Path(config_path)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_timeout = ready_timeout
        self.wait_ready = wait_ready
        # Prepend, not replace: a GPU host puts carried wheels on PYTHONPATH too.
        python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self.env = {**os.environ, "PYTHONPATH": python_path, **(env or {})}
        self.log_path = log_path or self.config_path.with_suffix(f".{self.port}.log")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def __enter__(self) -> GatewayProcess:
        self._log = open(self.log_path, "wb")
        cmd = [
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--config",
            str(self.config_path),
            "--port",
            str(self.port),
        ]
        self.process = subprocess.Popen(
            cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO_ROOT
        )
        if self.wait_ready:
            self.wait_until_ready(self.ready_timeout)
        return self

    def wait_until_ready(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.process.returncode}:\n{self.log()}")
            try:
                response = httpx.get(self.url + "/health/ready", timeout=2)
                last = response.json()
                if response.status_code == 200:
                    return last  # type: ignore[no-any-return]
            except httpx.HTTPError as exc:
                last = exc
            time.sleep(0.2)
        raise TimeoutError(f"gateway not ready after {timeout}s: {last}\n{self.log()}")

    def wait_until_live(self, timeout: float = 60.0) -> None:
        """The HTTP server answers (models may still be loading, or have no worker yet)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health/live", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"gateway not live after {timeout}s:\n{self.log()}")

    def workers(self) -> list[dict[str, Any]]:
        return httpx.get(self.url + "/admin/workers", timeout=5).json()["workers"]  # type: ignore[no-any-return]

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-20000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise
        return self.process.returncode

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        try:
            self.stop()
        finally:
            self._log.close()
        if exc_type is None:
            # Every gateway a test runs also checks the worker state table (wire.states): a state
            # change outside it is a bug that the gateway logs and refuses.
            invalid = [line for line in self.log_path.read_text(errors="replace").splitlines()
                       if "invalid worker state transition" in line]  # fmt: skip
            assert not invalid, "\n".join(invalid)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes: it holds no memory or GPU.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
