"""The gateways a listening worker serves: who they are, which jobs each owns, and when one is gone.

Runs in a worker process started with `model-worker --listen`, on its link thread
(model_worker.link_thread), the only thread that reads or writes the worker's ROUTER socket; every
method is called there. Owns the table of gateway peers (by the routing id each gateway connects
with), the owner of every job and one-shot exchange (by request id), and what each gateway must be
told when it first appears: the worker's story so far (Hello, the last Status of each state it
went through since then or since its last standby, Ready) and its last Heartbeat, so that a
gateway's view passes through the states in the order wire.states allows, as if it had watched
from the start.

A job belongs to the gateway that sent its Generate: its outputs, answers and aborts go to that
gateway alone, and only that gateway may cancel it. Its jobs and its embedding requests not yet
answered are the `yours` of the heartbeats it gets (the load counts both: model_worker.jobs). A
gateway that sends nothing (a Ping comes every heartbeat interval) for `timeout_s`, whose link
breaks (a frame to it cannot be routed), or that says Shutdown is gone: its jobs are cancelled
through the engine thread like any Cancel, and if it comes back under the same id it is told they
were aborted (JobsAborted, gateway_gone).
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

import msgspec

from wire import messages as wire
from wire.results import AbortReason, RejectCode
from wire.states import WorkerState

logger = logging.getLogger(__name__)

# Sent to every gateway; a gateway that appears later is told the story of these first.
_BROADCAST = (wire.Hello, wire.Status, wire.Ready, wire.Heartbeat, wire.Fatal)
MAX_ORPHANED = 4096  # request ids of gone gateways remembered, to tell one that comes back

Routed = list[tuple[bytes, wire.Message]]


@dataclass(eq=False)
class _Peer:
    last_seen: float
    jobs: set[str] = field(default_factory=set)
    embeds: set[str] = field(default_factory=set)  # its Embeds not answered (nor cancelled) yet


class GatewayPeers:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._peers: dict[bytes, _Peer] = {}
        self._owners: dict[str, bytes] = {}  # generation job -> its gateway
        self._exchanges: dict[str, bytes] = {}  # tokenize, detokenize, embed -> its gateway
        self._story: list[wire.Message] = []  # Hello, a Status per state in turn, Ready
        self._heartbeat: wire.Heartbeat | None = None
        # Jobs cancelled because their gateway went, by gateway: told if it comes back.
        self._orphaned: collections.OrderedDict[bytes, list[str]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._peers)

    # ---- inbound -------------------------------------------------------------------------------

    def on_frame(self, peer: bytes, message: wire.Message, now: float) -> tuple[bool, Routed, list[str]]:
        """A frame from `peer`: (pass it on to the engine's side?, frames to send back now, request
        ids whose jobs must be cancelled)."""
        replies: Routed = []
        cancels: list[str] = []
        known = self._peers.get(peer)
        if known is None:
            known = self._peers[peer] = _Peer(now)
            logger.info("gateway %s connected (%d now)", _name(peer), len(self._peers))
            replies += self._introduce(peer)
            orphaned = self._orphaned.pop(peer, None)
            if orphaned:
                why = "the worker lost this gateway for a while; these jobs were cancelled"
                replies.append((peer, wire.JobsAborted(orphaned, AbortReason.GATEWAY_GONE, why)))
        known.last_seen = now
        if isinstance(message, wire.Ping):
            return False, replies, cancels
        if isinstance(message, wire.Reintroduce):
            if replies:  # a new peer was introduced just now
                return False, replies, cancels
            return False, self._introduce(peer), cancels
        if isinstance(message, wire.Shutdown):
            # One gateway dropping this worker (refused, or stopping): the others keep it.
            cancels += self.drop(peer, "it let go of this worker")
            return False, replies, cancels
        if isinstance(message, wire.Retire):
            logger.info("gateway %s retires this worker", _name(peer))
            return True, replies, cancels  # for every gateway: the engine's side drains and exits
        if isinstance(message, wire.Generate):
            owner = self._owners.get(message.rid)
            if owner is not None and owner != peer:
                text = f"request id {message.rid!r} is already running for another gateway"
                replies.append(
                    (peer, wire.Rejected(message.rid, RejectCode.DUPLICATE_REQUEST_ID, text, "rid"))
                )
                return False, replies, cancels
            self._owners[message.rid] = peer
            known.jobs.add(message.rid)
        elif isinstance(message, wire.Cancel):
            if self._exchanges.get(message.rid) == peer:  # an embedding it no longer waits for
                self._end_exchange(message.rid)
            elif self._owners.get(message.rid) != peer:
                return False, replies, cancels  # not its job (or already over): nothing to cancel
            else:
                self._forget_job(message.rid)
        elif isinstance(message, (wire.Tokenize, wire.Detokenize, wire.Embed)):
            self._exchanges[message.rid] = peer
            if isinstance(message, wire.Embed):
                known.embeds.add(message.rid)
        return True, replies, cancels

    def expire(self, now: float) -> list[str]:
        """Forget gateways silent for the timeout; the request ids of their jobs, to cancel."""
        cancels: list[str] = []
        for peer in [p for p, known in self._peers.items() if now - known.last_seen > self.timeout_s]:
            cancels += self.drop(peer, f"no frame for {self.timeout_s:g}s")
        return cancels

    def drop(self, peer: bytes, why: str) -> list[str]:
        """The gateway is gone: forget it; its jobs' request ids, to cancel."""
        known = self._peers.pop(peer, None)
        if known is None:
            return []
        rids = sorted(known.jobs)
        for rid in rids:
            self._owners.pop(rid, None)
        exchanges = [r for r, p in self._exchanges.items() if p == peer]
        for rid in exchanges:  # embeddings nobody waits for any more stop between engine batches
            del self._exchanges[rid]
        if rids:
            self._orphaned[peer] = rids
            while len(self._orphaned) > MAX_ORPHANED:
                self._orphaned.popitem(last=False)
        logger.warning("gateway %s is gone (%s); cancelling its %d job(s)", _name(peer), why, len(rids))
        return rids + exchanges

    # ---- outbound ------------------------------------------------------------------------------

    def route(self, message: wire.Message) -> Routed:
        """Where a message from the engine's side goes: each gateway it concerns, with what it gets."""
        if isinstance(message, _BROADCAST):
            self._remember(message)
            return [(peer, self._for(peer, message)) for peer in self._peers]
        if isinstance(message, wire.Step):
            return self._split_step(message)
        if isinstance(message, wire.JobsAborted):
            by_peer: dict[bytes, list[str]] = {}
            for rid in message.rids:
                if (peer := self._forget_job(rid)) is not None:
                    by_peer.setdefault(peer, []).append(rid)
            return [(p, msgspec.structs.replace(message, rids=rids)) for p, rids in by_peer.items()]
        if isinstance(message, (wire.Accepted, wire.Rejected)):
            peer = self._owners.get(message.rid)
            if isinstance(message, wire.Rejected):
                self._forget_job(message.rid)
                peer = peer or self._end_exchange(message.rid)
            return [(peer, message)] if peer is not None else []
        if isinstance(message, (wire.Tokens, wire.Embeddings)):
            peer = self._end_exchange(message.rid)
            return [(peer, message)] if peer is not None else []
        logger.warning("no gateway to send a %s frame to", type(message).__name__)
        return []

    def _split_step(self, message: wire.Step) -> Routed:
        by_peer: dict[bytes, list[wire.JobOutput]] = {}
        for output in message.outputs:
            peer = self._owners.get(output.rid)
            if peer is None:
                continue  # its gateway is gone or cancelled it
            by_peer.setdefault(peer, []).append(output)
            if output.finish_reason is not None:
                self._forget_job(output.rid)
        return [(peer, wire.Step(outputs)) for peer, outputs in by_peer.items()]

    def _for(self, peer: bytes, message: wire.Message) -> wire.Message:
        """A heartbeat's load says which jobs and embedding requests are this gateway's own."""
        if isinstance(message, wire.Heartbeat) and message.load is not None:
            known = self._peers[peer]
            mine = len(known.jobs) + len(known.embeds)
            return msgspec.structs.replace(message, load=msgspec.structs.replace(message.load, yours=mine))
        return message

    def _remember(self, message: wire.Message) -> None:
        story = self._story
        if isinstance(message, wire.Heartbeat):
            self._heartbeat = message
        elif isinstance(message, wire.Hello):  # a process's life begins: nothing before it counts
            self._story, self._heartbeat = [message], None
        elif isinstance(message, wire.Status) and message.state is WorkerState.UNLOADED and story:
            # Standby again (cluster mode): the model's last life no longer counts either.
            self._story, self._heartbeat = [story[0], message], None
        elif isinstance(message, wire.Status) and story and isinstance(story[-1], wire.Status):
            if story[-1].state is message.state:
                story[-1] = message  # progress within a state: only the latest counts
            else:
                story.append(message)
        elif isinstance(message, (wire.Status, wire.Ready)):
            story.append(message)

    def _introduce(self, peer: bytes) -> Routed:
        frames = [*self._story, *([self._heartbeat] if self._heartbeat is not None else [])]
        return [(peer, self._for(peer, m)) for m in frames]

    def _end_exchange(self, rid: str) -> bytes | None:
        peer = self._exchanges.pop(rid, None)
        if peer is not None and (known := self._peers.get(peer)) is not None:
            known.embeds.discard(rid)
        return peer

    def _forget_job(self, rid: str) -> bytes | None:
        peer = self._owners.pop(rid, None)
        if peer is not None and (known := self._peers.get(peer)) is not None:
            known.jobs.discard(rid)
        return peer


def _name(peer: bytes) -> str:
    return peer.decode(errors="replace")
