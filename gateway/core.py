"""The gateway's parts, built once per app and wired together: registry, link, supervisor, router,
request service.

Runs in the gateway process. Owns the wiring between those parts and applying a new registry
(reload). Routes reach it through `current_gateway()` (stored on the Quart app, never in a module
global).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.config.models import ModelConfig
from gateway.config.registry import Registry
from gateway.errors import ServiceUnavailable
from gateway.link.handle import WorkerHandle
from gateway.link.worker_link import WorkerLink
from gateway.observability.logging_setup import LoadProgressLog
from gateway.serving.router import Router
from gateway.serving.service import GenerationService
from gateway.workers.supervisor import Supervisor
from gateway.workers.worker_settings import reload_changes
from wire.states import WorkerState

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Gateway:
    registry: Registry
    runtime_dir: Path
    link: WorkerLink
    supervisor: Supervisor
    router: Router
    service: GenerationService
    started_at: float = field(default_factory=time.time)

    @classmethod
    def build(cls, registry: Registry, runtime_dir: Path) -> Gateway:
        supervisor_ref: list[Supervisor] = []
        router_ref: list[Router] = []
        link = WorkerLink(
            f"ipc://{runtime_dir / 'workers.sock'}",
            LoadProgressLog().wrap(
                lambda worker_id, message, key: supervisor_ref[0].on_message(worker_id, message, key)
            ),
            registry.server.remote_workers,
            registry.server.cluster,
        )

        def on_worker_state(worker: WorkerHandle) -> None:
            if router_ref:  # state changes before the router exists need no routing update
                router_ref[0].on_worker_state(worker)

        supervisor = Supervisor(registry, link, on_worker_state)
        supervisor_ref.append(supervisor)
        router = Router(registry, list(supervisor.workers.values()), supervisor.launch)
        router_ref.append(router)
        service = GenerationService(
            link, registry.server.sse_keepalive_s, registry.server.write_stall_timeout_s
        )
        gateway = cls(registry, runtime_dir, link, supervisor, router, service)
        supervisor.loads.unload = gateway.unload  # exclusive groups swap models out through unload
        return gateway

    def plan(self, new: Registry) -> dict[str, list[str]]:
        """What applying `new` would do: model names added, removed, changed (workers restarted),
        retuned (applied in place) and unchanged (gateway.workers.worker_settings draws the line)."""
        return reload_changes(self.registry.models, new.models)

    async def apply_registry(self, new: Registry) -> dict[str, Any]:
        """Move the running set to `new`: start added models, drain and stop removed ones,
        restart changed ones, give retuned ones their new entry in place (their workers keep
        running and no request ends), leave unchanged ones untouched (their requests never notice).
        In cluster mode a changed remote model keeps its listening workers (they are not this
        gateway's to restart; gateway.reloads asks the leader to).

        Requests waiting for a removed model end at once; requests running on a removed or changed
        model's workers may finish within shutdown_grace_s, then end (each through its owner's
        abort, with the reason). Requests waiting for a changed model wait for its new workers."""
        wanted = {m.name: m for m in new.models}
        if new.server != self.registry.server:
            logger.warning("the server section changed; those settings apply after a restart")
        changes = self.plan(new)
        grace = self.registry.server.shutdown_grace_s
        ended = 0
        for name in changes["removed"]:
            ended += self.service.abort_queued(name, _removed(name))
        retiring: list[WorkerHandle] = []
        listening: dict[str, list[WorkerHandle]] = {}
        for name in changes["removed"] + changes["changed"]:
            handles = [h for h in self.supervisor.workers.values() if h.model.name == name]
            if self.registry.server.cluster is not None and name in wanted and wanted[name].remote:
                # Cluster mode: listening workers are services of their own and keep serving; the
                # leader restarts them in place if what they read changed (gateway.workers.cluster_reloads).
                listening[name] = handles
            else:
                retiring += handles
        self.registry = self.registry.model_copy(update={"models": new.models})
        self.supervisor.registry = self.registry
        for name in changes["removed"]:
            self.router.drop_route(name)
        for name in changes["retuned"]:
            self._retune(wanted[name])
        fresh = []
        for name, handles in listening.items():
            for handle in handles:
                handle.model = wanted[name]
            self.router.set_route(wanted[name], handles)
        for name in changes["added"] + [n for n in changes["changed"] if n not in listening]:
            handles = self.supervisor.add(wanted[name])
            self.router.set_route(wanted[name], handles)
            fresh.extend(handles)

        # Old workers leave first, so a changed model never holds its GPU twice; requests for it
        # wait in its queue meanwhile, as they do at startup.
        def grace_over(handle: WorkerHandle) -> None:
            nonlocal ended
            name = handle.model.name
            reason = _removed(name) if name in changes["removed"] else _reloading(name)
            ended += self.service.abort_on_worker(handle.id, reason)

        await asyncio.gather(
            *(self.supervisor.retire(h, grace, WorkerState.STOPPED, grace_over) for h in retiring)
        )
        for handle in retiring:
            self.supervisor.remove(handle)
        for handle in fresh:
            if handle.model.load == "startup":
                self.supervisor.launch(handle)
        applied = {k: v for k, v in changes.items() if k != "unchanged"}
        logger.info("registry applied: %s; %d request(s) ended", applied, ended)
        return {**changes, "requests_ended": ended}

    def _retune(self, config: ModelConfig) -> None:
        """A model whose workers read nothing that changed: its workers keep running, and what the
        gateway reads takes the new entry at once. The route (the same object, so requests in flight
        and in its queue keep their place) reads its limits, defaults, parsers and fallbacks from
        `config` at each use, and its names are indexed anew (a removed alias is unknown from now
        on); the handles carry it for the watchdog (wedge_timeout_s) and idle unloads."""
        for handle in self.supervisor.workers.values():
            if handle.model.name == config.name:
                handle.model = config
        self.router.set_route(config, self.router.routes[config.name].replicas)

    async def unload(self, name: str, why: str | None = None) -> int:
        """Drain and stop a model's workers (requests in flight may finish within the grace);
        returns how many requests ended: those waiting for it at once, the rest after the grace.
        `why` is given when the gateway itself unloads it (an exclusive group's swap)."""
        route = self.router.route(name)
        error = (
            ServiceUnavailable(why, code="model_swapped")
            if why is not None
            else ServiceUnavailable(f"model '{name}' was unloaded", code="model_unloaded")
        )
        ended = self.service.abort_queued(route.config.name, error)

        def grace_over(handle: WorkerHandle) -> None:
            nonlocal ended
            ended += self.service.abort_on_worker(handle.id, error)

        grace = self.registry.server.shutdown_grace_s
        await asyncio.gather(
            *(self.supervisor.retire(h, grace, grace_over=grace_over) for h in route.replicas)
        )
        return ended

    def model_card(self, name: str) -> dict[str, Any]:
        route = self.router.routes[name]
        config = route.config
        return {
            "id": name,
            "object": "model",
            "created": int(self.started_at),
            "owned_by": "llm-gateway",
            "aliases": list(config.aliases),
            "engine": config.engine,
            "max_model_len": config.max_seq_len,
            "context_length": config.max_seq_len,
            "state": route.state.value,
        }


def _removed(name: str) -> ServiceUnavailable:
    return ServiceUnavailable(f"model '{name}' was removed by a reload", code="model_removed")


def _reloading(name: str) -> ServiceUnavailable:
    return ServiceUnavailable(f"model '{name}' is reloading with new settings", code="model_reloading")
