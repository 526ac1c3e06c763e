"""The gateway's shared state, built once per app: registry, link, supervisor, router, service.

Runs in the gateway process. Owns the wiring between those parts; routes reach it through
`current_gateway()` (stored on the Quart app, never in a module global).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quart import current_app

from gateway.config import Registry
from gateway.generation import GenerationService
from gateway.router import Router
from gateway.supervisor import Supervisor
from gateway.worker_link import WorkerLink


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
            lambda worker_id, message: supervisor_ref[0].on_message(worker_id, message),
        )
        supervisor = Supervisor(
            registry, link, lambda worker: router_ref and router_ref[0].on_worker_state(worker)
        )
        supervisor_ref.append(supervisor)
        router = Router(registry, list(supervisor.workers.values()))
        router_ref.append(router)
        service = GenerationService(
            link, registry.server.sse_keepalive_s, registry.server.write_stall_timeout_s
        )
        return cls(registry, runtime_dir, link, supervisor, router, service)

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
            "state": route.state,
        }


def current_gateway() -> Gateway:
    return current_app.extensions["gateway"]  # type: ignore[no-any-return]
