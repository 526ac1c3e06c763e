"""The gateway's link says when a frame cannot reach its worker, instead of losing it quietly.

Runs in the pytest process: a real WorkerLink (its ROUTER socket over ipc) on an asyncio loop, and
a real DEALER standing in for a connected worker.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import zmq

from gateway.link.worker_link import WorkerLink


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
