"""Frames the worker's socket has not taken yet: one queue per gateway, so that a gateway that stops
reading holds up only its own frames.

Runs in the worker process, on its link thread (model_worker.link_thread), the only thread that
touches the socket. Owns `Outbox`: the encoded frames ZeroMQ refused for now (its queue to that
gateway was full), in order for each gateway, and since when each gateway has taken none.

A worker connected to one gateway (a DEALER, whose gateway is `None` here) keeps its old rule:
while a frame waits, no newer one is encoded (`stalled()`), so the engine feels the backpressure,
and a gateway that takes nothing for the whole patience is unresponsive, which is fatal for the
worker. A listening worker (a ROUTER, several gateways) never stalls on one gateway: the others'
frames go on. A gateway that falls `MAX_BACKLOG` frames behind stalls the encoding like a single
gateway does (memory stays bounded, and a live but slower gateway only slows the engine down to its
pace); if it has also taken nothing for `STUCK_S`, it is stuck, not slow, and is lost (its jobs
cancelled by the caller) so that the others go on. One that takes nothing for the patience is lost
whatever its backlog.
"""

from __future__ import annotations

import collections
import time

import zmq

# Frames one gateway of a listening worker may fall behind by before it is lost: at one Step frame
# per engine step, a minute or more of its output, far past a pause of a live gateway.
MAX_BACKLOG = 4096
STUCK_S = 5.0  # taking nothing this long with a full backlog: stuck (a live gateway reads in ms)


class PeerUnresponsive(RuntimeError):
    """The gateway has not taken a frame for the whole patience: nothing more can be sent."""


class Outbox:
    def __init__(self, sock: zmq.Socket, patience_s: float) -> None:
        self._sock = sock
        self.patience_s = patience_s
        self.waits = 0  # how often a frame found ZeroMQ's queue to its gateway full
        self._frames: dict[bytes | None, collections.deque[bytes]] = {}  # only gateways with frames
        self._blocked_since: dict[bytes | None, float] = {}
        self._full: set[bytes] = set()  # gateways past MAX_BACKLOG, not stuck yet

    def __bool__(self) -> bool:
        return bool(self._frames)

    def add(self, peer: bytes | None, frame: bytes) -> None:
        self._frames.setdefault(peer, collections.deque()).append(frame)

    def stalled(self) -> bool:
        """Encode nothing newer until some frames go (backpressure): a single gateway's frame
        waits, or a gateway of a listening worker is `MAX_BACKLOG` frames behind."""
        return None in self._frames or bool(self._full)

    def drop(self, peer: bytes) -> None:
        self._frames.pop(peer, None)
        self._blocked_since.pop(peer, None)
        self._full.discard(peer)

    def push(self) -> list[tuple[bytes, str]]:
        """Hand ZeroMQ every waiting frame it takes now, each gateway's in order. Returns the
        gateways of a listening worker to lose, with why; raises PeerUnresponsive for a single
        gateway that took nothing for the patience, and ZMQError for a link that broke."""
        lost: list[tuple[bytes, str]] = []
        for peer, frames in list(self._frames.items()):
            why = self._push_one(peer, frames)
            if why is None and peer is not None:
                why = self._judge_backlog(peer, len(frames))
            if why is not None:
                assert peer is not None  # a single gateway's failures raise instead
                self.drop(peer)
                lost.append((peer, why))
            elif not frames:
                del self._frames[peer]
        return lost

    def _judge_backlog(self, peer: bytes, backlog: int) -> str | None:
        if backlog < MAX_BACKLOG:
            self._full.discard(peer)
            return None
        since = self._blocked_since.get(peer)
        if since is not None and time.monotonic() - since > STUCK_S:
            return f"it fell {backlog} frames behind and took none for {STUCK_S:g}s"
        self._full.add(peer)
        return None

    def _push_one(self, peer: bytes | None, frames: collections.deque[bytes]) -> str | None:
        while frames:
            try:
                if peer is None:
                    self._sock.send(frames[0], zmq.NOBLOCK)
                else:
                    self._sock.send_multipart([peer, frames[0]], zmq.NOBLOCK)
            except zmq.Again:
                now = time.monotonic()
                since = self._blocked_since.setdefault(peer, now)
                if since == now:
                    self.waits += 1
                elif now - since > self.patience_s:
                    why = f"took no frame for {self.patience_s:g}s"
                    if peer is None:
                        raise PeerUnresponsive(f"the gateway {why}") from None
                    return f"it {why}"
                return None
            except zmq.ZMQError as exc:
                if peer is None or exc.errno != zmq.EHOSTUNREACH:
                    raise
                return "its connection is gone"  # killed, or its host cut off
            frames.popleft()
            self._blocked_since.pop(peer, None)
        return None

    def send_leftovers(self) -> bool:
        """Whatever ZeroMQ takes without waiting, gateway by gateway; False if some frame stayed."""
        whole = True
        for peer, frames in self._frames.items():
            try:
                while frames:
                    if peer is None:
                        self._sock.send(frames[0], zmq.NOBLOCK)
                    else:
                        self._sock.send_multipart([peer, frames[0]], zmq.NOBLOCK)
                    frames.popleft()
            except (zmq.ZMQError, ValueError, TypeError):  # a full queue, or a frame that failed here
                whole = False
        return whole
