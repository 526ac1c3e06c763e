"""The worker's prompt threads: requests prepared side by side, each request's messages in order.

Runs in the pytest process. PromptThreads is driven as the link thread drives it (messages put in
`arrived` in arrival order) and its hand-overs are collected as the engine thread takes them; one
test goes through a LinkThread over real ZeroMQ sockets. Prompts are prepared with the demo model's
real tokenizer, behind a desk that holds the requests a test names until the test lets them go.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from transformers import AutoTokenizer

from model_worker.engines.transformers.codec import TokenizerCodec
from model_worker.link_thread import LinkThread
from model_worker.prompt_desk import PREPARING_THREADS, PreparedEmbed, PreparedJob, PromptDesk
from model_worker.prompt_threads import PromptThreads
from tests.harness import dealer_and_router, wait_until
from wire import messages as wire
from wire.params import SamplingParams, WorkerSpec
from wire.stats import EngineInfo

PARAMS = SamplingParams(max_tokens=4)
WAIT_S = 60.0  # for what must happen; on a busy 2-core host a thread may wait seconds for a core


class HeldDesk(PromptDesk):
    """A real desk whose work for the rids in `held` starts, then waits until the test lets it go."""

    def __init__(self, inner: PromptDesk) -> None:  # the inner desk does the work
        self.inner = inner
        self.held: dict[str, threading.Event] = {}
        self.started: dict[str, threading.Event] = {}

    def hold(self, rid: str) -> threading.Event:
        self.started[rid] = threading.Event()
        gate = self.held[rid] = threading.Event()
        return gate

    def _wait(self, rid: str) -> None:
        if rid in self.held:
            self.started[rid].set()
            assert self.held[rid].wait(WAIT_S), f"the test never let {rid} go"

    def prepare(self, msg: wire.Generate) -> PreparedJob:
        self._wait(msg.rid)
        if msg.prompt == "fail":
            raise RuntimeError("the desk broke")
        return self.inner.prepare(msg)

    def prepare_embed(self, msg: wire.Embed) -> PreparedEmbed:
        self._wait(msg.rid)
        return self.inner.prepare_embed(msg)

    def tokenize(self, msg: wire.Tokenize) -> wire.Tokens | wire.Rejected:
        self._wait(msg.rid)
        return self.inner.tokenize(msg)

    def detokenize(self, msg: wire.Detokenize) -> wire.Tokens | wire.Rejected:
        self._wait(msg.rid)
        return self.inner.detokenize(msg)


@pytest.fixture
def desk(demo_model_dir: Path) -> HeldDesk:
    codec = TokenizerCodec(AutoTokenizer.from_pretrained(demo_model_dir))
    spec = WorkerSpec("m", "transformers", str(demo_model_dir), 256, {})
    info = EngineInfo("transformers", "0", 256, 4, 256, len(codec.tokenizer), False, [])
    return HeldDesk(PromptDesk(codec, None, spec, info, frozenset()))


class Threads:
    """PromptThreads with the engine thread's queue, the gateway's replies and the link's failure."""

    def __init__(self, desk: PromptDesk | None) -> None:
        self.engine: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.replies: queue.SimpleQueue[wire.Message] = queue.SimpleQueue()
        self.failures: list[BaseException] = []
        self.threads = PromptThreads(self.engine.put, self.replies.put, self._guarded)
        self.threads.start()
        if desk is not None:
            self.threads.serve(desk)

    def _guarded(self, loop: Any) -> None:
        try:
            loop()
        except BaseException as exc:
            self.failures.append(exc)

    def send(self, *messages: wire.Message) -> None:
        for message in messages:
            self.threads.arrived.put(message)

    def handed_over(self, count: int) -> list[Any]:
        return [self.engine.get(timeout=WAIT_S) for _ in range(count)]

    def close(self) -> None:
        self.threads.close(WAIT_S)
        assert not self.threads.alive, "close() joins every prompt thread"


@pytest.fixture
def threads(desk: HeldDesk) -> Iterator[Threads]:
    running = Threads(desk)
    yield running
    for gate in desk.held.values():
        gate.set()
    running.close()


def rids(items: list[Any]) -> list[tuple[str, str]]:
    """Each hand-over as (kind, rid): what the engine thread sees, in order."""
    return [
        (type(item).__name__, item.message.rid if hasattr(item, "message") else item.rid) for item in items
    ]


def test_a_request_behind_a_long_preparation_is_handed_over_first(threads: Threads, desk: HeldDesk) -> None:
    gate = desk.hold("long")
    threads.send(wire.Generate("long", "Hello " * 50, None, None, PARAMS))
    assert desk.started["long"].wait(WAIT_S)
    threads.send(
        wire.Generate("short", "Hello there", None, None, PARAMS),
        wire.Tokenize("t", "Hello there", None, True),
        wire.Detokenize("d", [1, 2]),
    )
    (short,) = threads.handed_over(1)  # while "long" is still being prepared
    assert isinstance(short, PreparedJob) and short.message.rid == "short" and short.prompt_ids
    answers = {reply.rid: reply for reply in (threads.replies.get(timeout=WAIT_S) for _ in range(2))}
    assert isinstance(answers["t"], wire.Tokens) and answers["t"].token_ids == short.prompt_ids
    assert isinstance(answers["d"], wire.Tokens) and answers["d"].token_ids == [1, 2]
    assert threads.engine.empty()
    gate.set()
    (long,) = threads.handed_over(1)
    assert isinstance(long, PreparedJob) and long.message.rid == "long"


@pytest.mark.parametrize("kind", ["generate", "embed"])
def test_a_cancel_waits_for_its_request_however_long_that_takes(
    threads: Threads, desk: HeldDesk, kind: str
) -> None:
    """The engine thread must see a request (or its rejection) before the Cancel of it: a Cancel
    first would cancel nothing, and the job would then run for nobody."""
    gate = desk.hold("slow")
    request = (
        wire.Generate("slow", "Hello there", None, None, PARAMS)
        if kind == "generate"
        else wire.Embed("slow", ["Hello there"], None)
    )
    threads.send(request, wire.Cancel("slow"), wire.Generate("other", "Hi", None, None, PARAMS))
    assert desk.started["slow"].wait(WAIT_S)
    (other,) = threads.handed_over(1)
    # The Cancel read before "other" waits: it was not handed over ahead of its request.
    assert rids([other]) == [("PreparedJob", "other")] and threads.engine.empty()
    threads.send(wire.Cancel("other"))  # a request handed over already: its Cancel goes at once
    assert threads.handed_over(1) == [wire.Cancel("other")]
    gate.set()
    prepared = "PreparedJob" if kind == "generate" else "PreparedEmbed"
    assert rids(threads.handed_over(2)) == [(prepared, "slow"), ("Cancel", "slow")]


def test_one_rids_messages_keep_their_order_whatever_each_takes(threads: Threads, desk: HeldDesk) -> None:
    """A second Generate with a running job's rid is refused as a duplicate: which one is refused
    depends on the order the engine thread sees them in, so that order is the arrival order."""
    gate = desk.hold("a")
    threads.send(
        wire.Generate("a", "Hello " * 40, None, None, PARAMS),
        wire.Cancel("a"),
        wire.Generate("a", "Hi", None, None, PARAMS),
        wire.Cancel("a"),
        wire.Tokenize("a", "Hi", None, True),
    )
    assert desk.started["a"].wait(WAIT_S)
    gate.set()
    items = threads.handed_over(4)
    assert rids(items) == [("PreparedJob", "a"), ("Cancel", "a"), ("PreparedJob", "a"), ("Cancel", "a")]
    assert [len(item.message.prompt) for item in items[::2]] == [len("Hello " * 40), 2]
    assert threads.replies.get(timeout=WAIT_S).rid == "a"  # the Tokenize, answered after them


def test_a_message_about_no_request_waits_for_everything_read_before_it(
    threads: Threads, desk: HeldDesk
) -> None:
    """A Shutdown drains the jobs sent before it and refuses those sent after: the engine thread
    sees it after every request read before it, and before every one read after it."""
    gate = desk.hold("before")
    threads.send(
        wire.Generate("before", "Hello there", None, None, PARAMS),
        wire.Cancel("gone"),  # about a request not being prepared: handed over at once
        wire.Shutdown(5.0),
        wire.Generate("after", "Hi", None, None, PARAMS),
    )
    assert threads.handed_over(1) == [wire.Cancel("gone")]
    assert desk.started["before"].wait(WAIT_S)
    gate.set()
    items = threads.handed_over(3)
    assert rids(items[:1]) == [("PreparedJob", "before")]
    assert items[1] == wire.Shutdown(5.0)
    assert rids(items[2:]) == [("PreparedJob", "after")]


def test_the_count_of_prepared_generates_is_exact_with_every_thread_counting(
    threads: Threads, desk: HeldDesk
) -> None:
    """The burst gather waits while `preparing` (read minus prepared) is above zero: a count lost
    between two threads would make every idle worker wait for a job that never comes."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns as often as they can
    try:
        count = 3000
        threads.send(*(wire.Generate(f"g{i}", "Hi", None, None, PARAMS) for i in range(count)))
        items = threads.handed_over(count)
    finally:
        sys.setswitchinterval(interval)
    assert sorted(item.message.rid for item in items) == sorted(f"g{i}" for i in range(count))
    assert threads.threads.generates_prepared == count
    assert threads.engine.empty()


def test_more_long_preparations_than_threads_still_let_a_short_one_through_once_one_ends(
    threads: Threads, desk: HeldDesk
) -> None:
    gates = [desk.hold(f"long{i}") for i in range(PREPARING_THREADS)]
    threads.send(*(wire.Generate(f"long{i}", "Hello", None, None, PARAMS) for i in range(PREPARING_THREADS)))
    threads.send(wire.Generate("short", "Hi", None, None, PARAMS))
    for i in range(PREPARING_THREADS):
        assert desk.started[f"long{i}"].wait(WAIT_S)
    gates[1].set()
    assert sorted(rids(threads.handed_over(2))) == [("PreparedJob", "long1"), ("PreparedJob", "short")]
    for gate in gates:
        gate.set()
    assert sorted(rids(threads.handed_over(2))) == [("PreparedJob", "long0"), ("PreparedJob", "long2")]


def test_messages_read_before_the_model_is_loaded_are_dropped_at_a_stop() -> None:
    stopped = Threads(None)
    stopped.send(wire.Generate("g", "Hi", None, None, PARAMS), wire.Cancel("g"), wire.Shutdown(1.0))
    stopped.close()
    assert stopped.engine.empty() and stopped.threads.generates_prepared == 1 and not stopped.failures


def test_close_prepares_what_has_arrived_then_stops_every_thread(desk: HeldDesk) -> None:
    running = Threads(desk)
    gate = desk.hold("slow")
    running.send(wire.Generate("slow", "Hello", None, None, PARAMS), wire.Cancel("slow"))
    assert desk.started["slow"].wait(WAIT_S)
    closing = threading.Thread(target=running.close)
    closing.start()
    gate.set()
    closing.join(WAIT_S)
    assert not closing.is_alive() and not running.threads.alive
    assert rids(running.handed_over(2)) == [("PreparedJob", "slow"), ("Cancel", "slow")]


@pytest.fixture
def sockets(tmp_path: Path) -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    with dealer_and_router(tmp_path) as pair:
        yield pair


def test_a_preparing_thread_that_fails_fails_the_link_and_close_still_stops_it_all(
    sockets: tuple[zmq.Socket, zmq.Socket], desk: HeldDesk
) -> None:
    dealer, router = sockets
    link = LinkThread(dealer, patience_s=30.0, forward=frozenset({wire.Cancel, wire.Shutdown}))
    link.start()
    link.serve_prompts(desk)
    send = lambda message: router.send_multipart([b"w", wire.encode(message)])  # noqa: E731
    send(wire.Generate("ok", "Hi", None, None, PARAMS))
    taken: list[Any] = []
    wait_until(lambda: taken.extend(link.take(0.1)) or taken, "the first job", WAIT_S)
    assert rids(taken) == [("PreparedJob", "ok")]
    send(wire.Generate("bad", "fail", None, None, PARAMS))
    send(wire.Shutdown(1.0))  # waits for "bad", which never comes: the link has failed instead
    with pytest.raises(RuntimeError, match="the desk broke"):
        wait_until(lambda: link.take(0.1), "the link to fail", WAIT_S)
    assert link.preparing == 1  # "bad" was never handed over
    assert link.close(flush_s=WAIT_S)
    assert not link._prompts.alive  # every prompt thread is joined
