"""Model name -> replica routing and admission control.

Runs in the gateway process, on its asyncio loop. Owns, per model, the count of requests waiting
for a slot and the rule that picks a replica: the ready one with the least outstanding work.
A request takes a slot (one of `max_concurrent_jobs` per replica) before it is sent to a worker;
beyond that it waits in a bounded queue, served by priority class (gateway.serving.priority);
beyond that it is refused at once with 429/503. A worker that several gateways share reports the
jobs it holds against its own cap, and which are ours, in its heartbeats and at once whenever they
change: its slots here are its cap less the other gateways' jobs, and their jobs count in its load,
so N gateways never put N times its capacity on it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from gateway.config.api_keys import Priority
from gateway.config.models import ModelConfig
from gateway.config.registry import Registry
from gateway.errors import InvalidRequest, ModelNotFound, QueueFull, RequestTimeout, ServiceUnavailable
from gateway.serving.admissions import CURRENT as ADMISSION
from gateway.serving.priority import effective_rank, request_priority
from wire.states import MAY_SERVE, WorkerState, model_state

# A replica that will be ready without being asked: loading, or coming back from a crash.
ON_ITS_WAY = frozenset(
    {WorkerState.STARTING, WorkerState.LOADING, WorkerState.WARMING, WorkerState.RESTARTING}
)

if TYPE_CHECKING:
    from gateway.link.handle import WorkerHandle

Launcher = Callable[["WorkerHandle"], None]


class AdmissionStopped(Exception):
    """The request gave up waiting for a slot (its owner aborted it); the owner says why."""


class ReplicasExhausted(Exception):
    """Every replica that may still serve is one this request already failed on (it refused the
    job as full, or failed to start it): waiting on cannot place it, so its last failure stands."""


class _Waiter:
    """A request's place in a model's line; `changed` resolves when it should look again."""

    __slots__ = ("changed", "priority", "since")

    def __init__(self, priority: Priority, since: float) -> None:
        self.changed: asyncio.Future[None] | None = None
        self.priority = priority
        self.since = since


class ModelRoute:
    def __init__(self, config: ModelConfig, replicas: list[WorkerHandle], launch: Launcher) -> None:
        self.config = config
        self.replicas = replicas
        self._launch = launch
        self.waiting = 0
        self.waiting_prompt_tokens = 0
        # One future per waiting request, in arrival order, resolved when anything changes. Not a
        # Condition waited on through asyncio.wait_for: on Python 3.11 that can swallow the waiter's
        # cancellation when a notify lands at the same moment, and the waiter would then sit out
        # its whole deadline.
        self._waiters: dict[_Waiter, None] = {}

    def _head(self) -> _Waiter | None:
        """The waiter to serve next: best class now (see gateway.serving.priority), then arrival."""
        if not self._waiters:
            return None
        now = time.monotonic()
        aging = self.config.limits.priority_aging_s
        # dict order is arrival order and min() keeps the first of equals: FIFO within a class.
        return min(self._waiters, key=lambda w: effective_rank(w.priority, now - w.since, aging))

    @property
    def state(self) -> WorkerState:
        """The model's state: its best replica's."""
        return model_state([r.state for r in self.replicas])

    def has_other_replica(self, avoid: frozenset[str]) -> bool:
        """Whether a replica outside `avoid` may still serve (a request that failed to start on the
        ones in `avoid` can then move to it)."""
        return any(r.id not in avoid and r.state in MAY_SERVE for r in self.replicas)

    def _place_slots(self, works: Sequence[int], avoid: frozenset[str]) -> list[WorkerHandle] | None:
        """A replica for each slot, least outstanding work first, counting the slots placed so far;
        None unless every slot fits now."""
        limit = self.config.limits.max_concurrent_jobs
        slots = {r.id: r.in_flight for r in self.replicas}
        load = {r.id: r.outstanding_tokens for r in self.replicas}
        limits = {r.id: r.slot_limit(limit) for r in self.replicas}
        placed: list[WorkerHandle] = []
        for work in works:
            candidates = [
                r for r in self.replicas if r.ready and r.id not in avoid and slots[r.id] < limits[r.id]
            ]
            if not candidates:
                return None
            # Least outstanding work first: tokens still to process (prompt + completion budget) of
            # the requests it holds (another gateway's job counted as one like this), then the count
            # of requests as a tie-break.
            replica = min(
                candidates,
                key=lambda r: (load[r.id] + r.others_jobs * work, slots[r.id] + r.others_jobs, r.replica),
            )
            slots[replica.id] += 1
            load[replica.id] += work
            placed.append(replica)
        return placed

    def fallback_reason(self, choices: int, prompt_size: int) -> str | None:
        """Why a request of `choices` jobs should go to a fallback model now, without waiting here:
        "no_ready_worker" (none is ready: starting, loading, restarting, failed, draining, or no
        remote worker; an unloaded on-demand model loads for its request instead), or "queue_full"
        (it would be refused at once); None if it would be admitted or wait its turn."""
        if not any(r.ready for r in self.replicas):
            return None if self._to_load_on_demand() else "no_ready_worker"
        if not self._waiters and self._place_slots([0] * choices, frozenset()) is not None:
            return None
        limits = self.config.limits
        if (
            self.waiting >= limits.max_queued_requests
            or self.waiting_prompt_tokens + prompt_size > limits.max_queued_prompt_tokens
        ):
            return "queue_full"
        return None

    def any_ready(self) -> WorkerHandle:
        """A ready replica for a quick side request (tokenize) that takes no generation slot."""
        ready = [r for r in self.replicas if r.ready]
        if not ready:
            raise ServiceUnavailable(
                self._unservable_reason() or f"model '{self.config.name}' is not ready yet"
            )
        return min(ready, key=lambda r: r.in_flight)

    def _to_load_on_demand(self) -> list[WorkerHandle]:
        """The unloaded replicas of an on-demand model to load for a waiting request: every one,
        when none is ready or on its way (others may be lost or failed)."""
        if self.config.load != "on_demand" or any(r.ready or r.state in ON_ITS_WAY for r in self.replicas):
            return []
        return [r for r in self.replicas if r.state is WorkerState.UNLOADED]

    def _unservable_reason(self) -> str | None:
        if to_load := self._to_load_on_demand():
            for replica in to_load:
                self._launch(replica)  # the request waits in the queue while it loads
            return None
        if self.replicas and all(r.state is WorkerState.UNLOADED for r in self.replicas):
            name = self.config.name
            return f"model '{name}' is unloaded; load it with POST /admin/models/{name}/load"
        if not self.replicas:
            return f"model '{self.config.name}' has no connected worker"
        if not any(r.state in MAY_SERVE for r in self.replicas):
            reasons = "; ".join(r.detail or r.last_error or r.state.value for r in self.replicas)
            return f"model '{self.config.name}' is unavailable: {reasons}"
        return None

    async def acquire(
        self,
        deadline: float,
        prompt_size: int = 0,
        work: int = 0,
        avoid: frozenset[str] = frozenset(),
        stop: asyncio.Future[Any] | None = None,
        priority: Priority | None = None,
    ) -> WorkerHandle:
        """One slot (see `acquire_slots`)."""
        return (await self.acquire_slots(deadline, [work], prompt_size, avoid, stop, priority))[0]

    async def acquire_slots(
        self,
        deadline: float,
        works: Sequence[int],
        prompt_size: int = 0,
        avoid: frozenset[str] = frozenset(),
        stop: asyncio.Future[Any] | None = None,
        priority: Priority | None = None,
    ) -> list[WorkerHandle]:
        """One slot per entry of `works` (a request's choices), taken all at once or not at all, so
        requests with several choices can never hold part of what they need while waiting for the
        rest (two such requests would wait on each other). Waiters are served by priority class,
        then in arrival order (gateway.serving.priority; `priority` defaults to the request's): a
        request needing many slots is not passed over forever by later small ones. Waits in the
        bounded queue until `deadline` (monotonic), or until `stop` is done (the request was
        aborted): then AdmissionStopped."""
        limit = self.config.limits.max_concurrent_jobs
        if len(works) > limit:  # the HTTP layer refuses these first, naming the parameter
            raise InvalidRequest(
                f"{len(works)} generations at once are more than model '{self.config.name}' runs "
                f"(max_concurrent_jobs {limit})"
            )
        placed = None if self._waiters else self._place_slots(works, avoid)
        if placed is None:
            reason = self._unservable_reason()
            if reason:
                raise ServiceUnavailable(reason)
            limits = self.config.limits
            if (
                self.waiting >= limits.max_queued_requests
                or self.waiting_prompt_tokens + prompt_size > limits.max_queued_prompt_tokens
            ):
                error_class = QueueFull if limits.full_queue_status == 429 else ServiceUnavailable
                raise error_class(
                    f"model '{self.config.name}' is at capacity ({self.waiting} queued); retry later",
                    code="queue_full",
                    headers={"Retry-After": "1"},
                )
            admission = ADMISSION.get()
            if admission is not None:
                admission.end()  # waiting for a slot: no worker could take it in a burst now
            chosen = priority if priority is not None else request_priority()
            placed = await self._wait_for_slots(deadline, works, prompt_size, avoid, stop, chosen)
        now = time.monotonic()
        for replica, work in zip(placed, works, strict=True):
            replica.in_flight += 1
            replica.outstanding_tokens += work
            replica.last_used = now
        return placed

    async def _wait_for_slots(
        self,
        deadline: float,
        works: Sequence[int],
        prompt_size: int,
        avoid: frozenset[str],
        stop: asyncio.Future[Any] | None,
        priority: Priority,
    ) -> list[WorkerHandle]:
        self.waiting += 1
        self.waiting_prompt_tokens += prompt_size
        me = _Waiter(priority, time.monotonic())
        self._waiters[me] = None  # insertion order is arrival order
        try:
            while True:
                if stop is not None and stop.done():
                    raise AdmissionStopped()
                placed = self._place_slots(works, avoid) if self._head() is me else None
                if placed is not None:
                    return placed
                reason = self._unservable_reason()
                if reason:
                    raise ServiceUnavailable(reason)
                if avoid and not self.has_other_replica(avoid):
                    # The replica it waited for was lost meanwhile; waiting to its deadline would
                    # also hold every request queued behind it.
                    raise ReplicasExhausted()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RequestTimeout("the request timed out while waiting for a free slot")
                me.changed = asyncio.get_running_loop().create_future()
                waiting: set[asyncio.Future[Any]] = {me.changed} if stop is None else {me.changed, stop}
                await asyncio.wait(waiting, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._waiters.pop(me, None)
            self.waiting -= 1
            self.waiting_prompt_tokens -= prompt_size
            self.notify()  # the next in line may go now (or, if this one took slots, look again)

    def release(self, replica: WorkerHandle, work: int = 0) -> None:
        replica.in_flight = max(replica.in_flight - 1, 0)
        replica.outstanding_tokens = max(replica.outstanding_tokens - work, 0)
        replica.last_used = time.monotonic()
        self.notify()

    def notify(self) -> None:
        """Something changed (a slot freed, a replica's state): every waiter looks again."""
        for waiter in self._waiters:
            if waiter.changed is not None and not waiter.changed.done():
                waiter.changed.set_result(None)


class Router:
    def __init__(self, registry: Registry, workers: list[WorkerHandle], launch: Launcher) -> None:
        self.routes: dict[str, ModelRoute] = {}
        self._by_name: dict[str, ModelRoute] = {}
        self._launch = launch
        for model in registry.models:
            self.routes[model.name] = ModelRoute(
                model, [w for w in workers if w.model.name == model.name], launch
            )
        self._index_names()

    def _index_names(self) -> None:
        self._by_name = {}
        for route in self.routes.values():
            for name in (route.config.name, *route.config.aliases):
                self._by_name[name] = route

    def set_route(self, config: ModelConfig, replicas: list[WorkerHandle]) -> ModelRoute:
        """Add a model, or give an existing one a new config and replicas. An existing route stays
        the same object, with its queue and the slots its requests hold; it reads its config at each
        use, so new limits apply from the next admission, and its waiters look again at once."""
        route = self.routes.get(config.name)
        if route is None:
            route = self.routes[config.name] = ModelRoute(config, replicas, self._launch)
        else:
            route.config, route.replicas = config, replicas
            route.notify()
        self._index_names()
        return route

    def drop_route(self, name: str) -> None:
        route = self.routes.pop(name, None)
        self._index_names()
        if route is not None:
            route.notify()

    def route(self, model_name: str) -> ModelRoute:
        route = self._by_name.get(model_name)
        if route is None:
            raise ModelNotFound(model_name)
        return route

    def on_worker_state(self, worker: WorkerHandle) -> None:
        route = self.routes.get(worker.model.name)
        if route is not None and worker.remote:
            if worker.state is WorkerState.STOPPED and worker in route.replicas:
                route.replicas.remove(worker)  # a remote worker forgotten
            elif worker.state is not WorkerState.STOPPED and worker not in route.replicas:
                route.replicas.append(worker)  # a remote worker joined
        if route is not None:
            route.notify()

    def deadline_for(self, route: ModelRoute, requested_timeout: float | None) -> float:
        timeout = requested_timeout or route.config.limits.request_timeout_s
        timeout = min(timeout, route.config.limits.request_timeout_s)
        return time.monotonic() + (timeout if math.isfinite(timeout) else 1e9)
