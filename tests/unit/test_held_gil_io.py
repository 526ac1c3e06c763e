"""The link thread's sends and doorbell reads that keep the GIL: what they deliver and refuse.

Runs in the pytest process with a real DEALER and ROUTER over ipc and a real pipe; the calls go
through ctypes into the libzmq and libc of this process, as the worker's link thread makes them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from model_worker import held_gil_io
from model_worker.held_gil_io import HeldGilIO


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{tmp_path}/s")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"w")
    dealer.setsockopt(zmq.SNDHWM, 1)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"ipc://{tmp_path}/s")
    try:
        yield dealer, router
    finally:
        dealer.close(0)
        router.close(0)
        ctx.term()


def receive(router: zmq.Socket) -> list[bytes]:
    assert router.poll(10_000), "no frame arrived"
    return router.recv_multipart()


@pytest.fixture
def bell() -> Iterator[tuple[int, int]]:
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    yield read, write
    os.close(read)
    os.close(write)


def test_the_calls_are_found_with_pyzmq_as_installed() -> None:
    # Without them the link thread falls back to pyzmq's calls quietly: the wheel this project pins
    # must keep the faster path.
    assert held_gil_io.available()


def test_frames_sent_arrive_whole_and_in_order(
    pair: tuple[zmq.Socket, zmq.Socket], bell: tuple[int, int]
) -> None:
    dealer, router = pair
    io = HeldGilIO(dealer, bell[0])
    frames = [b"", b"\x00binary\xff" * 3, os.urandom(200_000)]
    for frame in frames:
        # Sends until ZeroMQ takes it: a connection still being made may refuse the first ones.
        while not io.send_nowait(frame):
            assert dealer.poll(10_000, zmq.POLLOUT), "the socket never had room"
    assert [receive(router) for _ in frames] == [[b"w", frame] for frame in frames]


def test_a_full_queue_refuses_the_frame_without_taking_it(
    pair: tuple[zmq.Socket, zmq.Socket], bell: tuple[int, int]
) -> None:
    dealer, router = pair
    io = HeldGilIO(dealer, bell[0])
    while not io.send_nowait(b"hello"):  # connected first: a refusal now means a full queue
        assert dealer.poll(10_000, zmq.POLLOUT), "the socket never had room"
    assert receive(router) == [b"w", b"hello"]
    sent = 0
    while sent < 100_000:  # the router reads nothing yet
        if io.send_nowait(str(sent).encode()):
            sent += 1
        elif not dealer.poll(200, zmq.POLLOUT):  # refused, and no room comes: the queue is full
            break
    assert 0 < sent < 100_000, "ZeroMQ's queue to the router never filled"
    received = []
    while router.poll(200):
        received.append(router.recv_multipart()[1])
    # Every frame it said it took arrived; the one it refused did not.
    assert received == [str(i).encode() for i in range(sent)]


def test_clearing_the_bell_empties_it_however_many_rings_wait(
    pair: tuple[zmq.Socket, zmq.Socket], bell: tuple[int, int]
) -> None:
    read, write = bell
    io = HeldGilIO(pair[0], read)
    io.clear_bell()  # an empty bell is no error
    os.write(write, b"\0" * 10_000)  # more than one read's worth
    io.clear_bell()
    with pytest.raises(BlockingIOError):
        os.read(read, 1)
