"""An embedding worker drops a request the gateway cancelled between engine batches, and reports
itself busy, not idle, while it embeds: its requests count in the load it reports (active while
their turn runs, queued while they wait behind it or their inputs are tokenized).

Runs in the pytest process, playing the gateway over a real socket in front of one real worker
process with the transformers demo embedding model. The worker's heartbeats say how many inputs
its engine has embedded so far (`stats.jobs_finished`), the requests it holds (`load.active`,
`load.queued`) and how long it has been idle (`load.idle_s`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from gateway.demo.embedding_model import make_demo_embedding_model
from tests.harness import REPO_ROOT
from wire import messages as wire

# max_batch_size 4: an input of 256 tokens is one of many short engine batches.
BATCH = 4
INPUT = [7] * 256


class FakeGateway:
    """The gateway's side of one worker: a ROUTER that reads frames when a test asks."""

    def __init__(self, tmp_path: Path, embed_dir: Path) -> None:
        spec = {"name": "e", "engine": "transformers", "path": str(embed_dir), "max_seq_len": 512,
                "engine_settings": {"threads": 1, "max_batch_size": BATCH}, "heartbeat_interval_s": 0.05,
                "task": "embed"}  # fmt: skip
        endpoint = f"ipc://{tmp_path}/w.sock"
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(endpoint)
        cmd = [sys.executable, "-m", "model_worker", "--connect", endpoint, "--worker-id", "w1",
               "--spec", json.dumps(spec)]  # fmt: skip
        with open(tmp_path / "worker.log", "wb") as log:
            self.worker = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        self.identity = b""
        self.identity, _ = self.next(wire.Ready)

    def next(self, *kinds: type[wire.Message]) -> tuple[bytes, wire.Message]:
        while True:
            if not self.router.poll(120_000):
                raise TimeoutError(f"no {' or '.join(k.__name__ for k in kinds)} from the worker")
            identity, frame = self.router.recv_multipart()
            message = wire.decode(frame)
            assert not isinstance(message, wire.Fatal), message
            if isinstance(message, kinds):
                return identity, message

    def heartbeat(self) -> wire.Heartbeat:
        _, beat = self.next(wire.Heartbeat)
        assert isinstance(beat, wire.Heartbeat) and beat.load is not None
        return beat

    def send(self, message: wire.Message) -> None:
        self.router.send_multipart([self.identity, wire.encode(message)])

    def close(self) -> None:
        if self.worker.poll() is None:
            self.send(wire.Shutdown(5.0))
            try:
                self.worker.wait(30)
            except subprocess.TimeoutExpired:
                self.worker.kill()
                self.worker.wait(10)
        self.router.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGateway]:
    root = tmp_path_factory.mktemp("embedding-worker")
    fake = FakeGateway(root, make_demo_embedding_model(root / "demo-embed", seed=2))
    try:
        yield fake
    finally:
        fake.close()


def embedded(beat: wire.Heartbeat) -> int:
    return beat.stats.jobs_finished  # the embedding engine counts the inputs it embedded


def test_a_request_cancelled_while_its_batches_run_is_dropped(gateway: FakeGateway) -> None:
    """The gateway gave up on "big" (its deadline passed, or its client left) after its first
    engine batches: the worker runs none of its later inputs and never answers it, and the request
    behind it is answered at once instead of after all of them."""
    count = 400  # a hundred engine batches
    before = embedded(gateway.heartbeat())
    gateway.send(wire.Embed("big", None, [INPUT] * count))
    while embedded(gateway.heartbeat()) == before:  # heartbeats come between engine batches
        pass
    gateway.send(wire.Cancel("big"))
    gateway.send(wire.Embed("probe", ["after the cancel"], None))
    _, answer = gateway.next(wire.Embeddings, wire.Rejected)
    # Without the cancel "big" is answered first: "probe" waits for the next turn.
    assert isinstance(answer, wire.Embeddings), answer
    assert answer.rid == "probe", f"{answer.rid} was answered first"
    ran = embedded(gateway.heartbeat()) - before - 1
    assert 0 < ran < count / 2, f"{ran} of the cancelled request's {count} inputs were embedded"


def test_a_worker_busy_embedding_is_not_idle(gateway: FakeGateway) -> None:
    """Its idle time (what the leading gateway unloads an idle model by) stops while it embeds and
    counts again from the end of the work, though an embedding holds no generation job."""
    while (idle_before := gateway.heartbeat().load.idle_s) < 0.5:  # type: ignore[union-attr]
        pass
    before = embedded(gateway.heartbeat())
    count = 200  # fifty engine batches, each with a heartbeat due after it
    gateway.send(wire.Embed("work", None, [INPUT] * count))
    during: list[float] = []
    while True:
        _, message = gateway.next(wire.Heartbeat, wire.Embeddings, wire.Rejected)
        if not isinstance(message, wire.Heartbeat):
            break
        assert message.load is not None
        if before < embedded(message) < before + count:  # sent between two of its engine batches
            during.append(message.load.idle_s)
    assert isinstance(message, wire.Embeddings) and message.rid == "work", type(message).__name__
    assert during, "no heartbeat came while the request's batches ran: make it larger"
    assert set(during) == {0.0}, during
    after = gateway.heartbeat().load.idle_s  # type: ignore[union-attr]
    assert after < idle_before, (idle_before, after)


def held(beat: wire.Heartbeat) -> tuple[int, int]:
    load = beat.load
    assert load is not None
    assert load.yours == load.active + load.queued  # one gateway: every request held is its own
    return load.active, load.queued


def test_embedding_requests_count_in_the_load_while_they_run_and_wait(gateway: FakeGateway) -> None:
    """A router reading this worker's load must see it busy: the request whose turn runs is active,
    one sent meanwhile waits behind that turn (queued), and both are gone once answered."""
    while held(gateway.heartbeat()) != (0, 0):
        pass
    before = embedded(gateway.heartbeat())
    count = 400  # a hundred engine batches
    gateway.send(wire.Embed("long", None, [INPUT] * count))
    while not before < embedded(beat := gateway.heartbeat()) < before + count:
        pass
    assert held(beat) == (1, 0)
    gateway.send(wire.Embed("behind", ["waits for the next turn"], None))
    while (figures := held(beat := gateway.heartbeat())) == (1, 0):
        assert embedded(beat) < before + count, "the turn ended before the second request was counted"
    assert figures == (1, 1) and embedded(beat) < before + count, figures
    answers: list[str] = []
    while len(answers) < 2:
        _, answer = gateway.next(wire.Embeddings, wire.Rejected)
        assert isinstance(answer, wire.Embeddings), answer
        answers.append(answer.rid)
    assert answers == ["long", "behind"]
    assert held(gateway.heartbeat()) == (0, 0)  # sent after both answers: frames arrive in order


def test_an_embedding_whose_inputs_are_being_tokenized_counts_as_queued(gateway: FakeGateway) -> None:
    """Tokenizing a large request takes a prompt thread a while (about a second here) before the
    engine thread sees it: the worker is not idle meanwhile, the request waits (queued)."""
    while held(gateway.heartbeat()) != (0, 0):
        pass
    before = embedded(gateway.heartbeat())
    texts = ["the weather today is " * 60] * 2048  # about 420 tokens each, under max_seq_len 512
    gateway.send(wire.Embed("slow", texts, None))
    while True:
        beat = gateway.heartbeat()
        assert beat.load is not None and embedded(beat) == before, "it ran before a beat saw it waiting"
        if held(beat) != (0, 0):
            break
    assert held(beat) == (0, 1) and beat.load.idle_s == 0.0, beat.load
    gateway.send(wire.Cancel("slow"))  # after its Embed, in order: never answered
    # Prepared beside the large one on another prompt thread: it need not wait for its tokenizing.
    gateway.send(wire.Embed("probe", ["after the cancel"], None))
    _, answer = gateway.next(wire.Embeddings, wire.Rejected)
    assert isinstance(answer, wire.Embeddings) and answer.rid == "probe", answer
    while held(gateway.heartbeat()) != (0, 0):  # until the large one is tokenized, then cancelled
        pass
    gateway.send(wire.Embed("probe-2", ["after it"], None))
    _, answer = gateway.next(wire.Embeddings, wire.Rejected)
    assert isinstance(answer, wire.Embeddings) and answer.rid == "probe-2", answer  # "slow" never was
