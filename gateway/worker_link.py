"""The gateway's end of the ZeroMQ link: one ROUTER socket, one stream per in-flight request.

Runs in the gateway process, on its asyncio loop. Owns the socket (bound on ipc:// in a private
0700 directory), the reader task that decodes each worker frame once and fans a Step out to the
per-request queues, and the table of open streams. Lifecycle frames (Hello, Status, Ready,
Heartbeat, Fatal) go to the supervisor through a callback.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from model_worker import protocol as wire

logger = logging.getLogger(__name__)

# A client that stops reading must not grow our memory without bound: past this many undelivered
# chunks the stream is dropped and its job cancelled.
MAX_PENDING_CHUNKS = 8192


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """Put on a stream's queue when it ends for a reason other than the engine finishing."""

    status: int
    code: str
    message: str


KEEPALIVE = object()  # queue item: nothing new, send an SSE comment


@dataclass(eq=False)
class RequestStream:
    rid: str
    worker_id: str
    accepted: asyncio.Future[wire.Accepted | wire.Rejected | wire.Tokens | StreamEnd]
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    finished: bool = False
    last_activity: float = field(default_factory=time.monotonic)
    # When the HTTP side last took an item: a stream whose items pile up unread is a stalled client.
    last_consumed: float = field(default_factory=time.monotonic)
    # Called when the gateway gives up on the client (stalled reader): frees the slot at once.
    on_abandon: Callable[[], Any] | None = None

    def feed(self, item: Any) -> bool:
        if self.queue.qsize() >= MAX_PENDING_CHUNKS:
            return False
        self.queue.put_nowait(item)
        self.last_activity = time.monotonic()
        return True


LifecycleCallback = Callable[[str, wire.Message], None]


class WorkerLink:
    def __init__(self, endpoint: str, on_lifecycle: LifecycleCallback) -> None:
        self.endpoint = endpoint
        self._on_lifecycle = on_lifecycle
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_SOCKET_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
        # Fail loudly instead of silently dropping frames addressed to a worker that is gone.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._streams: dict[str, RequestStream] = {}
        # When each worker last sent anything: any frame proves it alive, not only heartbeats.
        self.last_seen: dict[str, float] = {}
        # When each worker last made progress (a Step frame) or was handed a job: wedge detection.
        self.last_progress: dict[str, float] = {}
        self._reader: asyncio.Task[None] | None = None
        self._dispatch: dict[type[wire.Message], Callable[[str, Any], None]] = {
            wire.Step: self._on_step,
            wire.Accepted: self._on_reply,
            wire.Rejected: self._on_reply,
            wire.Tokens: self._on_reply,
        }

    async def start(self) -> None:
        self._sock.bind(self.endpoint)
        self._reader = asyncio.create_task(self._read_forever(), name="worker-link-reader")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
        self._sock.close()
        self._ctx.term()

    # ---- sending -----------------------------------------------------------------------------

    def send(self, worker_id: str, message: wire.Message) -> bool:
        if isinstance(message, wire.Generate):
            self.last_progress[worker_id] = time.monotonic()
        try:
            self._sock.send_multipart([worker_id.encode(), wire.encode(message)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH (worker gone) or EAGAIN (worker not reading)
            logger.warning("could not send %s to worker %s: %s", type(message).__name__, worker_id, exc)
            return False

    # ---- streams -----------------------------------------------------------------------------

    def open_stream(self, rid: str, worker_id: str) -> RequestStream:
        stream = RequestStream(rid, worker_id, asyncio.get_running_loop().create_future())
        self._streams[rid] = stream
        return stream

    def close_stream(self, rid: str) -> None:
        self._streams.pop(rid, None)

    def streams_of(self, worker_id: str) -> list[RequestStream]:
        return [s for s in self._streams.values() if s.worker_id == worker_id]

    def open_streams(self) -> list[RequestStream]:
        return list(self._streams.values())

    def end_stream(self, stream: RequestStream, end: StreamEnd) -> None:
        """End a stream from the gateway's side (worker died, deadline, overflow)."""
        if not stream.accepted.done():
            stream.accepted.set_result(end)
        stream.queue.put_nowait(end)
        stream.finished = True

    # ---- receiving ---------------------------------------------------------------------------

    async def _read_forever(self) -> None:
        while True:
            try:
                frames = await self._sock.recv_multipart()
            except zmq.ZMQError as exc:
                logger.error("worker socket receive failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if len(frames) != 2:
                logger.warning("dropped a message of %d frames", len(frames))
                continue
            worker_id = frames[0].decode(errors="replace")
            self.last_seen[worker_id] = time.monotonic()
            try:
                message = wire.decode(frames[1])
            except wire.ProtocolError as exc:
                logger.warning("dropped a bad frame from worker %s: %s", worker_id, exc)
                continue
            handler = self._dispatch.get(type(message))
            try:
                if handler is not None:
                    handler(worker_id, message)
                else:
                    self._on_lifecycle(worker_id, message)
            except Exception:  # one bad message must not stop the reader for every request
                logger.exception("error handling %s from worker %s", type(message).__name__, worker_id)

    def _on_reply(self, worker_id: str, message: wire.Accepted | wire.Rejected | wire.Tokens) -> None:
        stream = self._streams.get(message.rid)
        if stream is not None and not stream.accepted.done():
            stream.accepted.set_result(message)

    def _on_step(self, worker_id: str, message: wire.Step) -> None:
        self.last_progress[worker_id] = time.monotonic()
        for output in message.outputs:
            stream = self._streams.get(output.rid)
            if stream is None or stream.finished:
                continue  # the client left; the Cancel is already on its way
            if output.finish_reason is not None:
                stream.finished = True
            if not stream.feed(output):
                logger.warning("request %s: client is not reading; dropping its stream", output.rid)
                self.send(worker_id, wire.Cancel(output.rid))
                stream.finished = True
                stream.queue.put_nowait(
                    StreamEnd(503, "slow_reader", "the client did not read the stream in time")
                )
