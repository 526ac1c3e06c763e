"""A real etcd for the cluster tests, and a TCP relay that can cut one client off from it.

Runs in the pytest process. `EtcdServer` starts Debian's etcd (package etcd-server; .ci/run
installs it) on free loopback ports with a data folder under the test's temp dir, and can kill it
(SIGKILL, as a crash) and start it again on the same ports and data. `Relay` forwards one client's
connections to etcd and can cut them and refuse new ones: that client's host is cut off, while
every other client still reaches etcd.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
from pathlib import Path

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
        self.client_port = free_port()
        self.peer_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        args = [
            self.binary, "--name", "test", "--data-dir", str(self.folder / "data"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"test={peer}", "--initial-cluster-state", "new",
            "--logger", "zap", "--log-outputs", "stderr",
        ]  # fmt: skip
        log = (self.folder / "etcd.log").open("ab")
        self.process = subprocess.Popen(args, stdout=log, stderr=log)
        log.close()
        wait_until(self._healthy, "etcd to answer /health", context=self.log)

    def _healthy(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"etcd exited with {self.process.returncode}:\n{self.log()}")
        try:
            response = httpx.get(f"http://127.0.0.1:{self.client_port}/health", timeout=1)
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


class Relay:
    """127.0.0.1:port -> etcd, for one client; `cut()` drops its connections and refuses new ones."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._cut = False

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)
        if self._cut:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.transport.abort()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            self._writers -= {writer, up_writer}

    def cut(self) -> None:
        self._cut = True
        for writer in list(self._writers):
            writer.transport.abort()

    def mend(self) -> None:
        self._cut = False

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        # Every connection was aborted: its pipes end on their own.
        await asyncio.gather(*self._handlers, return_exceptions=True)
