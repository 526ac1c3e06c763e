"""The worker's link and prompt threads: frames in and out over a real socket, off the engine thread.

Runs in the pytest process with real ZeroMQ sockets over ipc: a DEALER driven by the LinkThread
(the worker's side) and a ROUTER (the gateway's side) that reads only when the test says so. The
prompts are prepared with the demo model's real tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from transformers import AutoTokenizer

from model_worker import link_thread
from model_worker.engines.transformers.codec import TokenizerCodec
from model_worker.link_thread import LinkThread, PeerUnresponsive
from model_worker.prompt_desk import PreparedJob, PromptDesk
from tests.harness import dealer_and_router, wait_until
from wire import messages as wire
from wire.params import SamplingParams, WorkerSpec
from wire.results import RejectCode
from wire.states import WorkerState
from wire.stats import EngineInfo, EngineStats

FORWARD = frozenset({wire.Cancel, wire.Shutdown})


@pytest.fixture
def sockets(tmp_path: Path) -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    with dealer_and_router(tmp_path, small_buffers=True) as pair:
        yield pair


@pytest.fixture
def desk(demo_model_dir: Path) -> PromptDesk:
    codec = TokenizerCodec(AutoTokenizer.from_pretrained(demo_model_dir))
    spec = WorkerSpec("m", "transformers", str(demo_model_dir), 256, {})
    info = EngineInfo("transformers", "0", 256, 4, 256, len(codec.tokenizer), False, [])
    return PromptDesk(codec, None, spec, info, frozenset())


def big(i: int) -> wire.Tokens:
    return wire.Tokens(f"r{i}", [], "x" * 65536)


def test_a_full_queue_waits_for_the_gateway_and_loses_nothing(sockets: tuple[zmq.Socket, zmq.Socket]) -> None:
    dealer, router = sockets
    link = LinkThread(dealer, patience_s=30.0, forward=FORWARD)
    link.start()
    count = 40  # far more than the socket's buffers hold
    for i in range(count):
        link.send(big(i))
    wait_until(lambda: link.waits >= 1, "a frame to find the queue to the gateway full")
    received = [wire.decode(router.recv_multipart()[1]) for _ in range(count)]
    assert [m.rid for m in received] == [f"r{i}" for i in range(count)]  # all of them, in order
    assert link.close(flush_s=5.0)


def test_a_gateway_that_takes_nothing_fails_the_engine_thread(
    sockets: tuple[zmq.Socket, zmq.Socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    dealer, _ = sockets
    monkeypatch.setattr(link_thread, "MAX_OUTBOUND", 4)
    link = LinkThread(dealer, patience_s=0.3, forward=FORWARD)
    link.start()
    with pytest.raises(PeerUnresponsive, match="took no frame"):
        for i in range(1000):  # the hand-over queue fills, then the patience runs out
            link.send(big(i))
    # The link thread gives up on its waiting frame too, and the engine thread hears that wherever
    # it asks next.
    wait_until(lambda: link.failure, "the link thread to give up on its frame")
    with pytest.raises(PeerUnresponsive):
        link.take(0)
    link.close(flush_s=1.0)


def test_prompts_are_prepared_and_tokenize_answered_off_the_engine_thread(
    sockets: tuple[zmq.Socket, zmq.Socket], desk: PromptDesk
) -> None:
    dealer, router = sockets
    link = LinkThread(dealer, patience_s=30.0, forward=FORWARD)
    link.start()
    send = lambda message: router.send_multipart([b"w", wire.encode(message)])  # noqa: E731
    params = SamplingParams(max_tokens=4)
    send(wire.Generate("g1", "Hello there", None, None, params))
    taken: list[object] = []
    assert link.take(0.2) == []  # nothing is read before serve_prompts: the frame waits in the socket
    link.serve_prompts(desk)
    send(wire.Generate("g2", "x " * 300, None, None, params))  # longer than max_seq_len 256
    send(wire.Cancel("g1"))
    send(wire.Tokenize("t1", "Hello there", None, True))
    send(wire.Detokenize("d1", [10**9]))
    wait_until(lambda: taken.extend(link.take(0.1)) or len(taken) >= 3, "the engine thread's three items")
    # Prepared side by side, the two jobs may come in either order; the Cancel always after its job.
    jobs = {item.message.rid: item for item in taken if isinstance(item, PreparedJob)}
    first, second = jobs["g1"], jobs["g2"]
    assert wire.Cancel("g1") in taken and taken.index(wire.Cancel("g1")) > taken.index(first)
    assert first.prompt_ids == desk.codec.encode("Hello there", add_special_tokens=True)
    assert isinstance(second, PreparedJob) and second.prompt_ids is None
    assert second.rejection is not None and second.rejection.code is RejectCode.CONTEXT_LENGTH_EXCEEDED
    replies = {m.rid: m for m in (wire.decode(router.recv_multipart()[1]) for _ in range(2))}
    assert replies["t1"] == wire.Tokens("t1", first.prompt_ids, "")
    assert isinstance(replies["d1"], wire.Rejected) and replies["d1"].code is RejectCode.INVALID_TOKENS
    assert link.close(flush_s=5.0)


def test_frames_the_engine_thread_does_not_take_are_dropped(
    sockets: tuple[zmq.Socket, zmq.Socket], desk: PromptDesk, caplog: pytest.LogCaptureFixture
) -> None:
    dealer, router = sockets
    link = LinkThread(dealer, patience_s=30.0, forward=FORWARD)
    link.start()
    link.serve_prompts(desk)
    router.send_multipart([b"w", b"\x93not a frame"])
    router.send_multipart([b"w", wire.encode(wire.Tokens("x", [], ""))])  # a worker's message
    router.send_multipart([b"w", wire.encode(wire.Shutdown(1.0))])
    taken: list[object] = []
    wait_until(lambda: taken.extend(link.take(0.1)) or taken, "the shutdown to reach the engine thread")
    assert taken == [wire.Shutdown(1.0)]
    assert "dropped a bad frame" in caplog.text and "dropped an unexpected Tokens frame" in caplog.text
    assert link.close(flush_s=5.0)


def test_a_listening_worker_keeps_serving_one_gateway_while_another_stops_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two gateways on a listening worker's ROUTER; `stuck` never reads. Every frame still reaches
    `reader` (it does not wait behind `stuck`'s full queue for the 60 s patience): `stuck`, once too
    far behind and taking nothing, is lost; `reader`, as far behind in the burst but reading, is not."""
    from model_worker import outbox
    from model_worker.gateway_peers import GatewayPeers

    monkeypatch.setattr(outbox, "MAX_BACKLOG", 100)
    monkeypatch.setattr(outbox, "STUCK_S", 0.5)
    ctx = zmq.Context()
    worker = ctx.socket(zmq.ROUTER)
    worker.setsockopt(zmq.ROUTER_MANDATORY, 1)
    worker.setsockopt(zmq.SNDHWM, 1)
    worker.setsockopt(zmq.SNDBUF, 4096)
    worker.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/w"
    worker.bind(endpoint)
    gateways = {}
    for name in (b"reader", b"stuck"):
        gateway = gateways[name] = ctx.socket(zmq.DEALER)
        gateway.setsockopt(zmq.IDENTITY, name)
        gateway.setsockopt(zmq.RCVHWM, 1)
        gateway.setsockopt(zmq.RCVBUF, 4096)
        gateway.setsockopt(zmq.LINGER, 0)
        gateway.connect(endpoint)
    peers = GatewayPeers(timeout_s=60.0)
    link = LinkThread(worker, patience_s=60.0, forward=FORWARD, peers=peers)
    link.start()
    try:
        for gateway in gateways.values():
            gateway.send(wire.encode(wire.Ping()))
        wait_until(lambda: len(peers) == 2, "both gateways to be known")
        count = 400  # far more than the buffers to `stuck` hold, and past its backlog's bound
        stats = EngineStats(active_jobs=1)
        for _ in range(count):
            link.send(wire.Heartbeat(WorkerState.READY, stats))
        reader, beats = gateways[b"reader"], 0
        while beats < count:  # every one, in well under the patience
            assert reader.poll(10_000), f"{beats} of {count} heartbeats reached the reading gateway"
            beats += isinstance(wire.decode(reader.recv()), wire.Heartbeat)
        assert len(peers) == 1, "the gateway that reads nothing is lost, the other is not"
        assert "gateway stuck is gone (it fell 100 frames behind and took none for 0.5s)" in caplog.text
    finally:
        link.close(flush_s=1.0)
        for gateway in gateways.values():
            gateway.close(0)
        worker.close(0)
        ctx.term()
