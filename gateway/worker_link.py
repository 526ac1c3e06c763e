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
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from gateway.config import ConfigError, RemoteWorkersConfig
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


def check_remote_keys(remote: RemoteWorkersConfig) -> tuple[bytes, bytes, list[Path]]:
    """The gateway's CURVE key pair and the authorized worker keys; ConfigError if unusable."""
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(str(remote.secret_key_file))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{remote.secret_key_file}: cannot read the CURVE secret key: {exc}") from None
    if secret is None:
        raise ConfigError(f"{remote.secret_key_file}: not a CURVE secret key file (make one: gateway keys)")
    authorized = sorted(Path(remote.authorized_keys_dir).glob("*.key"))
    if not authorized:
        raise ConfigError(
            f"{remote.authorized_keys_dir}: no authorized worker keys (*.key); refusing to listen on tcp"
        )
    return public, secret, authorized


# (worker id, message, whether it came over the remote tcp listener)
LifecycleCallback = Callable[[str, wire.Message, bool], None]


class WorkerLink:
    def __init__(
        self, endpoint: str, on_lifecycle: LifecycleCallback, remote: RemoteWorkersConfig | None = None
    ) -> None:
        self.endpoint = endpoint
        self.remote = remote
        self._on_lifecycle = on_lifecycle
        self._ctx = zmq.asyncio.Context()
        self._sock = self._router_socket()
        self._remote_sock: zmq.asyncio.Socket | None = None
        self._authenticator: Any = None
        # Which socket reaches each worker: replies go back the way the worker came in.
        self._socket_of: dict[str, zmq.asyncio.Socket] = {}
        self._streams: dict[str, RequestStream] = {}
        # When each worker last sent anything: any frame proves it alive, not only heartbeats.
        self.last_seen: dict[str, float] = {}
        # When each worker last made progress (a Step frame) or was handed a job: wedge detection.
        self.last_progress: dict[str, float] = {}
        self._readers: list[asyncio.Task[None]] = []
        self._dispatch: dict[type[wire.Message], Callable[[str, Any], None]] = {
            wire.Step: self._on_step,
            wire.Accepted: self._on_reply,
            wire.Rejected: self._on_reply,
            wire.Tokens: self._on_reply,
        }

    def _router_socket(self) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_SOCKET_MESSAGE_BYTES)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        # Fail loudly instead of silently dropping frames addressed to a worker that is gone.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    async def start(self) -> None:
        self._sock.bind(self.endpoint)
        self._readers = [asyncio.create_task(self._read_forever(self._sock, False), name="worker-link-ipc")]
        if self.remote is not None:
            self._remote_sock = self._start_remote_listener(self.remote)
            reader = asyncio.create_task(self._read_forever(self._remote_sock, True), name="worker-link-tcp")
            self._readers.append(reader)

    def _start_remote_listener(self, remote: RemoteWorkersConfig) -> zmq.asyncio.Socket:
        """tcp with CURVE: traffic is encrypted and only workers whose public key is authorized get in."""
        from zmq.auth.asyncio import AsyncioAuthenticator

        public, secret, authorized = check_remote_keys(remote)
        self._authenticator = AsyncioAuthenticator(self._ctx)
        self._authenticator.start()
        # ZAP checks each connecting worker's key against the files in this folder.
        self._authenticator.configure_curve(domain="*", location=str(remote.authorized_keys_dir))
        sock = self._router_socket()
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        sock.bind(remote.bind)
        logger.info("remote workers: listening on %s (%d authorized key(s))", remote.bind, len(authorized))
        return sock

    async def close(self) -> None:
        for reader in self._readers:
            reader.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        self._sock.close()
        if self._remote_sock is not None:
            self._remote_sock.close()
        if self._authenticator is not None:
            self._authenticator.stop()
        self._ctx.term()

    # ---- sending -----------------------------------------------------------------------------

    def send(self, worker_id: str, message: wire.Message) -> bool:
        if isinstance(message, wire.Generate):
            self.last_progress[worker_id] = time.monotonic()
        try:
            sock = self._socket_of.get(worker_id, self._sock)
            sock.send_multipart([worker_id.encode(), wire.encode(message)], zmq.NOBLOCK)
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

    async def _read_forever(self, sock: zmq.asyncio.Socket, remote: bool) -> None:
        while True:
            try:
                frames = await sock.recv_multipart()
            except zmq.ZMQError as exc:
                logger.error("worker socket receive failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if len(frames) != 2:
                logger.warning("dropped a message of %d frames", len(frames))
                continue
            worker_id = frames[0].decode(errors="replace")
            self.last_seen[worker_id] = time.monotonic()
            self._socket_of[worker_id] = sock
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
                    self._on_lifecycle(worker_id, message, remote)
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
