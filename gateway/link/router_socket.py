"""The options every ROUTER socket that the worker link binds is made with.

Runs in the gateway process, on its asyncio loop. Owns `configured`, shared by the link's local ipc
socket (gateway.link.worker_link) and the remote workers' tcp listener
(gateway.link.worker_identities), so both bound their frames and queues alike and neither drops a
frame quietly.
"""

from __future__ import annotations

from typing import Any, TypeVar

import zmq

from wire.codec import MAX_SOCKET_MESSAGE_BYTES

SocketT = TypeVar("SocketT", bound="zmq.Socket[Any]")


def configured(sock: SocketT) -> SocketT:
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_SOCKET_MESSAGE_BYTES)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    # Fail loudly instead of silently dropping frames addressed to a worker that is gone.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.LINGER, 0)
    return sock
