"""A full send queue never loses a frame: the worker waits for the gateway, or fails loudly.

Runs in the pytest process with real ZeroMQ sockets over ipc: a DEALER (the worker's side) with a
tiny high-water mark, and a ROUTER (the gateway's side) that reads only when the test says so.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from model_worker.frame_sender import FrameSender, PeerUnresponsive
from tests.harness import wait_until


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, 1)
    router.setsockopt(zmq.RCVBUF, 4096)
    endpoint = f"ipc://{tmp_path}/s"
    router.bind(endpoint)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.SNDHWM, 1)
    dealer.setsockopt(zmq.SNDBUF, 4096)
    dealer.setsockopt(zmq.IDENTITY, b"w")
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        yield dealer, router
    finally:
        dealer.close(0)
        router.close(0)
        ctx.term()


def fill(sender: FrameSender) -> int:
    """Send until the queue stays full (ZeroMQ's I/O thread keeps moving frames into the kernel's
    buffers for a moment); the number of frames that fitted."""
    sent = 0
    frame = b"x" * 65536
    poller = zmq.Poller()
    poller.register(sender.sock, zmq.POLLOUT)
    while poller.poll(300):
        try:
            sender.sock.send(frame, zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            continue
    return sent


def test_a_full_queue_waits_for_the_reader_and_loses_nothing(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    dealer, router = pair
    sender = FrameSender(dealer, patience_s=30.0)
    queued = fill(sender)
    received: list[bytes] = []

    def read_all() -> None:
        while len(received) < queued + 1:
            _, frame = router.recv_multipart()
            received.append(frame)

    done = threading.Event()
    sending = threading.Thread(target=lambda: (sender.send(b"the end of a job"), done.set()))
    sending.start()
    wait_until(lambda: sender.waits == 1, "the sender finds the queue full and waits")
    assert not done.is_set()  # nothing was dropped: it is still waiting
    reader = threading.Thread(target=read_all)
    reader.start()
    sending.join(10)
    reader.join(10)
    assert done.is_set() and received[-1] == b"the end of a job" and len(received) == queued + 1


def test_a_reader_that_never_reads_fails_the_sender(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    dealer, _ = pair
    sender = FrameSender(dealer, patience_s=0.3)
    fill(sender)
    with pytest.raises(PeerUnresponsive, match="took no frame"):
        sender.send(b"the end of a job")
