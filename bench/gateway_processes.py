"""Groups of gateway processes, each group on one port, in front of one listening worker, for the
benchmarks.

Runs in the benchmark's process (bench/bench_engines.py `--gateway-processes 1,4`), which starts and
stops what it owns: a CURVE key pair for the gateways and one for the worker (`gateway keys`), a
registry in cluster mode (`backend: static`, `server.reuse_port`), the worker
(`model-worker --listen`, on the model's GPUs) and, for each size N asked for, N gateways on a port
of their own, each with a log of its own. The kernel hands each new connection to one gateway of
the port's group, so a burst of requests is admitted by N event loops instead of one
(docs/scale-out.md, "Several gateway processes on one port"). Every group talks to the same worker
over the same transport (tcp with CURVE), so one group against another measures the number of
processes alone. Nothing here is the product's: it is how an operator would run it by hand.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.harness import REPO_ROOT, GatewayProcess, free_port

READY_LINES = ("Running on", "-> ready")  # each gateway's log: it listens, and it sees the worker ready


class GatewayProcesses:
    """For each size in `sizes`, that many gateways on a port of their own, all serving `entry` (a
    registry entry of ours) from one listening worker. Once entered: `url(size)`, `pids(size)` and
    `worker_pid`."""

    def __init__(
        self,
        entry: dict[str, Any],
        sizes: list[int],
        folder: Path,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 900.0,
    ) -> None:
        if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
            raise ValueError(f"gateway processes: {sizes} (distinct sizes of at least 1)")
        self.entry, self.sizes, self.folder = entry, sizes, folder
        self.env = env or {}
        self.ready_timeout_s = ready_timeout_s
        self.ports = {size: free_port() for size in sizes}
        self.worker: subprocess.Popen[bytes] | None = None
        self.groups: dict[int, list[GatewayProcess]] = {size: [] for size in sizes}
        self._stack = contextlib.ExitStack()

    @property
    def worker_pid(self) -> int:
        assert self.worker is not None
        return self.worker.pid

    @property
    def gateways(self) -> list[GatewayProcess]:
        return [gateway for group in self.groups.values() for gateway in group]

    def url(self, size: int) -> str:
        return f"http://127.0.0.1:{self.ports[size]}"

    def pids(self, size: int) -> list[int]:
        return [gateway.pid for gateway in self.groups[size]]

    def registry(self, keys: Path, worker_port: int) -> Path:
        import yaml

        name = str(self.entry["name"])
        worker = {"worker_id": f"{name}@bench", "model": name, "endpoint": f"tcp://127.0.0.1:{worker_port}",
                  "public_key_file": str(keys / "worker.key")}  # fmt: skip
        server = {"reuse_port": True, "shutdown_grace_s": 2,
                  "cluster": {"backend": "static", "secret_key_file": str(keys / "gateway.key_secret"),
                              "workers": [worker]}}  # fmt: skip
        entry = {key: value for key, value in self.entry.items() if key != "gpus"}  # the worker's flag
        path = self.folder / "gateway-processes.yaml"
        path.write_text(yaml.safe_dump({"server": server, "models": [{**entry, "remote": True}]}))
        return path

    def __enter__(self) -> GatewayProcesses:
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def _start(self) -> None:
        keys = self.folder / "keys"
        shutil.rmtree(keys, ignore_errors=True)  # an earlier run's: `gateway keys` never overwrites
        subprocess.run(
            [sys.executable, "-m", "gateway", "keys", str(keys), "--name", "gateway", "--name", "worker"],
            check=True, cwd=REPO_ROOT, capture_output=True,
        )  # fmt: skip
        worker_port = free_port()
        config = self.registry(keys, worker_port)
        name = str(self.entry["name"])
        command = [
            sys.executable, "-m", "model_worker", "--listen", f"tcp://127.0.0.1:{worker_port}",
            "--config", str(config), "--model", name, "--worker-id", f"{name}@bench",
            "--curve-secret-key", str(keys / "worker.key_secret"),
            "--gateway-public-key", str(keys / "gateway.key"),
        ]  # fmt: skip
        if self.entry.get("gpus"):
            command += ["--gpus", ",".join(str(gpu) for gpu in self.entry["gpus"])]
        log = self._stack.enter_context(open(self.folder / "gateway-processes-worker.log", "wb"))
        self.worker = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        self._stack.callback(self._stop_worker)
        for size, port in self.ports.items():
            for index in range(size):
                gateway = GatewayProcess(
                    config, env=self.env, wait_ready=False, port=port,
                    log_path=self.folder / f"gateway-processes-{size}-{index}.log",
                )  # fmt: skip
                self.groups[size].append(self._stack.enter_context(gateway))
        self._wait_until_ready()

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        waiting = list(self.gateways)
        while waiting:
            assert self.worker is not None
            if self.worker.poll() is not None:
                raise RuntimeError(f"the listening worker exited with {self.worker.returncode}")
            for gateway in list(waiting):
                if gateway.process is not None and gateway.process.poll() is not None:
                    raise RuntimeError(
                        f"a gateway exited with {gateway.process.returncode}:\n{gateway.log()}"
                    )
                if all(line in gateway.log_path.read_text(errors="replace") for line in READY_LINES):
                    waiting.remove(gateway)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(waiting)} gateways not ready in {self.ready_timeout_s:g}s")
            time.sleep(0.2)

    def _stop_worker(self) -> None:
        if self.worker is not None and self.worker.poll() is None:
            self.worker.terminate()
            try:
                self.worker.wait(60)
            except subprocess.TimeoutExpired:
                self.worker.kill()
                self.worker.wait()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._stack.close()  # the gateways first (entered last), then the worker
