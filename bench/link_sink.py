"""Our engine in-process with each step's Step frame sent several ways: what the worker's link costs.

Runs in the benchmark process (bench/bench_engines.py, `--link-paths`), beside a sink process of
its own. Owns `FrameSink` (a process with a ROUTER socket that takes every frame and drops it,
standing in for the gateway) and the senders that the in-process rounds call after each step:

- `link`: the worker's own LinkThread encodes and sends the frame on its thread, as a worker does;
  the engine thread only hands the message over;
- `link-beside`: the same, with the link thread meant to run on the engine thread's own core (the
  caller pins it there, with `beside_threads()`): a GIL hand-over then needs no other core to wake;
- `direct`: the engine thread encodes and sends the frame itself, on a socket of its own: what the
  frame costs with no second thread taking the GIL (a worker never does this);
- `take` and `take-send`: floors for any second thread. A bare thread blocks on a queue for each
  message and drops it (`take`: one wake-up and one GIL hand-over a frame, the least a thread that
  takes frames can cost), or encodes and sends it with pyzmq as well (`take-send`: the least a
  thread that sends them can cost). Against `link` they say what the worker's link thread adds on
  top of what any sending thread costs.

Against the in-process rounds without any frame, in one run, they say what the hand-over between the
two threads costs the engine's steps.
"""

from __future__ import annotations

import multiprocessing
import queue
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import zmq

from model_worker.link_thread import LinkThread
from wire import messages as wire

SENDER_MODES = ("link", "link-beside", "direct")
FLOOR_MODES = ("take", "take-send")
MODES = (*SENDER_MODES, *FLOOR_MODES)
END = b"end "  # the closer's frame: how many senders say goodbye


def _drain(endpoint: str) -> None:
    """Take frames until every sender has said goodbye (an empty frame, after its last one: each
    connection keeps its order, connections do not), then answer the closer with the count."""
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.bind(endpoint)
    taken = goodbyes = 0
    senders: int | None = None
    closer = b""
    while senders is None or goodbyes < senders:
        identity, frame = sock.recv_multipart()
        if frame == b"":
            goodbyes += 1
        elif frame.startswith(END):
            senders, closer = int(frame[len(END) :]), identity
        else:
            taken += 1
    sock.send_multipart([closer, str(taken).encode()])
    sock.close(linger=1000)


class FrameSink:
    """A process that takes and drops every frame sent to `endpoint`, and the senders to it."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="frame-sink-")
        self.endpoint = f"ipc://{self._dir.name}/sink"
        self._process = multiprocessing.get_context("spawn").Process(
            target=_drain, args=(self.endpoint,), daemon=True
        )
        self._context = zmq.Context()
        self._links: list[LinkThread] = []
        self._beside: list[int] = []  # native ids of the link threads of `link-beside`
        self._floors: list[tuple[queue.SimpleQueue[Any], threading.Thread]] = []
        self._sockets: list[zmq.Socket] = []
        self.frames_taken: int | None = None  # how many frames the sink took, once it has ended

    def __enter__(self) -> FrameSink:
        self._process.start()
        return self

    def _socket(self, identity: str) -> zmq.Socket:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.connect(self.endpoint)
        self._sockets.append(sock)
        return sock

    def sender(self, mode: str) -> Callable[[list[Any]], None]:
        """A callable for a step's outputs (wire JobOutputs) that sends them in one Step frame."""
        sock = self._socket(f"{mode}-{len(self._sockets)}")
        if mode == "direct":
            return lambda outputs: sock.send(wire.encode(wire.Step(outputs)))
        if mode in FLOOR_MODES:
            return self._floor_sender(sock, send=mode == "take-send")
        link = LinkThread(sock, patience_s=60.0, forward=frozenset())
        link.start()
        self._links.append(link)
        if mode == "link-beside":
            self._beside.append(link.link_thread_id)
        return lambda outputs: link.send(wire.Step(outputs))

    def beside_threads(self) -> list[int]:
        """The link threads the caller pins to the engine thread's core (mode `link-beside`)."""
        return list(self._beside)

    def _floor_sender(self, sock: zmq.Socket, send: bool) -> Callable[[list[Any]], None]:
        handed: queue.SimpleQueue[Any] = queue.SimpleQueue()

        def take() -> None:  # the socket is this thread's until it ends
            while (message := handed.get()) is not None:
                if send:
                    sock.send(wire.encode(message))

        thread = threading.Thread(target=take, name="bench-floor", daemon=True)
        thread.start()
        self._floors.append((handed, thread))
        return lambda outputs: handed.put(wire.Step(outputs))

    def pids(self) -> list[int]:
        return [self._process.pid] if self._process.pid is not None else []

    def __exit__(self, *exc: object) -> None:
        for link in self._links:
            link.close(flush_s=2.0)  # its socket is this thread's again
        for handed, thread in self._floors:
            handed.put(None)
            thread.join(5.0)
        for sock in self._sockets:
            sock.send(b"")
        closer = self._socket("closer")
        closer.send(END + str(len(self._sockets) - 1).encode())
        if closer.poll(10_000):
            self.frames_taken = int(closer.recv())
        for sock in self._sockets:
            sock.close(linger=1000)
        self._context.term()
        self._process.join(5.0)
        if self._process.is_alive():
            self._process.kill()
        self._dir.cleanup()
