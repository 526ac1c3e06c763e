"""The request owner's life and every way it ends, over the real worker link and a real socket.

Runs in the pytest process: a real WorkerLink binds an ipc socket, and DEALER sockets in the test
play the workers (they answer Generate with Accepted, send Steps, go silent, or abort), so each
abort path is seen from the worker's side too: which Cancels it gets, and that every slot is back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from gateway.config.models import ModelConfig, ModelLimits
from gateway.errors import APIError, InvalidRequest, RequestTimeout, ServiceUnavailable, WorkerFailed
from gateway.http.serving_path import Formatter, _stream
from gateway.link.handle import WorkerHandle
from gateway.link.worker_link import WorkerLink
from gateway.observability.metrics import GatewayMetrics, RequestRecorder
from gateway.reasoning.parsers import parser_named
from gateway.reasoning.plan import ReasoningPlan
from gateway.serving.admissions import CURRENT
from gateway.serving.choice_text import TextPlan
from gateway.serving.output_queue import KEEPALIVE, OutputQueue
from gateway.serving.outputs import ChoiceInput
from gateway.serving.request_owner import RequestOwner
from gateway.serving.router import ModelRoute
from gateway.serving.service import GenerationService
from tests.harness import async_wait_until
from wire import messages as wire
from wire.params import ChatMessage, ChatOptions, SamplingParams
from wire.results import AbortReason, FinishReason, JobOutput, RejectCode, Usage
from wire.states import WorkerState


class Peer:
    """A scripted worker: a DEALER with the worker's identity on the gateway's socket."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, worker_id: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    async def send(self, message: wire.Message) -> None:
        await self.sock.send(wire.encode(message))

    async def receive(self, timeout: float = 2.0) -> wire.Message:
        return wire.decode(await asyncio.wait_for(self.sock.recv(), timeout))

    async def generates(self, count: int, accept: bool = False) -> list[wire.Generate]:
        """The next `count` Generates; with `accept`, each is accepted as it arrives (a request's
        choices are all sent at once, then their answers awaited)."""
        got: list[wire.Generate] = []
        while len(got) < count:
            message = await self.receive()
            assert isinstance(message, wire.Generate), message
            got.append(message)
            if accept:
                await self.send(wire.Accepted(message.rid, 3))
        return got

    async def cancels(self, link: WorkerLink, worker_id: str) -> set[str]:
        """Every Cancel the link sent this worker so far: a marker sent after them arrives after
        them (one socket keeps its order), so no quiet period has to be guessed."""
        link.send(worker_id, wire.Reintroduce())
        rids = set()
        while not isinstance(message := await self.receive(5.0), wire.Reintroduce):
            assert isinstance(message, wire.Cancel), message
            rids.add(message.rid)
        return rids


@dataclass
class Rig:
    link: WorkerLink
    route: ModelRoute
    service: GenerationService
    peers: dict[str, Peer]
    metrics: GatewayMetrics
    recorders: list[RequestRecorder] = field(default_factory=list)

    def open(
        self,
        n: int = 1,
        deadline_s: float = 10.0,
        streaming: bool = True,
        text_plan: TextPlan | None = None,
        choice_input: ChoiceInput | None = None,
        **params: Any,
    ) -> RequestOwner:
        recorder = RequestRecorder(self.metrics, "m", "/v1/completions")
        self.recorders.append(recorder)
        sampling = SamplingParams(**{"max_tokens": 8, **params})
        loop = asyncio.get_running_loop()
        inputs = [choice_input or ChoiceInput(prompt="hi")] * n
        return self.service.open(self.route, inputs, sampling, loop.time() + deadline_s, recorder, streaming,
                                 text_plan)  # fmt: skip

    async def cancels(self, worker_id: str = "w0") -> set[str]:
        return await self.peers[worker_id].cancels(self.link, worker_id)

    def assert_all_released(self) -> None:
        assert all(r.in_flight == 0 and r.outstanding_tokens == 0 for r in self.route.replicas)
        assert not self.link.jobs_of("w0") and not self.link.jobs_of("w1")
        assert not self.service.requests

    def status(self) -> int:
        """The status the last request was counted with in the metrics."""
        samples = self.metrics.requests.collect()[0].samples
        statuses = [s.labels["status"] for s in samples if s.name.endswith("_total") and s.value]
        return int(statuses[-1])


@asynccontextmanager
async def rig(tmp_path: Path, ready: tuple[str, ...] = ("w0",), **service: float) -> AsyncIterator[Rig]:
    endpoint = f"ipc://{tmp_path}/workers.sock"
    hellos: set[str] = set()
    link = WorkerLink(endpoint, lambda worker_id, message, remote: hellos.add(worker_id))
    await link.start()
    config = ModelConfig(name="m", engine="transformers", path=Path("x"), replicas=2,
                         limits=ModelLimits(max_concurrent_jobs=4))  # fmt: skip
    handles = [WorkerHandle(f"w{i}", config, replica=i) for i in range(2)]
    for handle in handles:
        handle.state = WorkerState.READY if handle.id in ready else WorkerState.LOADING
    for handle in handles:
        link.expect_local(handle.id)  # as the supervisor does before it spawns a worker
    ctx = zmq.asyncio.Context()
    peers = {h.id: Peer(ctx, endpoint, h.id) for h in handles}
    for worker_id, peer in peers.items():  # the ROUTER learns each identity from its first frame
        await peer.send(wire.Hello(wire.PROTOCOL_VERSION, worker_id, 1))
    await async_wait_until(lambda: hellos == set(peers), "the link to hear each peer's Hello")
    generation = GenerationService(link, service.get("keepalive_s", 15.0), service.get("stall_s", 30.0))
    generation.start()
    try:
        yield Rig(link, ModelRoute(config, handles, lambda h: None), generation, peers, GatewayMetrics())
    finally:
        await generation.stop()
        for peer in peers.values():
            peer.sock.close(0)
        ctx.term()
        await link.close()


async def consume(owner: RequestOwner, started: Callable[[], None] | None = None) -> list[Any]:
    """What an HTTP handler does: admit, read every event, close."""
    try:
        await owner.admit()
        if started is not None:
            started()
        events = []
        async for event in owner.events():
            if event is not KEEPALIVE:
                events.append(event)
        return events
    finally:
        owner.close()


def output(
    rid: str, text: str, finish: FinishReason | None = None, ids: list[int] | None = None
) -> JobOutput:
    return JobOutput(rid, text, ids or [1], finish, Usage(3, 2) if finish else None)


def test_a_request_runs_to_its_end_and_gives_everything_back(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with rig(tmp_path) as r:
            owner = r.open(n=2, seed=5)
            handler = asyncio.create_task(consume(owner))
            first, second = await r.peers["w0"].generates(2, accept=True)
            assert (first.params.seed, second.params.seed) == (5, 6)  # choices are not copies
            assert owner.span is None and first.traceparent is None  # tracing is off: no span, no context
            await r.peers["w0"].send(wire.Step([output(first.rid, "a"), output(second.rid, "b")]))
            await r.peers["w0"].send(wire.Step([output(first.rid, "c", FinishReason.STOP)]))
            await r.peers["w0"].send(wire.Step([output(second.rid, "d", FinishReason.LENGTH)]))
            events = await asyncio.wait_for(handler, 2)
            assert [(i, o.text) for i, o in events] == [(0, "a"), (1, "b"), (0, "c"), (1, "d")]
            assert [c.output.text for c in owner.choices] == ["ac", "bd"]
            assert owner.outcome == 200 and r.status() == 200
            assert await r.cancels() == set()  # nothing to cancel: both finished
            r.assert_all_released()

    asyncio.run(scenario())


def test_each_generate_says_how_many_requests_the_gateway_is_still_admitting(tmp_path: Path) -> None:
    """Generate.following: the requests begun and not yet sent that may go to this model (read far
    enough to be for it, or not read far enough to know), and the request's own later choices."""

    async def scenario() -> None:
        async with rig(tmp_path) as r:
            admissions = r.service.admissions
            elsewhere, unread, behind = admissions.begin(), admissions.begin(), admissions.begin()
            elsewhere.route("another-model")
            behind.route("m")

            async def request(n: int) -> list[Any]:
                CURRENT.set(admissions.begin())  # what the HTTP layer does as the request begins
                return await consume(r.open(n=n))

            handler = asyncio.create_task(request(2))
            first, second = await r.peers["w0"].generates(2, accept=True)
            assert (first.following, second.following) == (3, 2)
            assert (admissions.behind("m"), admissions.total) == (2, 3)  # its own admission ended
            for choice in (first, second):
                await r.peers["w0"].send(wire.Step([output(choice.rid, "a", FinishReason.STOP)]))
            await asyncio.wait_for(handler, 2)
            unread.end()
            behind.end()
            handler = asyncio.create_task(request(1))
            (lone,) = await r.peers["w0"].generates(1, accept=True)
            assert lone.following == 0  # another model's request is no reason to wait
            await r.peers["w0"].send(wire.Step([output(lone.rid, "a", FinishReason.STOP)]))
            await asyncio.wait_for(handler, 2)
            elsewhere.end()
            assert admissions.total == 0
            r.assert_all_released()

    asyncio.run(scenario())


def test_a_request_waiting_for_a_slot_is_not_counted_as_coming(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with rig(tmp_path) as r:
            admissions = r.service.admissions
            full = asyncio.create_task(consume(r.open(n=4)))  # every slot of the one ready replica
            jobs = await r.peers["w0"].generates(4, accept=True)

            async def request() -> list[Any]:
                CURRENT.set(admissions.begin())
                return await consume(r.open())

            queued = asyncio.create_task(request())
            await async_wait_until(lambda: r.route.waiting == 1, "the request to wait for a slot")
            assert admissions.total == 0
            for job in jobs:
                await r.peers["w0"].send(wire.Step([output(job.rid, "a", FinishReason.STOP)]))
            (late,) = await r.peers["w0"].generates(1, accept=True)
            assert late.following == 0
            await r.peers["w0"].send(wire.Step([output(late.rid, "a", FinishReason.STOP)]))
            await asyncio.wait_for(asyncio.gather(full, queued), 2)
            r.assert_all_released()

    asyncio.run(scenario())


def test_prompt_tokens_found_in_the_engines_cache_are_counted_once_per_prompt(tmp_path: Path) -> None:
    """Two choices of one prompt each report the same 2 cached tokens of its 3: the metrics count the
    prompt once, like the usage's prompt_tokens_details.cached_tokens."""

    def counted(metric: Any) -> float:
        return sum(s.value for s in metric.collect()[0].samples if s.name.endswith("_total"))

    async def scenario() -> None:
        async with rig(tmp_path) as r:
            owner = r.open(n=2)
            handler = asyncio.create_task(consume(owner))
            first, second = await r.peers["w0"].generates(2, accept=True)
            for job in (first, second):
                finished = JobOutput(job.rid, "a", [1], FinishReason.STOP, Usage(3, 1, cached_tokens=2))
                await r.peers["w0"].send(wire.Step([finished]))
            await asyncio.wait_for(handler, 2)
            assert owner.outcome == 200
            assert (counted(r.metrics.prompt_tokens), counted(r.metrics.cached_prompt_tokens)) == (3, 2)

    asyncio.run(scenario())


@pytest.mark.parametrize("when", ["waiting for acceptance", "mid-stream"])
def test_client_disconnect_cancels_every_unfinished_job(tmp_path: Path, when: str) -> None:
    async def scenario() -> None:
        async with rig(tmp_path) as r:
            owner = r.open(n=2)
            handler = asyncio.create_task(consume(owner))
            mid_stream = when == "mid-stream"
            generates = await r.peers["w0"].generates(2, accept=mid_stream)
            if mid_stream:
                await r.peers["w0"].send(wire.Step([output(generates[0].rid, "x", FinishReason.STOP)]))
                await async_wait_until(lambda: owner.choices[0].finished, "choice 0 to finish")
            handler.cancel()  # what Quart does when the client goes away
            with pytest.raises(asyncio.CancelledError):
                await handler
            # Mid-stream the finished choice needs no Cancel; waiting, both were sent and are cancelled.
            expected = {generates[1].rid} if mid_stream else {g.rid for g in generates}
            assert await r.cancels() == expected
            assert owner.outcome == 499 and r.status() == 499
            r.assert_all_released()

    asyncio.run(scenario())


def test_deadline_ends_the_stream_and_cancels(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with rig(tmp_path) as r:
            owner = r.open(deadline_s=0.3)
            handler = asyncio.create_task(consume(owner))
            (generate,) = await r.peers["w0"].generates(1)
            await r.peers["w0"].send(wire.Accepted(generate.rid, 3))
            with pytest.raises(RequestTimeout):
                await asyncio.wait_for(handler, 2)
            assert await r.cancels() == {generate.rid}
            assert owner.outcome == 408
            r.assert_all_released()

    asyncio.run(scenario())


def test_worker_death_ends_the_stream_with_worker_failed(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with rig(tmp_path) as r:
            owner = r.open()
            handler = asyncio.create_task(consume(owner))
            (generate,) = await r.peers["w0"].generates(1)
            await r.peers["w0"].send(wire.Accepted(generate.rid, 3))
            await r.peers["w0"].send(wire.Step([output(generate.rid, "x")]))
            await async_wait_until(lambda: owner.choices[0].output.text == "x", "the handler to read 'x'")
            r.link.fail_worker("w0", WorkerFailed("the worker for model 'm' failed: killed by signal 9"))
            with pytest.raises(WorkerFailed, match="killed by signal 9"):
                await asyncio.wait_for(handler, 2)
            assert owner.outcome == 503 and owner.choices[0].output.text == "x"
            r.assert_all_released()

    asyncio.run(scenario())


def test_a_job_whose_replica_dies_before_accepting_moves_to_another(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with rig(tmp_path, ready=("w0", "w1")) as r:
            owner = r.open()
            handler = asyncio.create_task(consume(owner))
            generates = []
            for worker_id in ("w0", "w1"):  # least work first: w0, then (once w0 died) w1
                try:
                    (generate,) = await r.peers[worker_id].generates(1)
                except asyncio.TimeoutError:
                    continue
                generates.append((worker_id, generate))
                if worker_id == "w0":
                    r.route.replicas[0].state = WorkerState.RESTARTING
                    r.link.fail_worker("w0", WorkerFailed("w0 died"))
            assert [w for w, _ in generates] == ["w0", "w1"]
            _, moved = generates[1]
            await r.peers["w1"].send(wire.Accepted(moved.rid, 3))
            await r.peers["w1"].send(wire.Step([output(moved.rid, "ok", FinishReason.STOP)]))
            events = await asyncio.wait_for(handler, 2)
            assert [o.text for _, o in events] == ["ok"] and owner.outcome == 200
            r.assert_all_released()

    asyncio.run(scenario())


def test_a_job_refused_by_a_replica_that_began_to_unload_moves_to_another(tmp_path: Path) -> None:
    """A worker told to unload (a reload, an idle unload) refuses what its gateways sent before
    they heard: it started nothing, so the request tries the other replica, not the client."""

    async def scenario() -> None:
        async with rig(tmp_path, ready=("w0", "w1")) as r:
            owner = r.open()
            handler = asyncio.create_task(consume(owner))
            (refused,) = await r.peers["w0"].generates(1)
            await r.peers["w0"].send(wire.Rejected(refused.rid, RejectCode.SHUTTING_DOWN, "unloading", None))
            (moved,) = await r.peers["w1"].generates(1)
            await r.peers["w1"].send(wire.Accepted(moved.rid, 3))
            await r.peers["w1"].send(wire.Step([output(moved.rid, "ok", FinishReason.STOP)]))
            events = await asyncio.wait_for(handler, 2)
            assert [o.text for _, o in events] == ["ok"] and owner.outcome == 200
            r.assert_all_released()

    asyncio.run(scenario())


def test_a_refused_job_is_an_http_error_before_any_stream(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with rig(tmp_path) as r:
            owner = r.open(n=2)
            handler = asyncio.create_task(consume(owner))
            generate, other = await r.peers["w0"].generates(2)  # both choices go out at once
            await r.peers["w0"].send(
                wire.Rejected(generate.rid, RejectCode.CONTEXT_LENGTH_EXCEEDED, "too long", "messages")
            )
            with pytest.raises(InvalidRequest) as refused:
                await asyncio.wait_for(handler, 2)
            assert refused.value.code == "context_length_exceeded" and refused.value.param == "messages"
            assert owner.outcome == 400
            assert await r.cancels() == {other.rid}  # the other choice is called off
            r.assert_all_released()

    asyncio.run(scenario())


@pytest.mark.parametrize("who", ["worker drains past its grace", "gateway shuts down"])
def test_shutdown_ends_streams_with_shutting_down(tmp_path: Path, who: str) -> None:
    async def scenario() -> None:
        async with rig(tmp_path) as r:
            owner = r.open()
            handler = asyncio.create_task(consume(owner))
            (generate,) = await r.peers["w0"].generates(1)
            await r.peers["w0"].send(wire.Accepted(generate.rid, 3))
            await async_wait_until(lambda: owner.admitted, "the request to be admitted")
            if who == "gateway shuts down":
                r.service.abort_all(ServiceUnavailable("the server is shutting down", code="shutting_down"))
            else:
                reason = AbortReason.SHUTDOWN
                await r.peers["w0"].send(
                    wire.JobsAborted([generate.rid], reason, "the server is shutting down")
                )
            with pytest.raises(ServiceUnavailable) as ended:
                await asyncio.wait_for(handler, 2)
            assert ended.value.code == "shutting_down" and owner.outcome == 503
            r.assert_all_released()

    asyncio.run(scenario())


def test_a_client_that_stops_reading_is_dropped_by_the_ticker(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with rig(tmp_path, stall_s=0.2) as r:
            owner = r.open()

            async def handler() -> None:  # admits, then never reads
                try:
                    await owner.admit()
                    await asyncio.Event().wait()  # never set: only the dropped connection ends this
                finally:
                    owner.close()

            task = asyncio.create_task(handler())
            (generate,) = await r.peers["w0"].generates(1)
            await r.peers["w0"].send(wire.Accepted(generate.rid, 3))
            await r.peers["w0"].send(wire.Step([output(generate.rid, "unread")]))
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 2)  # the connection is dropped
            assert await r.cancels() == {generate.rid}
            assert owner.outcome == 503
            r.assert_all_released()

    asyncio.run(scenario())


def test_frames_about_a_job_count_only_from_the_worker_that_holds_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with rig(tmp_path, ready=("w0",)) as r:
            owner = r.open()
            handler = asyncio.create_task(consume(owner))
            (generate,) = await r.peers["w0"].generates(1)
            await r.peers["w1"].send(wire.Accepted(generate.rid, 99))  # not w1's job: ignored
            await r.peers["w0"].send(wire.Accepted(generate.rid, 3))
            await r.peers["w1"].send(wire.Step([output(generate.rid, "forged", FinishReason.STOP)]))
            await r.peers["w0"].send(wire.Step([output(generate.rid, "real", FinishReason.STOP)]))
            events = await asyncio.wait_for(handler, 2)
            assert [o.text for _, o in events] == ["real"]
            assert owner.choices[0].output.prompt_tokens == 3
            r.assert_all_released()

    asyncio.run(scenario())


def test_quiet_streams_get_keepalives_and_non_streams_do_not(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with rig(tmp_path, keepalive_s=0.1) as r:
            # Both requests are quiet over the same ticks: the non-streamed one opens first, so each
            # tick that finds the streamed one quiet finds it quiet too. No window of time to guess.
            owners = {streaming: r.open(streaming=streaming) for streaming in (False, True)}
            seen: dict[bool, list[Any]] = {False: [], True: []}

            async def handler(streaming: bool) -> None:
                owner = owners[streaming]
                try:
                    await owner.admit()
                    async for event in owner.events():
                        seen[streaming].append(event)
                finally:
                    owner.close()

            tasks = [asyncio.create_task(handler(streaming)) for streaming in (False, True)]
            generates = await r.peers["w0"].generates(2, accept=True)

            def keepalives(streaming: bool) -> int:
                return sum(1 for e in seen[streaming] if e is KEEPALIVE)

            await async_wait_until(lambda: keepalives(True) >= 2, "two keepalives on the quiet stream")
            for generate in generates:
                await r.peers["w0"].send(wire.Step([output(generate.rid, "late", FinishReason.STOP)]))
            await asyncio.wait_for(asyncio.gather(*tasks), 2)
            assert keepalives(False) == 0, seen[False]
            assert [o.text for _, o in (e for e in seen[False] if e is not KEEPALIVE)] == ["late"]
            r.assert_all_released()

    asyncio.run(scenario())


def test_errors_carry_the_openai_shape() -> None:
    body = ServiceUnavailable("x", code="slow_reader").body()
    assert body == {"error": {"message": "x", "type": "service_unavailable_error", "param": None,
                              "code": "slow_reader"}}  # fmt: skip
    assert isinstance(RequestTimeout("t"), APIError) and RequestTimeout.status == 408


def test_an_abort_ends_an_admission_waiting_for_a_slot(tmp_path: Path) -> None:
    """What a reload that removes a model, or an unload, does to requests still queued for it."""

    async def scenario() -> None:
        async with rig(tmp_path) as r:
            r.route.config = r.route.config.model_copy(update={"limits": ModelLimits(max_concurrent_jobs=1)})
            holder = r.open()
            holding = asyncio.create_task(consume(holder))
            (generate,) = await r.peers["w0"].generates(1, accept=True)
            queued = r.open()
            waiting = asyncio.create_task(consume(queued))
            await async_wait_until(lambda: r.route.waiting == 1, "the second request to queue for the slot")
            assert not queued.admitted
            removed = ServiceUnavailable("model 'm' was removed by a reload", code="model_removed")
            assert r.service.abort_queued("m", removed) == 1  # the running request is not touched
            with pytest.raises(ServiceUnavailable) as ended:
                await asyncio.wait_for(waiting, 1)
            assert ended.value.code == "model_removed" and queued.outcome == 503
            assert r.route.waiting == 0
            # The request that had its slot runs on, until the drain's grace is over.
            assert not holding.done()
            reloading = ServiceUnavailable("model 'm' is reloading with new settings", code="model_reloading")
            assert r.service.abort_on_worker("w0", reloading) == 1
            with pytest.raises(ServiceUnavailable, match="reloading"):
                await asyncio.wait_for(holding, 1)
            assert await r.cancels() == {generate.rid}
            r.assert_all_released()

    asyncio.run(scenario())


def test_queued_outputs_come_out_as_one_batch_and_an_abort_still_delivers_them(tmp_path: Path) -> None:
    """A streaming response writes each batch as one chunk: everything queued when the consumer
    gets to it, in order; what arrived before an abort goes out before the error."""

    async def scenario() -> None:
        async with rig(tmp_path) as r:
            owner = r.open(n=2)
            await asyncio.wait_for(asyncio.gather(owner.admit(), r.peers["w0"].generates(2, accept=True)), 2)
            first, second = (choice.rid for choice in owner.choices)
            batches = owner.event_batches()
            # Both choices' outputs of one step, then a second step, all queued before reading.
            await r.peers["w0"].send(wire.Step([output(first, "a"), output(second, "b")]))
            await r.peers["w0"].send(wire.Step([output(first, "c")]))
            await async_wait_until(lambda: owner.queue.qsize() == 3, "three outputs queued")
            batch = await asyncio.wait_for(batches.__anext__(), 1)
            assert [(i, o.text) for i, o in batch] == [(0, "a"), (1, "b"), (0, "c")]
            await r.peers["w0"].send(wire.Step([output(second, "d")]))
            await async_wait_until(lambda: owner.queue.qsize() == 1, "the fourth output queued")
            owner.abort(ServiceUnavailable("stop", code="shutting_down"))
            batch = await asyncio.wait_for(batches.__anext__(), 1)
            assert [(i, o.text) for i, o in batch] == [(1, "d")]
            with pytest.raises(ServiceUnavailable):
                await batches.__anext__()
            owner.close()
            assert await r.cancels() == {first, second}
            r.assert_all_released()

    asyncio.run(scenario())


def test_tokenize_and_embeddings_are_live_requests_that_drains_reloads_and_shutdowns_end(
    tmp_path: Path,
) -> None:
    """One-shot exchanges have an owner too: the service counts them (a drain waits for them), a
    reload of their worker and a shutdown end them with the reason, and an embedding's slot comes
    back whatever way it ends."""

    async def scenario() -> None:
        async with rig(tmp_path) as r:
            loop = asyncio.get_running_loop()

            def tokenize(rid: str) -> wire.Tokenize:
                return wire.Tokenize(rid, "hi", None, True)

            answered = asyncio.create_task(r.service.open_exchange(r.route, loop.time() + 5).run(tokenize))
            message = await r.peers["w0"].receive()
            assert isinstance(message, wire.Tokenize) and r.service.in_flight == 1
            await r.peers["w0"].send(wire.Tokens(message.rid, [1, 2], "hi"))
            assert (await asyncio.wait_for(answered, 2)).token_ids == [1, 2]
            assert r.service.in_flight == 0

            reloaded = asyncio.create_task(r.service.open_exchange(r.route, loop.time() + 5).run(tokenize))
            assert isinstance(await r.peers["w0"].receive(), wire.Tokenize)  # never answered
            assert (
                r.service.abort_on_worker("w0", ServiceUnavailable("reloading", code="model_reloading")) == 1
            )
            with pytest.raises(ServiceUnavailable, match="reloading"):
                await asyncio.wait_for(reloaded, 2)

            def embed(rid: str) -> wire.Embed:
                return wire.Embed(rid, ["a"], None)

            embedding = asyncio.create_task(
                r.service.open_exchange(r.route, loop.time() + 5).run(embed, slot_work=3)
            )
            assert isinstance(await r.peers["w0"].receive(), wire.Embed)
            assert r.route.replicas[0].in_flight == 1 and r.service.in_flight == 1  # it holds a slot
            r.service.abort_all(ServiceUnavailable("the server is shutting down", code="shutting_down"))
            with pytest.raises(ServiceUnavailable) as ended:
                await asyncio.wait_for(embedding, 2)
            assert ended.value.code == "shutting_down"

            timed_out = r.service.open_exchange(r.route, loop.time() + 0.2).run(embed, slot_work=3)
            with pytest.raises(RequestTimeout):
                await asyncio.wait_for(timed_out, 2)
            r.assert_all_released()

    asyncio.run(scenario())


CHAT = ChoiceInput(messages=[ChatMessage("user", "hi")], chat=ChatOptions())
SCHEMA = {"json_object": False, "json_schema": '{"type":"object"}', "regex": None, "compact_json": True}


def thinking(budget: int | None, withheld: dict[str, Any] | None = None) -> TextPlan:
    return TextPlan(reasoning=ReasoningPlan(parser_named("deepseek_r1"), budget, withheld))


@pytest.mark.parametrize("keep", [None, 2])
def test_a_spent_thinking_budget_closes_the_thinking_and_the_answer_continues(
    tmp_path: Path, keep: int | None
) -> None:
    """The job is cancelled at the budget; the continuation's prompt is the prompt, every token so
    far and the closing tag, all tokenized by the same worker; the constraint held back while the
    model thought applies to it; the choice's usage spans both jobs. With truncate_prompt_tokens the
    continuation keeps the part of the prompt the first job saw, then adds what it wrote: the cut
    is not applied again to the prompt and the thinking together."""

    async def scenario() -> None:
        async with rig(tmp_path) as r:
            owner = r.open(text_plan=thinking(3, SCHEMA), choice_input=CHAT, max_tokens=10, min_tokens=5,
                           truncate_prompt_tokens=keep)  # fmt: skip
            handler = asyncio.create_task(consume(owner))
            peer = r.peers["w0"]
            (first,) = await peer.generates(1, accept=True)
            assert first.messages is not None and first.params.json_schema is None  # free to think
            await peer.send(wire.Step([output(first.rid, "a", ids=[11])]))
            await peer.send(wire.Step([output(first.rid, "b", ids=[12])]))
            await peer.send(wire.Step([output(first.rid, "c", ids=[13])]))  # the third thinking token
            assert await peer.receive() == wire.Cancel(first.rid)
            prompt = await peer.receive()
            assert isinstance(prompt, wire.Tokenize) and prompt.messages == CHAT.messages
            await peer.send(wire.Tokens(prompt.rid, [1, 2, 3], "hi"))
            closing = await peer.receive()
            assert isinstance(closing, wire.Tokenize) and closing.prompt == "\n</think>\n\n"
            assert not closing.add_special_tokens
            await peer.send(wire.Tokens(closing.rid, [9, 9], "\n</think>\n\n"))
            (second,) = await peer.generates(1, accept=True)
            seen = [1, 2, 3] if keep is None else [1, 2, 3][-keep:]
            assert second.prompt_token_ids == [*seen, 11, 12, 13, 9, 9] and second.messages is None
            params = second.params
            assert params.truncate_prompt_tokens is None
            assert (params.max_tokens, params.min_tokens, params.json_schema) == (7, 2, '{"type":"object"}')
            await peer.send(wire.Step([output(second.rid, "{}", FinishReason.STOP)]))
            events = await asyncio.wait_for(handler, 2)
            assert [(d.reasoning, d.text) for _, d in events] == [("a", ""), ("b", ""), ("c", ""), ("", "{}")]
            state = owner.choices[0].output
            assert (state.reasoning, state.text, state.finish_reason) == ("abc", "{}", FinishReason.STOP)
            assert (state.prompt_tokens, state.completion_tokens, state.reasoning_tokens) == (3, 5, 3)
            assert await r.cancels() == set()
            r.assert_all_released()

    asyncio.run(scenario())


def test_the_end_of_thinking_hands_over_to_the_constrained_answer(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with rig(tmp_path) as r:
            owner = r.open(text_plan=thinking(None, SCHEMA), choice_input=CHAT, max_tokens=10)
            handler = asyncio.create_task(consume(owner))
            peer = r.peers["w0"]
            (first,) = await peer.generates(1, accept=True)
            await peer.send(wire.Step([output(first.rid, "done</think>", ids=[11, 12])]))
            assert await peer.receive() == wire.Cancel(first.rid)
            prompt = await peer.receive()
            assert isinstance(prompt, wire.Tokenize)
            await peer.send(wire.Tokens(prompt.rid, [1], "hi"))  # no closing tag: the model closed it
            (second,) = await peer.generates(1)
            assert second.prompt_token_ids == [1, 11, 12] and second.params.json_schema is not None
            # No room left in the context: the choice ends by length.
            await peer.send(wire.Rejected(second.rid, RejectCode.CONTEXT_LENGTH_EXCEEDED, "too long", None))
            events = await asyncio.wait_for(handler, 2)
            assert events[-1][1].finish_reason is FinishReason.LENGTH
            assert owner.choices[0].output.reasoning == "done" and owner.outcome == 200
            r.assert_all_released()

    asyncio.run(scenario())


def test_an_abort_during_a_continuation_ends_it_and_gives_everything_back(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with rig(tmp_path) as r:
            owner = r.open(text_plan=thinking(1), choice_input=CHAT, deadline_s=0.5)
            handler = asyncio.create_task(consume(owner))
            peer = r.peers["w0"]
            (first,) = await peer.generates(1, accept=True)
            await peer.send(wire.Step([output(first.rid, "a")]))
            assert await peer.receive() == wire.Cancel(first.rid)
            assert isinstance(await peer.receive(), wire.Tokenize)  # never answered: the deadline passes
            with pytest.raises(RequestTimeout):
                await asyncio.wait_for(handler, 2)
            assert owner.outcome == 408
            r.assert_all_released()

    asyncio.run(scenario())


def test_output_queue_wakes_its_consumer_and_survives_a_cancelled_wait() -> None:
    """The request's queue: a consumer waiting for an item wakes when one is put; one whose wait was
    cancelled (its client left) leaves nothing behind that breaks a later put or wait."""

    async def scenario() -> None:
        queue = OutputQueue()
        waiting = asyncio.ensure_future(queue.get())
        await asyncio.sleep(0)
        queue.put_nowait("a")
        assert await asyncio.wait_for(waiting, 1) == "a"
        abandoned = asyncio.ensure_future(queue.arrival())
        await asyncio.sleep(0)
        abandoned.cancel()
        queue.put_nowait("b")
        queue.put_nowait("c")
        assert queue.qsize() == 2
        assert queue.arrival().done()  # items are waiting: no wait at all
        assert queue.take_all() == ["b", "c"] and queue.empty()
        later = asyncio.ensure_future(queue.get())
        await asyncio.sleep(0)
        queue.put_nowait("d")
        assert await asyncio.wait_for(later, 1) == "d"

    asyncio.run(scenario())


class Marks(Formatter):
    """A formatter whose writes show what each one held."""

    def chunk(self, owner: RequestOwner, index: int, delta: Any) -> bytes:
        return f"[{index}:{delta.text}]".encode()

    def closing(self, owner: RequestOwner) -> bytes:
        return b"<end>"

    def stream_error(self, error: APIError) -> bytes:
        return f"<error {error.code}>".encode()


@pytest.mark.parametrize("ending", ["finish", "abort"])
def test_the_last_outputs_go_out_in_one_write_with_the_end_of_the_stream(tmp_path: Path, ending: str) -> None:
    """Every batch is one write; the batch that ends the request carries the stream's end (or its
    error event) in the same write, after its outputs."""

    async def scenario() -> None:
        async with rig(tmp_path) as r:
            owner = r.open()
            await asyncio.wait_for(asyncio.gather(owner.admit(), r.peers["w0"].generates(1, accept=True)), 2)
            rid = owner.choices[0].rid
            body = _stream(owner, Marks())
            await r.peers["w0"].send(wire.Step([output(rid, "a")]))
            assert await asyncio.wait_for(body.__anext__(), 1) == b"[0:a]"
            if ending == "finish":
                await r.peers["w0"].send(wire.Step([output(rid, "b", FinishReason.STOP)]))
                last = b"[0:b]<end>"
            else:
                await r.peers["w0"].send(wire.Step([output(rid, "b")]))
                await async_wait_until(lambda: owner.queue.qsize() == 1, "the output queued")
                owner.abort(ServiceUnavailable("stop", code="shutting_down"))
                last = b"[0:b]<error shutting_down>"
            assert await asyncio.wait_for(body.__anext__(), 1) == last
            with pytest.raises(StopAsyncIteration):
                await body.__anext__()
            r.assert_all_released()

    asyncio.run(scenario())


class StoringMarks(Marks):
    """Marks whose finish waits for a store (a round trip to Redis, say) until `stored` is set."""

    def __init__(self) -> None:
        self.stored = asyncio.Event()

    def finishing(self, owner: RequestOwner) -> Any:
        return self.stored.wait


def test_the_last_outputs_do_not_wait_for_the_formatters_finish(tmp_path: Path) -> None:
    """A formatter with work to do before the end (storing a response) gets the last outputs
    written first: they go out at once, the end once its work is done."""

    async def scenario() -> None:
        async with rig(tmp_path) as r:
            owner = r.open()
            await asyncio.wait_for(asyncio.gather(owner.admit(), r.peers["w0"].generates(1, accept=True)), 2)
            rid = owner.choices[0].rid
            formatter = StoringMarks()
            body = _stream(owner, formatter)
            await r.peers["w0"].send(wire.Step([output(rid, "b", FinishReason.STOP)]))
            assert await asyncio.wait_for(body.__anext__(), 1) == b"[0:b]"
            end = asyncio.ensure_future(body.__anext__())
            await asyncio.sleep(0)
            assert not end.done()
            formatter.stored.set()
            assert await asyncio.wait_for(end, 1) == b"<end>"
            with pytest.raises(StopAsyncIteration):
                await body.__anext__()
            r.assert_all_released()

    asyncio.run(scenario())
