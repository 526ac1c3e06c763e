"""A cap on the connections open on the remote workers' tcp listener (ZeroMQ, CURVE).

Runs in the gateway process, on its asyncio loop, beside the worker link. ZeroMQ accepts every
connection and offers no limit of its own; a connection that never completes its CURVE handshake is
dropped after `handshake_timeout_s`, but many at once would still take every descriptor. So this
watches the listener's monitor events, counts the open connections, and shuts down (does not close:
ZeroMQ owns the descriptor) each one accepted beyond `max_connections`. Refusals are logged
rate-limited.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.observability.logging_setup import RateLimitedLog

logger = logging.getLogger(__name__)


class ListenerCap:
    def __init__(self, sock: zmq.asyncio.Socket, limit: int) -> None:
        self.limit = limit
        self.port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.open: set[int] = set()  # descriptors of the open connections
        self.refused = 0
        self._monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._refusals = RateLimitedLog(logger, every_s=10.0)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="remote-listener-cap")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._monitor.close(0)

    async def _watch(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            descriptor = int(event["value"])
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.open.discard(descriptor)
            elif len(self.open) >= self.limit:
                self._shut(descriptor)
            else:
                self.open.add(descriptor)

    def _shut(self, descriptor: int) -> None:
        """End an accepted connection beyond the cap. Through a duplicate of its descriptor, and only
        if that still is a connection to this listener (the number could have been reused)."""
        try:
            duplicate = socket.socket(fileno=os.dup(descriptor))
        except OSError:
            return  # already gone
        try:
            if duplicate.getsockname()[1] == self.port:
                duplicate.shutdown(socket.SHUT_RDWR)
                self.refused += 1
                peer = duplicate.getpeername()[0] if duplicate.family != socket.AF_UNIX else "?"
                self._refusals.warning(
                    "remote-worker connection from %s refused: %d open", peer, len(self.open)
                )
        except OSError:
            pass
        finally:
            duplicate.close()  # only the duplicate: ZeroMQ closes its own descriptor
