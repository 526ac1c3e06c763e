"""Sending frames to the gateway without ever dropping one.

Runs in the worker process, on the serve loop's thread. Owns the rule for a full send queue: a
Step frame can carry a job's end, and a dropped one would leave its request hanging until its
deadline. So a frame that does not fit waits (backpressure: the engine pauses while the gateway
catches up); if the gateway reads nothing for `patience_s`, it is gone or wedged, and the worker
fails loudly (PeerUnresponsive is fatal), so that the gateway's liveness checks end its requests
with an error instead of a silent hang.
"""

from __future__ import annotations

import logging
import time

import zmq

logger = logging.getLogger(__name__)


class PeerUnresponsive(RuntimeError):
    """The gateway has not taken a frame for the whole patience: nothing more can be sent."""


class FrameSender:
    def __init__(self, sock: zmq.Socket, patience_s: float) -> None:
        self.sock = sock
        self.patience_s = patience_s
        self.waits = 0  # how often the queue was full (each a pause, never a loss)

    def send_last(self, frame: bytes) -> None:
        """A frame sent on the way out (Fatal, goodbye): best effort, since the process's exit is
        itself seen by the gateway; waiting here would only delay that."""
        try:
            self.sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("send queue to the gateway is full; the last frame is not sent")

    def send(self, frame: bytes) -> None:
        try:
            self.sock.send(frame, zmq.NOBLOCK)
            return
        except zmq.Again:
            pass
        self.waits += 1
        if self.waits == 1 or self.waits % 100 == 0:
            logger.warning("send queue to the gateway is full; waiting for it (%d times so far)", self.waits)
        deadline = time.monotonic() + self.patience_s
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLOUT)
        while (left := deadline - time.monotonic()) > 0:
            if poller.poll(int(left * 1000) + 1):
                try:
                    self.sock.send(frame, zmq.NOBLOCK)
                    return
                except zmq.Again:  # another writer took the room first; wait again
                    continue
        raise PeerUnresponsive(f"the gateway took no frame for {self.patience_s:g}s")
