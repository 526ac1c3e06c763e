"""The router's policy: which replica takes a request, when a request waits, and when it is refused.

Runs ModelRoute on real WorkerHandles in this process; no worker processes are needed for the policy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from gateway.config.models import ModelConfig, ModelLimits
from gateway.config.registry import Registry
from gateway.errors import InvalidRequest, ModelNotFound, QueueFull, RequestTimeout, ServiceUnavailable
from gateway.link.handle import WorkerHandle
from gateway.serving.router import AdmissionStopped, ModelRoute, ReplicasExhausted, Router
from tests.harness import async_wait_until, settle
from wire.states import WorkerState

S = WorkerState
T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


def model(**limits: Any) -> ModelConfig:
    return ModelConfig(
        name="m", engine="transformers", path=Path("x"), replicas=3, limits=ModelLimits(**limits)
    )


def replicas(config: ModelConfig, *states: WorkerState) -> list[WorkerHandle]:
    handles = [WorkerHandle(f"m#0-r{i}", config, replica=i) for i in range(len(states))]
    for handle, state in zip(handles, states, strict=True):
        handle.state = state
    return handles


def route_of(*states: WorkerState, launched: list[WorkerHandle] | None = None, **limits: Any) -> ModelRoute:
    config = model(**limits)
    return ModelRoute(config, replicas(config, *states), (launched if launched is not None else []).append)


def soon() -> float:
    return time.monotonic() + 5


async def waiting(route: ModelRoute, count: int) -> None:
    await async_wait_until(lambda: route.waiting == count, f"{count} request(s) waiting on the route")


def test_least_outstanding_work_wins_then_fewest_requests_then_lowest_replica() -> None:
    route = route_of(S.READY, S.READY, S.READY)

    async def scenario() -> list[str]:
        picks = [await route.acquire(soon(), work=100)]  # all equal: the lowest replica
        picks.append(await route.acquire(soon(), work=10))  # r1 and r2 have 0 outstanding: r1
        picks.append(await route.acquire(soon(), work=50))  # r2 has 0
        picks.append(await route.acquire(soon(), work=1))  # r1 holds the least (10)
        route.release(picks[0], 100)
        picks.append(await route.acquire(soon(), work=1))  # r0 is empty again
        return [p.id for p in picks]

    assert run(scenario()) == ["m#0-r0", "m#0-r1", "m#0-r2", "m#0-r1", "m#0-r0"]
    r0, r1, r2 = route.replicas
    assert (r0.outstanding_tokens, r1.outstanding_tokens, r2.outstanding_tokens) == (1, 11, 50)
    assert (r0.in_flight, r1.in_flight, r2.in_flight) == (1, 2, 1)


def test_only_ready_replicas_outside_avoid_with_a_free_slot_take_requests() -> None:
    route = route_of(S.LOADING, S.READY, S.READY, max_concurrent_jobs=1)

    async def scenario() -> list[str]:
        first = await route.acquire(soon(), avoid=frozenset({"m#0-r1"}))
        second = await route.acquire(soon())  # r2 is full (1 slot), r0 is loading: r1
        return [first.id, second.id]

    assert run(scenario()) == ["m#0-r2", "m#0-r1"]


def test_a_full_model_queues_then_refuses_with_the_configured_status() -> None:
    for status, error in ((429, QueueFull), (503, ServiceUnavailable)):
        route = route_of(S.READY, max_concurrent_jobs=1, max_queued_requests=1, full_queue_status=status)

        async def scenario(
            route: ModelRoute = route, status: int = status, error: type[Exception] = error
        ) -> str:
            holder = await route.acquire(soon())
            waiter = asyncio.create_task(route.acquire(soon()))
            await waiting(route, 1)
            # The queue (1) is full: refused at once. A wait could only have ended with the slot
            # (still held here) or at the deadline (RequestTimeout), so the error shows it did not.
            with pytest.raises(error) as refused:
                await route.acquire(soon())
            assert refused.value.headers == {"Retry-After": "1"} and refused.value.status == status
            assert not waiter.done()
            route.release(holder)
            taken = await asyncio.wait_for(waiter, 1)  # the waiter gets the freed slot
            return taken.id

        assert run(scenario()) == "m#0-r0" and route.waiting == 0


def test_queued_prompt_tokens_are_bounded_too() -> None:
    route = route_of(S.READY, max_concurrent_jobs=1, max_queued_prompt_tokens=100)

    async def scenario() -> None:
        await route.acquire(soon())
        waiter = asyncio.create_task(route.acquire(soon(), prompt_size=80))
        await waiting(route, 1)
        with pytest.raises(QueueFull):
            await route.acquire(soon(), prompt_size=30)  # 80 + 30 > 100
        waiter.cancel()

    run(scenario())
    assert route.waiting == 0 and route.waiting_prompt_tokens == 0


def test_waiting_ends_at_the_deadline() -> None:
    route = route_of(S.READY, max_concurrent_jobs=1)

    async def scenario() -> None:
        await route.acquire(soon())
        with pytest.raises(RequestTimeout):
            await route.acquire(time.monotonic() + 0.05)

    run(scenario())


def test_a_wait_for_the_last_replica_outside_avoid_ends_when_that_replica_is_lost() -> None:
    """r0 refused this request (full); it waits for r1, which is busy. When r1 is lost, waiting on
    could only end at the deadline and would hold every request queued behind it."""
    route = route_of(S.READY, S.READY, max_concurrent_jobs=1)
    r0, r1 = route.replicas

    async def scenario() -> None:
        await route.acquire(soon(), avoid=frozenset({r0.id}))  # r1's one slot is taken
        waiter = asyncio.create_task(route.acquire(soon(), avoid=frozenset({r0.id})))
        behind = asyncio.create_task(route.acquire(soon()))
        await waiting(route, 2)
        r1.state = S.FAILED
        route.notify()
        with pytest.raises(ReplicasExhausted):
            await asyncio.wait_for(waiter, 1)
        assert (await asyncio.wait_for(behind, 1)) is r0  # the one behind it goes on at once

    run(scenario())


def test_a_model_that_cannot_serve_is_refused_at_once_with_its_reasons() -> None:
    route = route_of(S.FAILED, S.LOST)
    route.replicas[0].detail = "5 failed starts; last: exited with code 1"
    with pytest.raises(ServiceUnavailable, match="5 failed starts") as refused:
        run(route.acquire(soon()))
    assert "is unavailable" in refused.value.message
    assert not route.has_other_replica(frozenset())
    assert route.state is S.LOST  # its best replica's state


def test_unloaded_models_load_on_demand_or_say_how_to_load() -> None:
    launched: list[WorkerHandle] = []
    on_demand = ModelConfig(name="m", engine="transformers", path=Path("x"), load="on_demand")
    route = ModelRoute(on_demand, replicas(on_demand, S.UNLOADED), launched.append)

    async def scenario() -> None:
        with pytest.raises(RequestTimeout):  # it waits for the load (here: never comes)
            await route.acquire(time.monotonic() + 0.05)

    run(scenario())
    assert {h.id for h in launched} == {"m#0-r0"}  # asked to launch (the supervisor makes it idempotent)

    manual = route_of(S.UNLOADED)
    with pytest.raises(ServiceUnavailable, match="POST /admin/models/m/load"):
        run(manual.acquire(soon()))


def test_an_on_demand_model_loads_its_unloaded_replicas_when_the_others_are_lost() -> None:
    on_demand = ModelConfig(name="m", engine="transformers", path=Path("x"), load="on_demand")
    for states, loads in (
        ((S.LOST, S.UNLOADED), {"m#0-r1"}),  # a standby worker beside a lost one: loaded
        ((S.FAILED, S.UNLOADED, S.UNLOADED), {"m#0-r1", "m#0-r2"}),
        ((S.RESTARTING, S.UNLOADED), set()),  # one is on its way back: the request waits for it
        ((S.LOADING, S.UNLOADED), set()),
    ):
        launched: list[WorkerHandle] = []
        route = ModelRoute(on_demand, replicas(on_demand, *states), launched.append)
        # A model it loads for the request keeps it (no fallback); one on its way is not ready yet.
        assert route.fallback_reason(1, 10) == (None if loads else "no_ready_worker"), states

        async def scenario(route: ModelRoute = route) -> None:
            with pytest.raises(RequestTimeout):  # the load never comes here
                await route.acquire(time.monotonic() + 0.05)

        run(scenario())
        assert {h.id for h in launched} == loads, states


def test_a_request_moves_only_to_a_replica_that_may_still_serve() -> None:
    route = route_of(S.READY, S.RESTARTING, S.FAILED)
    assert route.has_other_replica(frozenset({"m#0-r0"}))  # r1 comes back after its restart
    assert not route.has_other_replica(frozenset({"m#0-r0", "m#0-r1"}))  # r2 gave up


def test_router_names_aliases_and_deadlines() -> None:
    config = ModelConfig(name="m", engine="transformers", path=Path("x"), aliases=["alias"],
                         limits=ModelLimits(request_timeout_s=30))  # fmt: skip
    router = Router(Registry(models=[config]), replicas(config, S.READY), lambda handle: None)
    assert router.route("alias") is router.route("m")
    with pytest.raises(ModelNotFound):
        router.route("nope")
    route = router.route("m")
    # Each deadline is read between two clock readings: exact, however slow the machine.
    for requested, timeout in ((10, 10), (3600, 30), (None, 30)):  # a longer one is capped by the model's
        before = time.monotonic()
        deadline = router.deadline_for(route, requested)
        assert before + timeout <= deadline <= time.monotonic() + timeout, requested


@pytest.mark.parametrize("how", ["stop future", "task cancelled"])
def test_a_waiter_leaves_even_when_a_notify_lands_in_the_same_tick(how: str) -> None:
    """On Python 3.11, asyncio.wait_for around Condition.wait() can swallow a cancellation that
    coincides with a notify; the waiter then sat out its whole deadline. It must leave at once."""
    route = route_of(S.READY, max_concurrent_jobs=1)

    async def scenario() -> None:
        await route.acquire(soon())
        stop = asyncio.get_running_loop().create_future()
        waiter = asyncio.create_task(route.acquire(time.monotonic() + 60, stop=stop))
        await waiting(route, 1)
        route.notify()  # something changed, but the slot is still taken
        if how == "stop future":
            stop.set_result(None)
        else:
            waiter.cancel()
        expected = AdmissionStopped if how == "stop future" else asyncio.CancelledError
        with pytest.raises(expected):
            await asyncio.wait_for(waiter, 1)
        assert route.waiting == 0

    run(scenario())


def test_a_requests_slots_are_taken_all_at_once_and_waiters_go_in_arrival_order() -> None:
    """Two requests of four choices on four slots with one slot busy: neither holds part of what it
    needs while waiting (the deadlock of taking slots one choice at a time), and a later small
    request does not pass the first in line."""
    route = route_of(S.READY, max_concurrent_jobs=4)

    async def scenario() -> list[str]:
        busy = await route.acquire(soon())
        order: list[str] = []

        async def request(name: str, choices: int) -> list[WorkerHandle]:
            taken = await route.acquire_slots(soon(), [10] * choices)
            order.append(name)
            return taken

        first = asyncio.create_task(request("first n=4", 4))
        await waiting(route, 1)
        second = asyncio.create_task(request("second n=4", 4))
        small = asyncio.create_task(request("small n=1", 1))
        await waiting(route, 3)
        await settle()
        assert order == [] and sum(r.in_flight for r in route.replicas) == 1  # only `busy` holds one
        route.release(busy)
        taken = await asyncio.wait_for(first, 1)
        assert [r.id for r in taken] == ["m#0-r0"] * 4
        await settle()
        assert order == ["first n=4"]  # the others wait for all four slots to come back
        for replica in taken:
            route.release(replica, 10)
        for replica in await asyncio.wait_for(second, 1):
            route.release(replica, 10)
        await asyncio.wait_for(small, 1)
        return order

    assert run(scenario()) == ["first n=4", "second n=4", "small n=1"]


def test_more_choices_than_a_replica_runs_are_refused_at_once() -> None:
    route = route_of(S.READY, S.READY, max_concurrent_jobs=2)

    async def scenario() -> None:
        with pytest.raises(InvalidRequest, match="max_concurrent_jobs 2"):
            await route.acquire_slots(soon(), [1, 1, 1])

    run(scenario())
    assert route.waiting == 0


def test_choices_spread_over_replicas_when_each_has_room() -> None:
    route = route_of(S.READY, S.READY, max_concurrent_jobs=2)

    async def scenario() -> list[str]:
        return [r.id for r in await route.acquire_slots(soon(), [5, 5])]

    assert run(scenario()) == ["m#0-r0", "m#0-r1"]


def test_a_full_queue_serves_higher_classes_first_then_arrival_order() -> None:
    route = route_of(S.READY, max_concurrent_jobs=1, priority_aging_s=600)
    order: list[str] = []

    async def waiter(name: str, priority: Any) -> None:
        replica = await route.acquire(soon(), priority=priority)
        order.append(name)
        route.release(replica)

    async def scenario() -> None:
        held = await route.acquire(soon())
        tasks = []
        for name, priority in [("low-1", "low"), ("normal", "normal"), ("high", "high"), ("low-2", "low")]:
            tasks.append(asyncio.create_task(waiter(name, priority)))
            while route.waiting < len(tasks):  # each is in the queue before the next arrives
                assert not any(task.done() for task in tasks), [t.exception() for t in tasks if t.done()]
                await asyncio.sleep(0)
        route.release(held)
        await asyncio.gather(*tasks)

    run(scenario())
    assert order == ["high", "normal", "low-1", "low-2"]


def test_a_low_request_that_waited_long_enough_goes_before_later_high_ones() -> None:
    aging = 0.1
    route = route_of(S.READY, max_concurrent_jobs=1, priority_aging_s=aging)
    order: list[str] = []

    async def waiter(name: str, priority: Any) -> None:
        replica = await route.acquire(soon(), priority=priority)
        order.append(name)
        route.release(replica)

    async def scenario() -> None:
        held = await route.acquire(soon())
        low = asyncio.create_task(waiter("low", "low"))
        while route.waiting < 1:
            assert not low.done(), low.exception()
            await asyncio.sleep(0)
        # The waiting time is the behaviour under test: two aging steps lift `low` to `high`.
        await asyncio.sleep(2 * aging + 0.05)
        high = asyncio.create_task(waiter("high", "high"))
        while route.waiting < 2:
            assert not high.done(), high.exception()
            await asyncio.sleep(0)
        route.release(held)
        await asyncio.gather(low, high)

    run(scenario())
    assert order == ["low", "high"]


def test_priority_classes_age_and_requests_cannot_rise_above_their_key() -> None:
    from gateway.serving.priority import allowed_priority, effective_rank

    assert [effective_rank("low", waited, 10) for waited in (0, 9.9, 10, 19.9, 20, 500)] == [2, 2, 1, 1, 0, 0]
    assert effective_rank("high", 0, 10) == 0
    assert allowed_priority(None, "normal") == "normal"
    assert allowed_priority("high", "normal") == "normal"  # capped at the key's class
    assert allowed_priority(" LOW ", "normal") == "low"
    assert allowed_priority("urgent", "high") is None


def test_when_a_request_should_go_to_a_fallback() -> None:
    """A full queue or no ready worker sends it on; a busy model with room in its queue keeps it,
    and an unloaded on-demand model loads for it (fallbacks do not replace loading on demand)."""
    route = route_of(S.READY, max_concurrent_jobs=1, max_queued_requests=1)

    async def scenario() -> None:
        assert route.fallback_reason(1, 10) is None  # a free slot
        holder = await route.acquire(soon())
        assert route.fallback_reason(1, 10) is None  # busy, but the queue has room: it waits its turn
        waiter = asyncio.create_task(route.acquire(soon()))
        await asyncio.sleep(0.01)
        assert route.fallback_reason(1, 10) == "queue_full"
        with pytest.raises(QueueFull) as refused:  # what admission would say, with the same code
            await route.acquire(soon())
        assert refused.value.code == "queue_full"
        route.release(holder)
        route.release(await asyncio.wait_for(waiter, 1))

    run(scenario())
    for states in ((S.LOADING,), (S.RESTARTING, S.FAILED), (S.UNLOADED,), ()):
        assert route_of(*states).fallback_reason(1, 10) == "no_ready_worker", states
    on_demand = ModelConfig(name="m", engine="transformers", path=Path("x"), load="on_demand")
    assert (
        ModelRoute(on_demand, replicas(on_demand, S.UNLOADED), lambda h: None).fallback_reason(1, 10) is None
    )
