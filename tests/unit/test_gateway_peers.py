"""A listening worker's gateways (model_worker.gateway_peers): each job's frames go to the gateway
that sent it, a gateway that is gone loses its jobs, and one that appears late hears the story."""

from __future__ import annotations

from model_worker.gateway_peers import GatewayPeers
from wire import messages as wire
from wire.params import SamplingParams
from wire.results import AbortReason, FinishReason, JobOutput, RejectCode
from wire.states import WorkerState
from wire.stats import EngineStats, WorkerLoad

A, B = b"gw-a/1", b"gw-b/2"


def _generate(rid: str) -> wire.Generate:
    return wire.Generate(rid, "p", None, None, SamplingParams())


def _ready_peers() -> GatewayPeers:
    peers = GatewayPeers(timeout_s=2.0)
    peers.route(wire.Hello(wire.PROTOCOL_VERSION, "m@w", 7))
    peers.route(wire.Status(WorkerState.LOADING, "loading", 0.0))
    peers.route(wire.Status(WorkerState.LOADING, "loaded", 1.0))
    peers.route(wire.Status(WorkerState.WARMING, "warm-up", None))
    peers.route(wire.Heartbeat(WorkerState.WARMING, EngineStats(), WorkerLoad()))
    return peers


def test_a_late_gateway_hears_the_story_in_an_order_the_state_table_allows() -> None:
    peers = _ready_peers()
    forward, replies, cancels = peers.on_frame(A, wire.Ping(), now=0.0)
    assert not forward and not cancels
    kinds = [(type(m).__name__, getattr(m, "detail", "")) for _, m in replies]
    assert kinds == [("Hello", ""), ("Status", "loaded"), ("Status", "warm-up"), ("Heartbeat", "")]


def test_each_job_answers_its_own_gateway_and_heartbeats_say_whose_jobs_are_whose() -> None:
    peers = _ready_peers()
    for peer, rid in ((A, "a1"), (B, "b1"), (B, "b2")):
        assert peers.on_frame(peer, _generate(rid), now=0.0)[0]
    step = wire.Step(
        [JobOutput("a1", "x", [1]), JobOutput("b1", "y", [2], FinishReason.STOP), JobOutput("b2", "z", [3])]
    )
    routed = dict(peers.route(step))
    assert [o.rid for o in routed[A].outputs] == ["a1"]  # type: ignore[attr-defined]
    assert [o.rid for o in routed[B].outputs] == ["b1", "b2"]  # type: ignore[attr-defined]
    beat = dict(
        peers.route(wire.Heartbeat(WorkerState.READY, EngineStats(), WorkerLoad(active=2, max_jobs=4)))
    )
    assert beat[A].load.yours == 1 and beat[B].load.yours == 1  # type: ignore[attr-defined]
    # A gateway cannot cancel another's job, nor start one under a running id.
    assert not peers.on_frame(A, wire.Cancel("b2"), now=0.0)[0]
    forward, replies, _ = peers.on_frame(A, _generate("b2"), now=0.0)
    assert not forward and replies[0][1].code is RejectCode.DUPLICATE_REQUEST_ID  # type: ignore[attr-defined]


def test_a_gateway_gone_silent_loses_its_jobs_and_hears_so_if_it_comes_back() -> None:
    peers = _ready_peers()
    peers.on_frame(A, _generate("a1"), now=0.0)
    peers.on_frame(B, _generate("b1"), now=0.0)
    peers.on_frame(B, wire.Ping(), now=1.5)
    assert peers.expire(now=2.5) == ["a1"]  # A silent for 2.5 s > 2 s; B pinged at 1.5 s
    assert peers.route(wire.Step([JobOutput("a1", "x", [1])])) == []  # its outputs go nowhere
    _, replies, _ = peers.on_frame(A, wire.Ping(), now=3.0)
    aborted = [m for _, m in replies if isinstance(m, wire.JobsAborted)]
    assert aborted and aborted[0].rids == ["a1"] and aborted[0].reason is AbortReason.GATEWAY_GONE


def test_a_gateway_that_lets_go_loses_only_its_own_jobs() -> None:
    peers = _ready_peers()
    peers.on_frame(A, _generate("a1"), now=0.0)
    peers.on_frame(B, _generate("b1"), now=0.0)
    forward, _, cancels = peers.on_frame(A, wire.Shutdown(0.0), now=0.1)
    assert not forward and cancels == ["a1"] and len(peers) == 1


def test_after_an_unload_a_late_gateway_hears_only_the_standby_and_what_followed() -> None:
    """Each standby period starts the story again: a gateway that appears later sees the worker
    join, stand by and load, never a life of the model that has ended (nor an ever longer story)."""
    peers = _ready_peers()
    peers.route(wire.Ready(_info(), 7, 1.0, 0.5, False))
    peers.route(wire.Status(WorkerState.DRAINING, "unloading", None))
    peers.route(wire.Status(WorkerState.UNLOADED, "standby", None, 2))
    peers.route(wire.Status(WorkerState.STARTING, "loading on request", None))
    forward, replies, _ = peers.on_frame(A, wire.Load(2), now=0.0)
    assert forward  # a Load goes on to the engine's side
    story = [(type(m).__name__, getattr(m, "state", None)) for _, m in replies]
    assert story == [
        ("Hello", None),
        ("Status", WorkerState.UNLOADED),
        ("Status", WorkerState.STARTING),
    ]
    assert replies[1][1] == wire.Status(WorkerState.UNLOADED, "standby", None, 2)  # its period, too


def _info() -> wire.EngineInfo:
    return wire.EngineInfo("transformers", "1", 64, 1, 16, 100, False, [])


def _embed(rid: str) -> wire.Embed:
    return wire.Embed(rid, ["some text"], None)


def test_an_embedding_is_cancelled_by_the_gateway_that_sent_it_or_when_that_gateway_is_gone() -> None:
    """An embedding nobody waits for any more stops between its engine batches (model_worker.
    embedding_batch): the Cancel of the gateway that sent it passes, another gateway's does not, and
    a gateway that is gone takes its embeddings with it."""
    peers = _ready_peers()
    for peer, rid in ((A, "ea"), (B, "eb"), (A, "ea2")):
        assert peers.on_frame(peer, _embed(rid), now=0.0)[0]
    assert not peers.on_frame(B, wire.Cancel("ea"), now=0.0)[0]
    assert peers.on_frame(A, wire.Cancel("ea"), now=0.0)[0]
    assert not peers.on_frame(A, wire.Cancel("ea"), now=0.0)[0]  # once: it is no longer A's
    peers.on_frame(B, wire.Ping(), now=1.5)
    assert peers.expire(now=2.5) == ["ea2"]


def test_a_gateways_embeddings_not_yet_answered_are_its_own_in_the_heartbeats_it_gets() -> None:
    """The worker counts embedding requests in its load; each gateway must find its own among them
    (`yours`), or it would take them for another gateway's and route its next requests around them."""
    peers = _ready_peers()
    for peer, message in ((A, _embed("ea")), (A, _embed("ea2")), (A, _generate("a1")), (B, _embed("eb"))):
        assert peers.on_frame(peer, message, now=0.0)[0]
    peers.on_frame(A, wire.Tokenize("t", "x", None, True), now=0.0)  # no load: not counted

    def yours() -> dict[bytes, int]:
        beat = wire.Heartbeat(WorkerState.READY, EngineStats(), WorkerLoad(active=2, queued=2, max_jobs=4))
        return {peer: m.load.yours for peer, m in peers.route(beat)}  # type: ignore[attr-defined]

    assert yours() == {A: 3, B: 1}
    peers.route(wire.Embeddings("ea", [[0.5]], 2))
    peers.on_frame(A, wire.Cancel("ea2"), now=0.0)
    peers.route(wire.Rejected("eb", RejectCode.INVALID_TOKENS, "no", "input"))
    assert yours() == {A: 1, B: 0}
