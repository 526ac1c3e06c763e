"""Notices when the gateway refuses this worker's CURVE key, so a rejected worker exits loudly.

Runs in a remote worker process, on the serve loop's thread. Owns a ZeroMQ monitor socket on the
worker's DEALER. Without it, a worker whose key is not authorized would load its model and then
send into the void forever, looking healthy to its orchestrator.
"""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import recv_monitor_message

_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class HandshakeWatch:
    def __init__(self, sock: zmq.Socket) -> None:
        self._monitor = sock.get_monitor_socket(_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)

    def refused(self, wait_s: float = 0.0) -> bool:
        """True once a handshake failed; waits up to wait_s for the first verdict."""
        deadline = time.monotonic() + wait_s
        while True:
            remaining_ms = max(int((deadline - time.monotonic()) * 1000), 0)
            if not self._monitor.poll(remaining_ms):
                return False
            event = recv_monitor_message(self._monitor)["event"]
            if event & _FAILED:
                return True
            if wait_s:  # a handshake succeeded: that is the verdict waited for
                return False

    def close(self) -> None:
        self._monitor.close(0)
