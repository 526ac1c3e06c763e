"""The gateway's end of the ZeroMQ link: one ROUTER socket per listener, frames in and out.

Runs in the gateway process, on its asyncio loop. Owns the sockets (ipc:// in a private 0700
directory; optionally tcp:// with CURVE for remote workers, and in cluster mode the socket that
connects out to listening workers, gateway.link.worker_dialer), the reader tasks that decode each
worker frame once, and the tables that route a frame to whoever waits for it: engine jobs (each
the `JobReceiver` of one choice of one request) and one-shot exchanges (tokenize, detokenize, embed).
Lifecycle frames (Hello, Status, Ready, Heartbeat, Fatal) go to the supervisor through a callback.
The link never ends a request itself: it hands each event to the request's owner.

The local (ipc) socket, which carries every token of every local worker, is read without
pyzmq's asyncio layer: a reader callback on the socket's file descriptor takes every frame that is
waiting and dispatches it in the same turn of the loop (no future, no task wake-up per frame).
The descriptor only signals a change of state, and a send may consume that signal, so after each
send on that socket the callback is scheduled once more (pyzmq's asyncio socket does the same).

Which worker may speak over which socket is decided in the link's base class, `WorkerIdentities`
(gateway.link.worker_identities: the identity tables, the remote workers' listener and keys, the
dialled workers), which every reader asks before it decodes a frame. A base class, not an object the
link holds, so that the check every frame (every token) passes is one method call on the link, with
no other object in between. A frame about a job counts only from the worker that holds the job.
Every refusal is logged (rate-limited) with the key's name.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import zmq
import zmq.asyncio

from gateway.cluster.backends import identity
from gateway.cluster.settings import ClusterConfig
from gateway.config.server_config import RemoteWorkersConfig
from gateway.errors import APIError, InvalidRequest
from gateway.link.listener_cap import ListenerCap
from gateway.link.remote_keys import WorkerKey
from gateway.link.router_socket import configured
from gateway.link.worker_dialer import WorkerDialer, load_cluster_keys
from gateway.link.worker_identities import WorkerIdentities
from wire import messages as wire
from wire.codec import ENCODE_ERRORS, ProtocolError
from wire.results import JobOutput

logger = logging.getLogger(__name__)

# Frames the local socket's reader takes in one turn of the loop before it lets other callbacks
# (the streams it just fed) run; it comes back for the rest in the next turn.
_DRAIN_BATCH = 64
# Plain ints: an int & zmq.POLLIN (an IntFlag) goes through enum.Flag.__and__ in Python.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


class JobReceiver(Protocol):
    """The receiving end of one engine job (a choice of a request, in gateway.serving)."""

    rid: str
    worker_id: str | None

    def on_reply(self, reply: wire.Accepted | wire.Rejected) -> None: ...

    def on_output(self, output: JobOutput) -> None: ...

    def on_aborted(self, message: wire.JobsAborted) -> None: ...

    def on_worker_failed(self, error: APIError) -> None: ...


@dataclass(eq=False)
class _Exchange:
    worker_id: str
    reply: asyncio.Future[wire.Tokens | wire.Embeddings | wire.Rejected]


# (worker id, message, the CURVE key of a remote worker's frame, or None for the local socket)
LifecycleCallback = Callable[[str, wire.Message, "WorkerKey | None"], None]


class WorkerLink(WorkerIdentities):
    def __init__(
        self,
        endpoint: str,
        on_lifecycle: LifecycleCallback,
        remote: RemoteWorkersConfig | None = None,
        cluster: ClusterConfig | None = None,
    ) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.remote = remote
        self.cluster = cluster
        self._on_lifecycle = on_lifecycle
        self._ctx = zmq.asyncio.Context()
        # Plain (not asyncio) socket: read by _drain_local from a reader on its descriptor.
        self._sock: zmq.Socket[bytes] = configured(zmq.Socket(self._ctx, zmq.ROUTER))
        self._drain_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._remote_sock: zmq.asyncio.Socket | None = None
        self._remote_cap: ListenerCap | None = None
        self._jobs: dict[str, JobReceiver] = {}
        self._exchanges: dict[str, _Exchange] = {}
        # For the supervisor's wedge watchdog, beside what heartbeats report: when each worker id
        # last sent a Step frame, and when it was last handed a job.
        self.last_step_frame: dict[str, float] = {}
        self.last_job_sent: dict[str, float] = {}
        # Workers whose failure fail_worker announced, until they say Hello again (or, remote, are
        # back from lost): the Cancel each of their requests then sends cannot arrive, and a warning
        # per request would bury the one line that says why (the supervisor's).
        self._failed: set[str] = set()
        self._readers: list[asyncio.Task[None]] = []
        self._dispatch: dict[type[wire.Message], Callable[[str, Any], None]] = {
            wire.Step: self._on_step,
            wire.Accepted: self._on_reply,
            wire.Rejected: self._on_reply,
            wire.Tokens: self._on_reply,
            wire.Embeddings: self._on_reply,
            wire.JobsAborted: self._on_jobs_aborted,
        }

    async def start(self) -> None:
        self._sock.bind(self.endpoint)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.fileno(), self._drain_local)
        self._schedule_drain()  # the descriptor signals changes only: look once from the start
        if self.remote is not None:
            self._remote_sock = self._start_remote_listener(self.remote)
            self._remote_cap = ListenerCap(self._remote_sock, self.remote.max_connections)
            self._remote_cap.start()
            reader = asyncio.create_task(self._read_forever(self._remote_sock, True), name="worker-link-tcp")
            self._readers.append(reader)
        if self.cluster is not None:
            self.dialer = WorkerDialer(self._ctx, load_cluster_keys(self.cluster), identity(self.cluster))
            reader = asyncio.create_task(self._read_dialed_forever(self.dialer), name="worker-link-cluster")
            self._readers.append(reader)
            logger.info("cluster mode: connecting to listening workers as %s", self.dialer.routing_id)

    async def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._loop = None
        for reader in self._readers:
            reader.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        if self._remote_cap is not None:
            await self._remote_cap.close()
        self._sock.close()
        if self._remote_sock is not None:
            self._remote_sock.close()
        if self.dialer is not None:
            self.dialer.close()
        if self._authenticator is not None:
            self._authenticator.stop()
        self._ctx.term()

    # ---- identities (the rest: gateway.link.worker_identities) --------------------------------

    # Here, not in the base: a worker forgotten leaves the link's own tables too (its last Step, its
    # last job).
    def forget(self, worker_id: str) -> None:
        self._local_ids.discard(worker_id)
        self._remote_keys.pop(worker_id, None)
        self.last_seen.pop(worker_id, None)
        self.last_step_frame.pop(worker_id, None)
        self.last_job_sent.pop(worker_id, None)
        self._failed.discard(worker_id)

    def reachable(self, worker_id: str) -> None:
        """The worker answers again (a remote worker back from lost): a send it misses is news again."""
        self._failed.discard(worker_id)

    # ---- sending -----------------------------------------------------------------------------

    def send(self, worker_id: str, message: wire.Message) -> bool:
        return self.send_frame(worker_id, wire.encode(message), isinstance(message, wire.Generate))

    def send_frame(self, worker_id: str, frame: bytes, is_generate: bool = False) -> bool:
        """Send an encoded message; False when the worker cannot be reached now."""
        if is_generate:
            self.last_job_sent[worker_id] = time.monotonic()
        # Local ids live on the ipc socket only; listening workers on the dialer's; the rest are remote.
        local = worker_id in self._local_ids
        if local or (self._remote_sock is None and (self.dialer is None or worker_id not in self.dialer)):
            # A send may take the descriptor's signal for frames that arrived meanwhile.
            self._schedule_drain()
            try:
                self._sock.send_multipart([worker_id.encode(), frame], zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the worker is gone; EAGAIN: it is not reading
                self._send_failed(worker_id, exc)
                return False
            return True
        if self.dialer is not None and worker_id in self.dialer:
            sock = self.dialer.sock
        else:
            assert self._remote_sock is not None
            sock = self._remote_sock
        # A NOBLOCK send on an asyncio socket is tried at once; its error (EHOSTUNREACH: the worker
        # is gone; EAGAIN: it is not reading) comes back on the future it returns, never raised.
        sent = cast("asyncio.Future[Any]", sock.send_multipart([worker_id.encode(), frame], zmq.NOBLOCK))
        error = sent.exception() if sent.done() else None
        if error is not None:
            self._send_failed(worker_id, error)
            return False
        return True

    def _send_failed(self, worker_id: str, error: BaseException) -> None:
        level = logging.DEBUG if worker_id in self._failed else logging.WARNING
        logger.log(level, "could not send a frame to worker %s: %s", worker_id, error)

    # ---- jobs and exchanges ------------------------------------------------------------------

    def add_job(self, job: JobReceiver) -> None:
        self._jobs[job.rid] = job

    def remove_job(self, rid: str) -> None:
        self._jobs.pop(rid, None)

    def jobs_of(self, worker_id: str) -> list[JobReceiver]:
        return [job for job in self._jobs.values() if job.worker_id == worker_id]

    async def exchange(
        self, worker_id: str, message: wire.Tokenize | wire.Detokenize | wire.Embed, timeout_s: float
    ) -> Any:
        """Send a one-shot request and wait for its Tokens or Rejected; TimeoutError past timeout_s,
        the worker's failure (an APIError) if it dies meanwhile, False if it cannot be reached."""
        try:
            frame = wire.encode(message)
        except ENCODE_ERRORS as exc:
            # Schemas bound what they can name; this catches what slipped through, as a 400.
            logger.warning("a request could not be encoded for its worker: %s", type(exc).__name__)
            raise InvalidRequest("a value in the request is out of range or is not text") from None
        pending = _Exchange(worker_id, asyncio.get_running_loop().create_future())
        self._exchanges[message.rid] = pending
        try:
            if not self.send_frame(worker_id, frame):
                return False
            # asyncio.wait, not wait_for: before Python 3.12 that drops a cancel (the client left)
            # landing as the reply arrives, and the request would go on for nobody.
            done, _ = await asyncio.wait({pending.reply}, timeout=timeout_s)
            if not done:
                raise asyncio.TimeoutError  # what callers catch (TimeoutError itself from 3.11)
            return pending.reply.result()
        finally:
            self._exchanges.pop(message.rid, None)

    def fail_worker(self, worker_id: str, error: APIError) -> None:
        """The worker is gone: everything waiting on it hears so now."""
        self._failed.add(worker_id)
        for job in self.jobs_of(worker_id):
            job.on_worker_failed(error)
        for pending in list(self._exchanges.values()):
            if pending.worker_id == worker_id and not pending.reply.done():
                pending.reply.set_exception(error)

    # ---- receiving ---------------------------------------------------------------------------

    async def _read_dialed_forever(self, dialer: WorkerDialer) -> None:
        """Frames from listening workers: their id is the one we connected to them with."""
        while True:
            try:
                frames = await dialer.sock.recv_multipart()
            except zmq.ZMQError as exc:
                logger.error("cluster socket receive failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if len(frames) != 2:
                self._refusals.warning("dropped a message of %d frames", len(frames))
                continue
            worker_id = frames[0].decode(errors="replace")
            key = dialer.key_of(worker_id)
            if key is None:  # hung up on since, or never dialled
                self._refusals.warning("frame from worker %r we are not connected to dropped", worker_id)
                continue
            if worker_id in self._remote_keys:
                self.last_seen[worker_id] = time.monotonic()
            try:
                message = wire.decode(frames[1])
            except ProtocolError as exc:
                self._refusals.warning("dropped a bad frame from worker %s: %s", worker_id, exc)
                continue
            if isinstance(message, wire.Hello) and message.worker_id != worker_id:
                self._refusals.warning("worker at %r says it is %r; refused", worker_id, message.worker_id)
                continue
            self._handle(worker_id, message, key)

    def _handle(self, worker_id: str, message: wire.Message, key: WorkerKey | None) -> None:
        handler = self._dispatch.get(type(message))
        try:
            if handler is not None:
                handler(worker_id, message)
                return
            if type(message) is wire.Hello:  # a new process under this id (or one reintroduced)
                self._failed.discard(worker_id)
            self._on_lifecycle(worker_id, message, key)
        except Exception:  # one bad message must not stop the reader for every request
            logger.exception("error handling %s from worker %s", type(message).__name__, worker_id)

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and self._loop is not None:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain_local)

    def _drain_local(self) -> None:
        """The local socket's reader: every frame waiting now (up to _DRAIN_BATCH, then the rest in
        the next turn of the loop), each decoded and dispatched at once."""
        self._drain_scheduled = False
        if self._loop is None:  # closed
            return
        sock = self._sock
        try:
            for _ in range(_DRAIN_BATCH):
                # Asking first is cheaper than the zmq.Again an empty socket raises.
                if not cast(int, sock.get(_EVENTS)) & _POLLIN:
                    return
                self._on_frames(sock.recv_multipart(zmq.NOBLOCK), False)
        except zmq.ZMQError as exc:
            logger.error("worker socket receive failed: %s", exc)
            return
        self._schedule_drain()

    def _on_frames(self, frames: list[Any], remote: bool) -> None:
        if len(frames) != 2:
            self._refusals.warning("dropped a message of %d frames", len(frames))
            return
        identity, payload, public_z85 = _unpack(frames)
        worker_id = identity.decode(errors="replace")
        admitted, key = self._admit(worker_id, remote, public_z85)
        if not admitted:
            return
        try:
            message = wire.decode(payload)
        except ProtocolError as exc:
            self._refusals.warning("dropped a bad frame from worker %s: %s", worker_id, exc)
            return
        self._handle(worker_id, message, key)

    async def _read_forever(self, sock: zmq.asyncio.Socket, remote: bool) -> None:
        while True:
            try:
                # Remote frames are read as Frame objects for their User-Id: the sender's CURVE key.
                frames = await sock.recv_multipart(copy=not remote)
            except zmq.ZMQError as exc:
                logger.error("worker socket receive failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            self._on_frames(frames, remote)

    def _on_reply(
        self, worker_id: str, message: wire.Accepted | wire.Rejected | wire.Tokens | wire.Embeddings
    ) -> None:
        job = self._jobs.get(message.rid)
        if job is not None and isinstance(message, (wire.Accepted, wire.Rejected)):
            if job.worker_id == worker_id:
                job.on_reply(message)
            return
        pending = self._exchanges.get(message.rid)
        if pending is not None and pending.worker_id == worker_id and not pending.reply.done():
            if not isinstance(message, wire.Accepted):
                pending.reply.set_result(message)

    def _on_step(self, worker_id: str, message: wire.Step) -> None:
        self.last_step_frame[worker_id] = time.monotonic()
        for output in message.outputs:
            job = self._jobs.get(output.rid)
            if job is not None and job.worker_id == worker_id:
                job.on_output(output)
            # else: the request already ended (its Cancel is on the way)

    def _on_jobs_aborted(self, worker_id: str, message: wire.JobsAborted) -> None:
        for rid in message.rids:
            job = self._jobs.get(rid)
            if job is not None and job.worker_id == worker_id:
                job.on_aborted(message)


def _unpack(frames: list[Any]) -> tuple[bytes, bytes, str | None]:
    """(identity, payload, the sender's CURVE key) of a ROUTER message; Frame objects (tcp) carry the
    key ZAP authenticated as their User-Id, plain bytes (ipc) carry none."""
    identity, payload = frames
    if isinstance(payload, zmq.Frame):
        user_id = payload.get("User-Id")
        return identity.bytes, payload.bytes, user_id if isinstance(user_id, str) else None
    return bytes(identity), bytes(payload), None
