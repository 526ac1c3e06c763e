"""Model name -> replica routing and admission control.

Runs in the gateway process, on its asyncio loop. Owns, per model, the count of requests waiting
for a slot and the rule that picks a replica: the ready one with the least outstanding work.
A request takes a slot (one of `max_concurrent_jobs` per replica) before it is sent to a worker;
beyond that it waits in a bounded queue; beyond that it is refused at once with 429/503.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gateway.config.registry import ModelConfig, Registry
from gateway.errors import ModelNotFound, QueueFull, RequestTimeout, ServiceUnavailable
from wire.states import MAY_SERVE, WorkerState, model_state

if TYPE_CHECKING:
    from gateway.workers.handle import WorkerHandle

Launcher = Callable[["WorkerHandle"], None]


class AdmissionStopped(Exception):
    """The request gave up waiting for a slot (its owner aborted it); the owner says why."""


class ModelRoute:
    def __init__(self, config: ModelConfig, replicas: list[WorkerHandle], launch: Launcher) -> None:
        self.config = config
        self.replicas = replicas
        self._launch = launch
        self.waiting = 0
        self.waiting_prompt_tokens = 0
        # One future per waiting request, resolved when anything changes. Not a Condition waited on
        # through asyncio.wait_for: on Python 3.11 that can swallow the waiter's cancellation when a
        # notify lands at the same moment, and the waiter would then sit out its whole deadline.
        self._waiters: set[asyncio.Future[None]] = set()

    @property
    def state(self) -> WorkerState:
        """The model's state: its best replica's."""
        return model_state([r.state for r in self.replicas])

    def has_other_replica(self, avoid: frozenset[str]) -> bool:
        """Whether a replica outside `avoid` may still serve (a request that failed to start on the
        ones in `avoid` can then move to it)."""
        return any(r.id not in avoid and r.state in MAY_SERVE for r in self.replicas)

    def _free_replica(self, avoid: frozenset[str] = frozenset()) -> WorkerHandle | None:
        limit = self.config.limits.max_concurrent_jobs
        candidates = [r for r in self.replicas if r.ready and r.in_flight < limit and r.id not in avoid]
        if not candidates:
            return None
        # Least outstanding work first: tokens still to process (prompt + completion budget) of
        # the requests it holds, then the count of requests as a tie-break.
        return min(candidates, key=lambda r: (r.outstanding_tokens, r.in_flight, r.replica))

    def any_ready(self) -> WorkerHandle:
        """A ready replica for a quick side request (tokenize) that takes no generation slot."""
        ready = [r for r in self.replicas if r.ready]
        if not ready:
            raise ServiceUnavailable(
                self._unservable_reason() or f"model '{self.config.name}' is not ready yet"
            )
        return min(ready, key=lambda r: r.in_flight)

    def _unservable_reason(self) -> str | None:
        if self.replicas and all(r.state is WorkerState.UNLOADED for r in self.replicas):
            if self.config.load == "on_demand":
                for replica in self.replicas:
                    self._launch(replica)  # the request waits in the queue while it loads
                return None
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
    ) -> WorkerHandle:
        """Take a slot on a replica, waiting in the bounded queue until `deadline` (monotonic), or
        until `stop` is done (the request was aborted): then AdmissionStopped."""
        replica = self._free_replica(avoid)
        if replica is None:
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
                    headers={"Retry-After": "1"},
                )
            replica = await self._wait_for_replica(deadline, prompt_size, avoid, stop)
        replica.in_flight += 1
        replica.outstanding_tokens += work
        replica.last_used = time.monotonic()
        return replica

    async def _wait_for_replica(
        self, deadline: float, prompt_size: int, avoid: frozenset[str], stop: asyncio.Future[Any] | None
    ) -> WorkerHandle:
        self.waiting += 1
        self.waiting_prompt_tokens += prompt_size
        loop = asyncio.get_running_loop()
        try:
            while True:
                if stop is not None and stop.done():
                    raise AdmissionStopped()
                replica = self._free_replica(avoid)
                if replica is not None:
                    return replica
                reason = self._unservable_reason()
                if reason:
                    raise ServiceUnavailable(reason)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RequestTimeout("the request timed out while waiting for a free slot")
                changed = loop.create_future()
                self._waiters.add(changed)
                waiting: set[asyncio.Future[Any]] = {changed} if stop is None else {changed, stop}
                try:
                    await asyncio.wait(waiting, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    self._waiters.discard(changed)
        finally:
            self.waiting -= 1
            self.waiting_prompt_tokens -= prompt_size

    def release(self, replica: WorkerHandle, work: int = 0) -> None:
        replica.in_flight = max(replica.in_flight - 1, 0)
        replica.outstanding_tokens = max(replica.outstanding_tokens - work, 0)
        replica.last_used = time.monotonic()
        self.notify()

    def notify(self) -> None:
        """Something changed (a slot freed, a replica's state): every waiter looks again."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)


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
        """Add a model, or give an existing one a new config and replicas (its queue is kept)."""
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
