"""Registry reloads that answer at once: each reload is a record that operators can follow.

Runs in the gateway process, on its asyncio loop. Owns the one reload that may run at a time, its
background task, and the last few reloads' records. `POST /admin/reload` and SIGHUP start one:
the new file is read and validated first, with the host checks of `gateway check-config` (model
folders, GPUs) for the local models whose workers it starts (added or changed); a file that fails
them changes nothing and is refused at once, and so is any reload once the SIGTERM drain has begun.
Then `Gateway.apply_registry` runs in the background while `GET /admin/reload/{id}`
shows its progress: the changes (gateway.workers.worker_settings says which kind each model's is:
a `retuned` model keeps its workers and ends no request), how many requests it ended, and the
state of every model it starts. A reload is `applying` while old workers drain, then `applied`
(every new worker launched); `models_ready` says when every model it started is serving.

In cluster mode the workers are services of their own: a reload changes this gateway's routes, and
where it changes what a remote model's workers read, it asks the cluster's leader to restart them
in place, once for every gateway (`workers_reload` in the record; etcd backend only: elsewhere such
a reload is refused and nothing changes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.config.host_checks import host_problems
from gateway.config.registry import ConfigError, Registry, load_registry
from gateway.core import Gateway
from gateway.errors import Conflict, ServiceUnavailable
from gateway.heap import refreeze_after_reload
from gateway.workers.reload_plan import worker_changes
from gateway.workers.worker_settings import CHANGE_KINDS
from wire.states import WorkerState

logger = logging.getLogger(__name__)
KEPT_RECORDS = 10


@dataclass(eq=False)
class ReloadRecord:
    id: int
    source: Path
    changes: dict[str, list[str]]
    started_at: float = field(default_factory=time.time)
    state: str = "applying"  # applying -> applied | failed
    requests_ended: int = 0
    error: str | None = None
    finished_at: float | None = None
    task: asyncio.Task[None] | None = None
    workers_reload: dict[str, Any] | None = None  # cluster mode: what the leader was asked to restart

    def view(self, gateway: Gateway) -> dict[str, Any]:
        starting = self.changes["added"] + self.changes["changed"]
        routes = gateway.router.routes
        models = {
            name: routes[name].state.value for name in starting if name in routes
        }  # a later reload may have removed one
        serving = [routes[n] for n in models if routes[n].config.load == "startup"]
        return {
            "id": self.id,
            "status": self.state,
            "source": str(self.source),
            **self.changes,
            "requests_ended": self.requests_ended,
            "models": models,
            "models_ready": self.state == "applied"
            and all(route.state is WorkerState.READY for route in serving),
            "error": self.error,
            "workers_reload": self.workers_reload,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "progress": f"/admin/reload/{self.id}",
        }


class ReloadInProgress(Conflict):
    code = "reload_in_progress"


class Reloads:
    def __init__(self, gateway: Gateway, on_applied: Callable[[Registry], None]) -> None:
        self.gateway = gateway
        self.on_applied = on_applied  # e.g. the API keys' model scopes follow the new registry
        self.records: dict[int, ReloadRecord] = {}
        self._next_id = 1
        self._running: ReloadRecord | None = None

    @property
    def latest(self) -> ReloadRecord | None:
        return self.records[max(self.records)] if self.records else None

    async def start(self) -> ReloadRecord:
        """Validate the registry file and start applying it; ConfigError if it is invalid or fails
        the host checks, ReloadInProgress while another reload applies, ServiceUnavailable
        (`shutting_down`) once the SIGTERM drain has begun."""
        self._refuse_while_draining()
        source = self.gateway.registry.source
        if source is None:
            raise ConfigError("the running registry was not loaded from a file")
        if self._running is not None:
            running = self._running.id
            raise ReloadInProgress(f"reload {running} is still applying; follow /admin/reload/{running}")
        # Claimed before the first await, so a second caller sees it.
        record = ReloadRecord(self._next_id, source, {k: [] for k in CHANGE_KINDS})
        self._running = record
        try:
            # Reading runs the engines' settings check in a child process: off the event loop.
            new = await asyncio.to_thread(load_registry, source)
            changes = self.gateway.plan(new)
            # Folder checks and GPU discovery touch the disk and may run nvidia-smi: off the loop.
            await asyncio.to_thread(self._check_host, new, changes)
            # The drain may have begun while the file was read: a gateway on its way out changes
            # nothing more, here or (through the leader) in the cluster.
            self._refuse_while_draining()
            record.workers_reload = await self._ask_the_leader(new)
            self._refuse_while_draining()
        except BaseException:
            self._running = None
            raise
        self._next_id += 1
        record.changes = changes
        self.records[record.id] = record
        for old in sorted(self.records)[:-KEPT_RECORDS]:
            del self.records[old]
        record.task = asyncio.create_task(self._apply(record, new), name=f"reload-{record.id}")
        return record

    def _refuse_while_draining(self) -> None:
        # The drain stops every worker: a reload then would only retire the working ones and
        # start replacements that never serve (no worker starts once the drain has begun).
        if self.gateway.service.draining:
            raise ServiceUnavailable(
                "the server is shutting down: reload refused, nothing changed", code="shutting_down"
            )

    def _check_host(self, new: Registry, changes: dict[str, list[str]]) -> None:
        """ConfigError unless the local models the reload starts (added or changed) can start on
        this host: the checks of `gateway check-config`, so that a file it rejects is never applied
        (its workers would fail at once, after the working ones were retired). Retuned and unchanged
        models keep their running workers and are not checked again; the server section only
        applies after a restart, so the running one stands in for it."""
        starting = set(changes["added"] + changes["changed"])
        models = [m for m in new.models if m.name in starting and not m.remote]
        if not models:
            return
        checked = new.model_copy(update={"models": models, "server": self.gateway.registry.server})
        problems = host_problems(checked)
        if problems:
            raise ConfigError("\n".join(problems))

    async def _ask_the_leader(self, new: Registry) -> dict[str, Any] | None:
        """Cluster mode: listening workers whose settings change are restarted by the leader, once
        for the cluster (gateway.workers.cluster_reloads); ConfigError where no leader can."""
        gateway = self.gateway
        cluster = gateway.registry.server.cluster
        changed = worker_changes(gateway.registry.models, new.models)
        if cluster is None or not changed:
            return None
        reloads = gateway.supervisor.cluster_reloads
        if reloads is None:
            fields = "engine, path, max_seq_len, engine_settings, chat_template, env, task or worker limits"
            raise ConfigError(
                f"{new.source}: model(s) {', '.join(sorted(changed))}: the settings their workers read "
                f"({fields}) changed, and with server.cluster.backend {cluster.backend} no leader "
                "restarts listening workers (only backend etcd does): restart those workers on their "
                "hosts, or reload with those settings unchanged"
            )
        return await reloads.ask(changed)

    async def _apply(self, record: ReloadRecord, new: Registry) -> None:
        try:
            result = await self.gateway.apply_registry(new)
            record.requests_ended = int(result["requests_ended"])
            self.on_applied(self.gateway.registry)
            record.state = "applied"
            refreeze_after_reload()
        except Exception as exc:  # logged and shown in the record; the gateway keeps serving
            logger.exception("reload %d failed", record.id)
            record.state, record.error = "failed", f"{type(exc).__name__}: {exc}"
        finally:
            record.finished_at = time.time()
            self._running = None

    async def wait(self, record: ReloadRecord, timeout_s: float) -> bool:
        """Wait up to timeout_s for the record's apply to finish; True if it did."""
        if record.task is None:
            return True
        done, _ = await asyncio.wait({record.task}, timeout=timeout_s)
        return bool(done)

    async def stop(self) -> None:
        if self._running is not None and self._running.task is not None:
            self._running.task.cancel()
            await asyncio.gather(self._running.task, return_exceptions=True)
