"""The worker's link: the one thread that touches its socket, and the threads that prepare prompts.

Runs in the worker process, on threads of its own beside the engine thread (model_worker.serve_loop).
The link thread owns the socket from `start()` to `close()`: it reads and decodes every frame from
the gateway, and encodes and sends every frame to it (handed over as messages by `send()`), so it is
never busy for long. The prompt threads (model_worker.prompt_threads) prepare generation prompts
(chat template, tokenizer and the shared checks, through model_worker.prompt_desk) and embedding
inputs (tokenized and checked), and answer Tokenize and Detokenize: a long prompt or text takes one
of them a while, and in that time neither the engine's steps, its heartbeats, the frames that carry
their tokens, nor the requests that arrive behind it wait for it. Every message for the engine thread
passes through them: each request's in arrival order (a Cancel never overtakes its Generate or
Embed), and one about no request after everything read before it; the engine thread takes them from
`take()`.

Nothing is ever dropped: when ZeroMQ's queue to the gateway is full, the frame waits here and
`send()` waits once the bounded hand-over queue is full too (backpressure: the engine pauses while
the gateway catches up). A gateway that takes nothing for `patience_s` is gone or wedged, and the
link fails loudly (PeerUnresponsive), as does any error on this thread: the engine thread raises it
at its next call, which is fatal for the worker, so the gateway's liveness checks end its requests.

The socket is a DEALER connected to one gateway, or (`model-worker --listen`) a ROUTER that several
gateways connect to: then model_worker.gateway_peers says which gateway each frame goes to, and a
gateway that is gone (silent, unroutable, unresponsive for the patience, or too far behind) loses its
jobs, which are cancelled through the prompt threads like any Cancel, while the worker serves the
others; one that stops reading holds up only its own frames (model_worker.outbox).
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from model_worker.native_names import name_this_thread
from model_worker.outbox import Outbox, PeerUnresponsive
from model_worker.prompt_threads import PREPARED_TYPES, PromptThreads
from wire import messages as wire
from wire.codec import ProtocolError

if TYPE_CHECKING:
    from model_worker.gateway_peers import GatewayPeers
    from model_worker.prompt_desk import PromptDesk

logger = logging.getLogger(__name__)

# Messages waiting for this thread to encode them: at one Step frame per engine step, minutes of
# output; past it the engine waits (backpressure).
MAX_OUTBOUND = 4096
BELL_READ_BYTES = 4096  # rings are one byte each: a read this long that comes back short took them all
_WAKE = object()  # an inbound item that only wakes the engine thread (a stop was requested)


class _LinkFailed:
    """The inbound item that tells the engine thread the link thread has stopped on an error."""


class LinkThread:
    def __init__(
        self,
        sock: zmq.Socket,
        patience_s: float,
        forward: frozenset[type[wire.Message]],
        peers: GatewayPeers | None = None,
    ) -> None:
        self._sock = sock
        self._peers = peers  # a listening worker's gateways; None: one gateway, over a DEALER
        self._forward = forward  # the message types the engine thread takes as they are
        self.patience_s = patience_s
        self._handover_waits = 0  # how often the engine found the hand-over queue full
        self.failure: BaseException | None = None
        self._inbound: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Generates read from the socket (this thread counts, the only writer) against those handed
        # over prepared (the prompt threads count, under their lock): `preparing`.
        self._generates_read = 0
        # Embeds read from the socket (this thread counts) and taken by the engine thread (it counts,
        # in took_embed): the difference is part of the load the worker reports, as queued.
        self._embeds_read = 0
        self._embeds_taken = 0
        self._outbound: queue.Queue[wire.Message] = queue.Queue(MAX_OUTBOUND)
        self._replies: collections.deque[wire.Message] = collections.deque()  # the prompt threads'
        # When each message in _outbound was handed over, in order; and, with a step trace on
        # (trace_handoffs), where this thread puts how long each waited before it took it (seconds).
        self._handed_over_at: collections.deque[float] = collections.deque()
        self._handoff_waits: collections.deque[float] | None = None
        # Encoded frames ZeroMQ has not taken yet, in order for each gateway.
        self._outbox = Outbox(sock, patience_s)
        self._stopping = False
        # The doorbell: the engine thread writes a byte after each hand-over, this thread polls it
        # beside the socket (a socket must not be shared between threads, a pipe may).
        self._bell_read, self._bell_write = os.pipe()
        os.set_blocking(self._bell_read, False)
        os.set_blocking(self._bell_write, False)
        self._thread = threading.Thread(
            target=self._guarded, args=(self._loop,), name="worker-link", daemon=True
        )
        self._prompts = PromptThreads(self._inbound.put, self._reply, self._guarded)

    # ---- the engine thread's side ------------------------------------------------------------

    def start(self) -> None:
        """From now on only the link thread uses the socket, until close() returns."""
        self._thread.start()
        self._prompts.start()

    def serve_prompts(self, desk: PromptDesk) -> None:
        """Start reading the gateway's frames (until now they wait in the socket): the model is
        loaded, so prompts can be prepared."""
        self._prompts.serve(desk)
        self._ring()

    def trace_handoffs(self, waits: collections.deque[float] | None) -> None:
        """From now on, how long each message waited between its hand-over and this thread taking
        it goes into `waits` (model_worker.step_trace): the wake-up, and the GIL, it waited for.
        None stops it."""
        self._handoff_waits = waits

    def send(self, message: wire.Message) -> None:
        """Hand a message over for sending; waits while the hand-over queue is full. Raises the
        link's failure, or PeerUnresponsive when no room came within the patience."""
        self.check()
        self._handed_over_at.append(time.perf_counter())
        try:
            self._outbound.put_nowait(message)
        except queue.Full:
            try:
                self._wait_for_room(message)
            except BaseException:
                self._handed_over_at.pop()  # never queued
                raise
        self._ring()

    def send_last(self, message: wire.Message) -> None:
        """A message sent on the way out (Fatal, goodbye): best effort, since the process's exit is
        itself seen by the gateway; waiting here would only delay that."""
        self._handoff_waits = None  # the trace has closed
        self._handed_over_at.append(time.perf_counter())
        try:
            self._outbound.put_nowait(message)
        except queue.Full:
            self._handed_over_at.pop()
            logger.warning("send queue to the gateway is full; the last frame is not sent")
            return
        self._ring()

    def take(self, timeout_s: float) -> list[Any]:
        """What arrived for the engine thread, oldest first (prepared jobs and embeds, wire messages);
        waits up to timeout_s for the first item. Raises the link's failure."""
        items: list[Any] = []
        inbound = self._inbound
        if timeout_s <= 0 and inbound.empty():
            return items
        try:
            item = inbound.get(timeout=timeout_s) if timeout_s > 0 else inbound.get_nowait()
            while True:
                if isinstance(item, _LinkFailed):
                    self.check()
                if item is not _WAKE:
                    items.append(item)
                item = inbound.get_nowait()
        except queue.Empty:
            return items

    def wake(self) -> None:
        """Ends a take() that waits; safe in a signal handler (SimpleQueue.put is reentrant)."""
        self._inbound.put(_WAKE)

    @property
    def link_thread_id(self) -> int:
        """The link thread's id for the operating system (for CPU placement); after start()."""
        native_id = self._thread.native_id
        assert native_id is not None, "the link thread has not started"
        return native_id

    @property
    def preparing(self) -> int:
        """Generates that have arrived and are not handed over yet (their prompts being prepared)."""
        return self._generates_read - self._prompts.generates_prepared

    @property
    def embeds_arriving(self) -> int:
        """Embeds that have arrived and that the engine thread has not taken yet (their inputs being
        tokenized, most of the time)."""
        return self._embeds_read - self._embeds_taken

    def took_embed(self) -> None:
        """The engine thread took a prepared Embed from take(): it counts it from now on."""
        self._embeds_taken += 1

    @property
    def gateways(self) -> int:
        """How many gateways share this worker now (1 for a worker connected to one gateway)."""
        return 1 if self._peers is None else len(self._peers)

    @property
    def waits(self) -> int:
        """How often a frame found a queue to the gateway full: a pause, never a loss."""
        return self._handover_waits + self._outbox.waits

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def close(self, flush_s: float) -> bool:
        """Send what is queued (for up to flush_s) and stop the thread; True once the socket is the
        caller's again. A thread that stopped on an error leaves its frames to be tried here."""
        deadline = time.monotonic() + flush_s
        self._prompts.close(flush_s)  # their last replies go out with the rest
        self._stopping = True
        self._ring()
        if self._thread.is_alive():
            self._thread.join(max(deadline - time.monotonic(), 0.0))
        if self._thread.is_alive():
            logger.warning("frames to the gateway were still waiting after %.1fs; not sent", flush_s)
            return False
        self._send_leftovers()  # a thread that ended on an error (or never ran) may have left some
        if not self._prompts.alive:  # else they may still ring: its descriptors stay open
            os.close(self._bell_read)
            os.close(self._bell_write)
        return True

    def _wait_for_room(self, message: wire.Message) -> None:
        self._handover_waits += 1
        if self._handover_waits == 1 or self._handover_waits % 100 == 0:
            logger.warning("send queue to the gateway is full; waiting for it (%d times so far)", self.waits)
        deadline = time.monotonic() + self.patience_s
        while (left := deadline - time.monotonic()) > 0:
            self.check()
            try:
                self._outbound.put(message, timeout=min(left, 0.25))
                return
            except queue.Full:
                continue
        raise PeerUnresponsive(f"the gateway took no frame for {self.patience_s:g}s")

    def _ring(self) -> None:
        try:
            os.write(self._bell_write, b"\0")
        except BlockingIOError:  # the pipe is full of rings already: this thread will look anyway
            pass

    # ---- the link thread -----------------------------------------------------------------------

    def _guarded(self, loop: Callable[[], None]) -> None:
        name_this_thread()
        try:
            loop()
        except BaseException as exc:  # every error here is the worker's end: the engine thread raises it
            if self.failure is None:
                self.failure = exc
            self._inbound.put(_LinkFailed())

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._bell_read, zmq.POLLIN)
        watched = 0
        while True:
            # A listener reads at once: gateways that connect while it loads are told so (and ping).
            reading = self._prompts.serving or self._peers is not None
            wanted = (zmq.POLLIN if reading else 0) | (zmq.POLLOUT if self._outbox else 0)
            if wanted != watched:
                if wanted:
                    poller.register(self._sock, wanted)
                else:
                    poller.unregister(self._sock)
                watched = wanted
            # A frame waiting for room is retried at least every 100 ms, to judge the patience.
            events = dict(poller.poll(100 if self._outbox else 1000))
            if self._bell_read in events:
                self._clear_bell()
            if events.get(self._sock, 0) & zmq.POLLIN:
                self._receive()
            if self._peers is not None:
                self._cancel(self._peers.expire(time.monotonic()))
            self._flush()
            if self._stopping and not self._outbox and not self._replies and self._outbound.empty():
                return

    def _clear_bell(self) -> None:
        # A short read has emptied the pipe: no second read just to hear EAGAIN. Each call here
        # lets go of the GIL and takes it back, which the engine thread may then have to wait for.
        try:
            while len(os.read(self._bell_read, BELL_READ_BYTES)) == BELL_READ_BYTES:
                pass
        except BlockingIOError:
            pass

    def _receive(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            frame = frames[-1]
            try:
                message = wire.decode(frame)
            except ProtocolError as exc:
                logger.warning("dropped a bad frame (%d bytes): %s", len(frame), exc)
                continue
            if self._peers is not None:
                if len(frames) != 2:
                    logger.warning("dropped a message of %d frames", len(frames))
                    continue
                forward, replies, cancels = self._peers.on_frame(frames[0], message, time.monotonic())
                for peer, reply in replies:
                    self._outbox.add(peer, wire.encode(reply))
                self._cancel(cancels)
                if not forward:
                    continue
            if type(message) in PREPARED_TYPES or type(message) in self._forward:
                if type(message) is wire.Generate:
                    self._generates_read += 1
                elif type(message) is wire.Embed:
                    self._embeds_read += 1
                self._prompts.arrived.put(message)
            else:
                logger.warning("dropped an unexpected %s frame", type(message).__name__)

    def _cancel(self, rids: list[str]) -> None:
        """Jobs of a gateway that is gone: cancelled in their turn, after their Generate."""
        for rid in rids:
            self._prompts.arrived.put(wire.Cancel(rid))

    def _reply(self, message: wire.Message) -> None:
        """An answer from a prompt thread (Tokens, Rejected): sent before the engine's queued frames."""
        self._replies.append(message)
        self._ring()

    def _flush(self) -> None:
        """Hand every queued frame to ZeroMQ, each gateway's in order, until its queue is full."""
        while True:
            for gone, why in self._outbox.push():
                self._lose(gone, why)
            if self._outbox.stalled():
                return
            message = self._next_message()
            if message is None:
                return
            for target, frame in self._encode(message):
                self._outbox.add(target, frame)

    def _encode(self, message: wire.Message) -> list[tuple[bytes | None, bytes]]:
        if self._peers is None:
            return [(None, wire.encode(message))]
        return [(peer, wire.encode(routed)) for peer, routed in self._peers.route(message)]

    def _lose(self, peer: bytes, why: str) -> None:
        """A listening worker's gateway is gone: its frames are dropped and its jobs cancelled."""
        assert self._peers is not None
        self._cancel(self._peers.drop(peer, why))
        self._outbox.drop(peer)

    def _next_message(self) -> wire.Message | None:
        if self._replies:
            return self._replies.popleft()
        try:
            message = self._outbound.get_nowait()
        except queue.Empty:
            return None
        # Never fatal: a diagnostic must not end the link if its count were ever off.
        handed_over = self._handed_over_at.popleft() if self._handed_over_at else None
        if handed_over is not None and (waits := self._handoff_waits) is not None:
            waits.append(time.perf_counter() - handed_over)
        return message

    def _send_leftovers(self) -> None:
        """On the engine thread, once the link thread has ended: what can go out without waiting."""
        try:
            while (message := self._next_message()) is not None:
                for peer, frame in self._encode(message):
                    self._outbox.add(peer, frame)
        except (ValueError, TypeError):  # a message that cannot be encoded: the rest still goes
            logger.warning("a last frame to the gateway could not be encoded")
        if not self._outbox.send_leftovers():
            logger.warning("the last frames to the gateway could not be sent")
