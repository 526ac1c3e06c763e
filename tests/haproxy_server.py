"""A real HAProxy in front of several gateways, for the tests of gateways that are active-active.

Runs in the pytest process. `HAProxy` starts Debian's haproxy (.ci/run installs it) on a free
loopback port with a round-robin backend of the given servers, each health-checked on
`/health/ready` a few times a second. It names the server that answered in an `X-Gateway`
response header, logs the server of each request by its X-Request-ID (`servers_by_request()`:
also for a request that got no answer from any), and retries a connection that a dead server
refused on another one (requests already sent are never retried: a generation is not
idempotent). `server_states()` reads the servers' UP/DOWN from the admin socket. Without haproxy
the test is skipped, and fails under CI.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from tests.harness import free_port, wait_until

_CONFIG = """\
global
    stats socket {socket} mode 600 level admin
    maxconn 512
    log stdout format raw local0

defaults
    mode http
    log global
    # One line per request: the client's request id, the server that got it last (after any
    # redispatch), its status, and how the session ended (haproxy's two-letter termination state).
    log-format "rid=%[capture.req.hdr(0)] server=%s status=%ST end=%ts"
    timeout connect 1s
    timeout client 120s
    timeout server 120s
    timeout queue 30s
    retries 3
    option redispatch 1
    # A fresh server connection per request: a dead server then refuses the connection, and the
    # request goes to another one. (A request sent on a kept connection that turns out dead would
    # fail instead, and on a kept client connection haproxy closes that one without a word.)
    http-reuse never

frontend edge
    bind 127.0.0.1:{port}
    http-request capture req.hdr(X-Request-ID) len 64
    default_backend gateways

backend gateways
    balance roundrobin
    option httpchk
    http-check send meth GET uri /health/ready
    http-check expect status 200
    default-server inter 300ms fastinter 200ms downinter 300ms rise 1 fall 2
    http-response set-header X-Gateway %[srv_name]
{servers}
"""


class HAProxy:
    def __init__(self, folder: Path, servers: dict[str, str]) -> None:
        """`servers`: name -> host:port."""
        binary = shutil.which("haproxy")
        if binary is None:
            if os.environ.get("CI"):
                pytest.fail("haproxy is missing: .ci/run installs Debian's haproxy package")
            pytest.skip("haproxy is not installed (apt-get install haproxy)")
        self.binary = binary
        self.folder = folder
        self.port = free_port()
        self.socket_path = folder / "haproxy.sock"
        lines = "\n".join(f"    server {name} {address} check" for name, address in servers.items())
        self.config_path = folder / "haproxy.cfg"
        self.config_path.write_text(_CONFIG.format(socket=self.socket_path, port=self.port, servers=lines))
        self.log_path = folder / "haproxy.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        check = subprocess.run([self.binary, "-c", "-q", "-f", str(self.config_path)], capture_output=True)
        assert check.returncode == 0, check.stderr.decode(errors="replace")
        with open(self.log_path, "wb") as log:  # the child keeps its own copy of the fd
            self.process = subprocess.Popen(
                [self.binary, "-db", "-f", str(self.config_path)], stdout=log, stderr=subprocess.STDOUT
            )
        wait_until(self._answers, "haproxy's admin socket answers", retry_on=(OSError,))

    def _answers(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"haproxy exited with {self.process.returncode}: {self.log()}")
        return bool(self.command("show info"))

    def command(self, line: str) -> str:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5)
            sock.connect(str(self.socket_path))
            sock.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def server_states(self) -> dict[str, str]:
        """Each server's status as the health checks see it: UP, DOWN, ..."""
        rows = [line.split(",") for line in self.command("show stat").splitlines() if line]
        header = rows[0]
        header[0] = header[0].removeprefix("# ")
        name, kind, status = header.index("svname"), header.index("type"), header.index("status")
        return {row[name]: row[status] for row in rows[1:] if row[kind] == "2"}  # type 2: a server

    def wait_states(self, wanted: dict[str, str], what: str, timeout: float = 60.0) -> None:
        def reached() -> bool:
            states = self.server_states()
            return all(states.get(name, "").startswith(state) for name, state in wanted.items())

        wait_until(reached, what, timeout, context=self.server_states)

    def servers_by_request(self) -> dict[str, str]:
        """The server each request (by X-Request-ID) was sent to last, from the request log."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return dict(re.findall(r"^rid=(\S+) server=(\S+) ", "\n".join(lines), re.MULTILINE))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None
