"""The HTTP listener's connections: capped when accepted, closed when the client closes, and the
file descriptors they need.

Runs in the gateway process; gateway.server installs it before Hypercorn starts. Owns:
- `ListenerSocket`, the listening socket Hypercorn serves. Its accept() drops, at once, any
  connection beyond `max_connections` in all or `max_connections_per_client` from one address, so a
  flood from one client (slowloris included: Hypercorn's keep-alive timer is also the deadline for a
  request's headers) cannot take every descriptor or every slot; it turns Nagle's algorithm off on
  every connection it keeps, so each streamed chunk leaves when it is written;
- `listen`, which binds it (with SO_REUSEPORT where several gateways share the port) and turns a
  failed bind into a `ListenError` that names the address, for the command line to print;
- `PromptCloseTCPServer`: Hypercorn keeps a connection whose client has closed until its keep-alive
  timer runs out (CLOSE-WAIT, one descriptor each); this closes it as soon as the client has;
- `raise_fd_limit`, and a rate-limited log for accept errors (a descriptor shortage would otherwise
  write one traceback per attempted accept).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
import struct
from collections import Counter
from typing import Any

from hypercorn.asyncio import run as hypercorn_run
from hypercorn.asyncio.tcp_server import TCPServer
from hypercorn.config import Config, Sockets

from gateway.observability.logging_setup import RateLimitedLog

logger = logging.getLogger(__name__)
_refusals = RateLimitedLog(logger, every_s=10.0)
# A connection refused for exceeding a cap is reset, not closed: no TIME_WAIT left on our side.
_RESET_AT_CLOSE = struct.pack("ii", 1, 0)
# Descriptors kept back from the connection cap: worker sockets, log files, the model cache.
FD_RESERVE = 256


class ConnectionStats:
    def __init__(self) -> None:
        self.open = 0
        self.refused = 0
        self.per_client: Counter[str] = Counter()


class TrackedSocket(socket.socket):
    """An accepted connection that gives its place back to the listener when it closes."""

    listener_stats: ConnectionStats | None = None
    client = ""

    def close(self) -> None:
        stats, self.listener_stats = self.listener_stats, None
        if stats is not None:
            stats.open -= 1
            stats.per_client[self.client] -= 1
            if stats.per_client[self.client] <= 0:
                del stats.per_client[self.client]
        super().close()


class ListenerSocket(socket.socket):
    """The listening socket; asyncio's accept loop calls accept(), which enforces the caps."""

    max_total = 0
    max_per_client = 0
    stats: ConnectionStats

    def accept(self) -> tuple[socket.socket, Any]:
        while True:
            fd, address = self._accept()  # type: ignore[attr-defined]  # BlockingIOError ends the round
            client = str(address[0])
            stats = self.stats
            if stats.open >= self.max_total or stats.per_client[client] >= self.max_per_client:
                refused = socket.socket(self.family, self.type, self.proto, fileno=fd)
                refused.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_AT_CLOSE)
                refused.close()
                stats.refused += 1
                cap = "in all" if stats.open >= self.max_total else "from one client"
                _refusals.warning("connection from %s refused: too many open connections %s", client, cap)
                continue
            connection = TrackedSocket(self.family, self.type, self.proto, fileno=fd)
            connection.setblocking(False)
            # asyncio sets this only on sockets whose proto is IPPROTO_TCP, and ours is 0. Without
            # it, a stream's next chunk waits behind the client's delayed ACK of the last (up to
            # 40 ms on Linux) whenever the connection is kept alive between requests.
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection.listener_stats, connection.client = stats, client
            stats.open += 1
            stats.per_client[client] += 1
            return connection, address


class ListenError(RuntimeError):
    """The gateway cannot listen where it was told to (a port in use, an address not on this host)."""


def listen(
    host: str, port: int, max_total: int, max_per_client: int, reuse_port: bool = False
) -> ListenerSocket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = ListenerSocket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        hint = ""
        if exc.errno == errno.EADDRINUSE:
            hint = (
                " (another process listens there; gateways meant to share a port must all set "
                "server.reuse_port)"
            )
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None
    sock.setblocking(False)
    sock.max_total, sock.max_per_client, sock.stats = max_total, max_per_client, ConnectionStats()
    return sock


class CappedConfig(Config):
    """Hypercorn's configuration, serving our listening sockets instead of binding its own."""

    listeners: list[ListenerSocket] = []

    def create_sockets(self) -> Sockets:
        assert self.listeners
        return Sockets(secure_sockets=[], insecure_sockets=list(self.listeners), quic_sockets=[])


class PromptCloseTCPServer(TCPServer):
    async def _read_data(self) -> None:
        await super()._read_data()  # returns once the client has closed (or a read failed)
        # Hypercorn would now wait for its keep-alive timer before closing the socket.
        await self.idle_task.stop()


def install_prompt_close() -> None:
    """Hypercorn's connection callback uses this module name for the server class it builds."""
    hypercorn_run.TCPServer = PromptCloseTCPServer  # type: ignore[misc]


def raise_fd_limit() -> int:
    """Raise the soft descriptor limit to the hard one (the usual 1,024 is far too few for a
    server); returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            logger.warning("could not raise the open-file limit above %d", soft)
    return soft


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio logs a traceback per failed accept (descriptor shortage): log them rate-limited."""
    default = loop.get_exception_handler()

    def handle(event_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if message.startswith("socket.accept() out of system resource"):
            _refusals.log(logging.ERROR, "accepting a connection failed: %s", context.get("exception"))
            return
        if default is not None:
            default(event_loop, context)
        else:
            event_loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
