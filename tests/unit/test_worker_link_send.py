"""The gateway's link says when a frame cannot reach its worker, instead of losing it quietly.

Runs in the pytest process: a real WorkerLink (its ROUTER socket over ipc) on an asyncio loop, and
a real DEALER standing in for a connected worker.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import zmq

from gateway.errors import WorkerFailed
from gateway.link.worker_link import WorkerLink
from tests.harness import async_wait_until
from wire import messages as wire


def test_send_frame_is_false_for_a_worker_that_is_not_connected(tmp_path: Path) -> None:
    async def scenario() -> tuple[bool, bool, bytes]:
        link = WorkerLink(f"ipc://{tmp_path}/link", on_lifecycle=lambda *_: None)
        await link.start()
        worker = zmq.Context.instance().socket(zmq.DEALER)
        worker.setsockopt(zmq.IDENTITY, b"present")
        worker.setsockopt(zmq.LINGER, 0)
        worker.connect(link.endpoint)
        try:
            link.expect_local("present")
            link.expect_local("absent")
            # The connection is made in the background: the worker speaks first, as real ones do,
            # and the link's reader (which this loop runs) notes when its frame arrived.
            registered = link.last_seen["present"]
            worker.send(b"hello")
            deadline = asyncio.get_running_loop().time() + 10
            while link.last_seen["present"] == registered and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            absent = link.send_frame("absent", b"frame")
            present = link.send_frame("present", b"frame")
            received = worker.recv() if worker.poll(10_000) else b""
            return absent, present, received
        finally:
            worker.close()
            await link.close()

    absent, present, received = asyncio.run(scenario())
    assert absent is False  # EHOSTUNREACH: ROUTER_MANDATORY refuses a frame with nowhere to go
    assert present is True and received == b"frame"


def test_every_frame_is_read_when_sends_and_bursts_interleave(tmp_path: Path) -> None:
    """The local socket is read from a reader on its descriptor, which signals only changes of
    state; a send from the gateway may take that signal. Bursts longer than one drain, with the
    gateway sending between them, must all be read, none left waiting for a later frame."""
    received: list[object] = []

    async def scenario() -> None:
        link = WorkerLink(
            f"ipc://{tmp_path}/link", on_lifecycle=lambda _id, message, _key: received.append(message)
        )
        await link.start()
        worker = zmq.Context.instance().socket(zmq.DEALER)
        worker.setsockopt(zmq.IDENTITY, b"w")
        worker.setsockopt(zmq.LINGER, 0)
        worker.connect(link.endpoint)
        link.expect_local("w")
        frame = wire.encode(wire.Ping())
        try:
            loop = asyncio.get_running_loop()
            expected = 0
            for burst in range(20):
                # The first burst (one frame) connects the worker, so the gateway can answer after.
                for sent in range(burst * 7 or 1):  # up to 133 frames, past one drain's 64
                    worker.send(frame)
                    if burst % 2 and sent % 10 == 0:  # every other burst, the gateway sends too
                        assert link.send_frame("w", b"x")
                expected += burst * 7 or 1
                deadline = loop.time() + 10
                while len(received) < expected and loop.time() < deadline:
                    await asyncio.sleep(0.001)
                assert len(received) == expected, f"burst {burst}: {len(received)} of {expected} read"
        finally:
            worker.close()
            await link.close()

    asyncio.run(scenario())


def test_a_worker_known_failed_is_not_warned_about_per_send(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Once the link has announced a worker's failure, the Cancels its requests then send cannot
    arrive: each is a DEBUG line, not a WARNING. A Hello (a new process under the id) makes a
    frame that cannot reach it worth a warning again."""

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    async def scenario() -> None:
        link = WorkerLink(f"ipc://{tmp_path}/link", on_lifecycle=lambda *_: None)
        await link.start()
        link.expect_local("w")
        try:
            assert not link.send_frame("w", b"x")  # not connected, nothing known: a warning
            assert len(warnings()) == 1
            link.fail_worker("w", WorkerFailed("the worker for model 'm' failed: killed by signal 9"))
            assert not any(link.send_frame("w", wire.encode(wire.Cancel(f"r{i}"))) for i in range(4))
            assert len(warnings()) == 1
            assert sum("could not send a frame to worker w" in r.getMessage() for r in caplog.records) == 5
            worker = zmq.Context.instance().socket(zmq.DEALER)
            worker.setsockopt(zmq.IDENTITY, b"w")
            worker.setsockopt(zmq.LINGER, 0)
            worker.connect(link.endpoint)
            registered = link.last_seen["w"]
            worker.send(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, "w", 1)))
            await async_wait_until(lambda: link.last_seen["w"] != registered, "the Hello to be read")
            worker.close()  # the new process is gone too, and nothing has announced it yet
            await async_wait_until(lambda: not link.send_frame("w", b"x"), "the worker to be unreachable")
            assert len(warnings()) == 2
        finally:
            await link.close()

    with caplog.at_level(logging.DEBUG, logger="gateway.link.worker_link"):
        asyncio.run(scenario())
