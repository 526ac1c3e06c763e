"""Local worker lifecycle: spawn, watch, restart with backoff, stop.

Runs in the gateway process, on its asyncio loop. Owns one `WorkerHandle` per model replica and
the child processes behind them. Death is seen four ways: the process exit (asyncio's child
watcher), and, judged by gateway.workers.watchdog, a missing frame for `heartbeat_timeout_s`
(lost or hung), a missed start deadline, and jobs the worker says it holds with no step it
reports for `wedge_timeout_s` (wedged). When a worker goes, every request it held hears so at
once, through the link, from its owner. Once shutdown's drain begins no worker starts, not even
to replace one that dies. Idle unloads and retries of failed workers run in
gateway.workers.upkeep.
In cluster mode it also starts gateway.link.cluster_members, which connects to the listening
workers of the membership (those join and leave like any remote worker), and, with etcd or
Kubernetes, gateway.cluster.decisions, this gateway's part in electing the one that decides; with
etcd and remote models loaded on demand, gateway.workers.cluster_loads (the leader loads and
unloads standby workers; any gateway says which models its requests wait for), and with etcd
gateway.workers.cluster_reloads (the leader restarts workers in place for a registry reload).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING

from gateway.cluster.decisions import Decisions
from gateway.config.api_keys import API_KEY_VARIABLES
from gateway.config.models import ModelConfig
from gateway.config.registry import Registry, worker_spec
from gateway.errors import WorkerFailed
from gateway.link.cluster_members import ClusterMembers
from gateway.link.handle import WorkerHandle
from gateway.link.remote_keys import WorkerKey
from gateway.link.step_watch import StepWatch
from gateway.link.worker_link import WorkerLink
from gateway.observability.logging_setup import bind_worker_log_context, worker_log_context
from gateway.workers.cluster_loads import ClusterLoads, loads_on_demand
from gateway.workers.loads import LoadGate, LoadRefused
from gateway.workers.remote import RemoteMembers
from gateway.workers.upkeep import Upkeep
from gateway.workers.watchdog import death_cause
from wire import messages as wire
from wire.states import HOLDS_PROCESS, WorkerState

if TYPE_CHECKING:  # etcd's client comes with it: imported where the etcd backend runs, never on a single host
    from gateway.workers.cluster_reloads import ClusterReloads

logger = logging.getLogger(__name__)

STABLE_AFTER_S = 60.0  # a worker ready this long resets its crash count and backoff
S = WorkerState
STARTUP = (S.STARTING, S.LOADING, S.WARMING)
LIVE = (*STARTUP, S.READY)

StateListener = Callable[[WorkerHandle], None]


class Supervisor:
    def __init__(self, registry: Registry, link: WorkerLink, on_state: StateListener) -> None:
        self.registry = registry
        self.link = link
        self._on_state = on_state
        self.workers: dict[str, WorkerHandle] = {}
        self._generations: dict[str, int] = {}
        # Restarts of removed local workers, per model and replica, for their successors to carry
        # on: gateway_worker_restarts_total must not go back at a reload (Prometheus reads a reset).
        self._removed_restarts: dict[tuple[str, int], int] = {}
        self._stopping = False
        # Shutdown has begun (mark_draining): no worker starts any more, not even to replace one
        # that dies meanwhile (it would load a model only to be stopped, and hold the exit back).
        self._draining = False
        self._upkeep_task: asyncio.Task[None] | None = None
        self.cluster: ClusterMembers | None = None
        self.decisions: Decisions | None = None  # cluster mode with a leader (etcd, Kubernetes)
        self.cluster_loads: ClusterLoads | None = None  # cluster mode on etcd, models loaded on demand
        self.cluster_reloads: ClusterReloads | None = None  # cluster mode on etcd: reloads of workers
        self.remote = RemoteMembers(self)
        self.loads = LoadGate(self)
        for model in registry.models:
            self.add(model)

    # ---- public ------------------------------------------------------------------------------

    def add(self, model: ModelConfig) -> list[WorkerHandle]:
        """One handle per replica; ids change per generation so a draining predecessor never clashes."""
        generation = self._generations.get(model.name, -1) + 1
        self._generations[model.name] = generation
        if model.remote:
            return []  # its workers join over the network
        handles = []
        for replica in range(model.replicas):
            suffix = f"-r{replica}" if model.replicas > 1 else ""
            handle = WorkerHandle(
                id=f"{model.name}#{generation}{suffix}",
                model=model,
                replica=replica,
                gpus=model.gpus_of_replica(replica),
                restarts=self._restarts_so_far(model.name, replica),
            )
            if model.load == "on_demand":
                handle.state, handle.detail = S.UNLOADED, "loads at its first request"
            self.workers[handle.id] = handle
            self.link.expect_local(handle.id)
            handles.append(handle)
        return handles

    def start(self) -> None:
        for handle in self.workers.values():
            if handle.model.load == "startup":
                self.launch(handle)
        self._upkeep_task = asyncio.create_task(Upkeep(self).run_forever(), name="worker-upkeep")

    async def start_cluster(self) -> None:
        """Cluster mode: follow the membership and connect to its workers (after link.start())."""
        cluster = self.registry.server.cluster
        if cluster is None:
            return
        from gateway.cluster.backends import make_membership

        link = self.link
        self.cluster = ClusterMembers(
            make_membership(cluster), link.dial, link.hang_up, self.leave_cluster, link.ping_dialed,
            self.registry.server.heartbeat_interval_s,
        )  # fmt: skip
        await self.cluster.start()
        if cluster.backend != "static":  # a static list has no leader: nothing is decided once
            self.decisions = Decisions(cluster)
            await self.decisions.start()
        if self.decisions is not None and cluster.backend == "etcd" and loads_on_demand(self.registry):
            self.cluster_loads = ClusterLoads.on_etcd(
                cluster, self.workers, link, self.decisions.leader, self.cluster.members,
                self.registry.server.shutdown_grace_s,
            )  # fmt: skip
            await self.cluster_loads.start()
        if self.decisions is not None and cluster.backend == "etcd":
            assert cluster.etcd is not None
            from gateway.workers.cluster_reloads import ClusterReloads

            self.cluster_reloads = ClusterReloads(
                cluster.etcd, self.workers, link, self.decisions.leader, self.cluster.members,
                self.registry.server.shutdown_grace_s,
            )  # fmt: skip
            await self.cluster_reloads.start()

    def leave_cluster(self, worker_id: str) -> None:
        """A worker left the membership: what it held ends now, and it is forgotten."""
        handle = self.workers.get(worker_id)
        if handle is None or not handle.remote:
            return
        self.fail_requests(handle, "it left the cluster's membership")
        if handle.task is not None:
            handle.task.cancel()  # its watch would otherwise judge a forgotten worker
        self.set_state(handle, S.STOPPED, "left the cluster's membership")
        self.remove(handle)

    def launch(self, handle: WorkerHandle) -> None:
        """Start (or restart after an unload) the worker of a handle; idempotent while it runs. A
        standby worker in cluster mode is loaded by the leader: this gateway says it wants it."""
        closing = self._stopping or self._draining
        if handle.remote and self.cluster_loads is not None and not closing:
            self.cluster_loads.want(handle)
        if closing or handle.remote or (handle.task is not None and not handle.task.done()):
            return
        handle.retiring, handle.consecutive_failures = False, 0
        handle.last_used = time.monotonic()
        handle.task = asyncio.create_task(self._keep_running(handle), name=f"supervise:{handle.id}")

    async def retire(
        self,
        handle: WorkerHandle,
        grace_s: float,
        final_state: WorkerState = S.UNLOADED,
        grace_over: Callable[[WorkerHandle], object] | None = None,
    ) -> None:
        """Drain (requests in flight may finish within grace_s), stop the worker, free its GPU.
        `grace_over` ends what is still running then (the request owners' abort, with the reason)."""
        handle.retiring = True
        if handle.state in HOLDS_PROCESS:
            self.set_state(handle, S.DRAINING, "unloading")
        deadline = time.monotonic() + grace_s
        while handle.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if grace_over is not None:
            grace_over(handle)
        if handle.process and handle.process.returncode is None:
            self.link.send(handle.id, wire.Shutdown(max(deadline - time.monotonic(), 0.0)))
            await self._reap(handle, max(deadline - time.monotonic(), 0.0) + 5.0)
        if handle.task is not None:
            handle.task.cancel()
            await asyncio.gather(handle.task, return_exceptions=True)
        handle.pid = None
        handle.forget_process()
        self.set_state(handle, final_state, "")

    def remove(self, handle: WorkerHandle) -> None:
        self.workers.pop(handle.id, None)
        self.link.forget(handle.id)
        if not handle.remote:
            key = (handle.model.name, handle.replica)
            self._removed_restarts[key] = max(self._removed_restarts.get(key, 0), handle.restarts)

    def forget_remote(self, handle: WorkerHandle) -> None:
        """A remote worker gone for good: its entry, its binding and its route replica go."""
        self.set_state(handle, S.STOPPED, "forgotten after being lost")
        self.remove(handle)

    async def stop(self, grace_s: float) -> None:
        self._stopping = True
        if self._upkeep_task is not None:
            self._upkeep_task.cancel()
        if self.cluster_loads is not None:  # this gateway's wants go with it
            await self.cluster_loads.stop()
        if self.cluster_reloads is not None:
            await self.cluster_reloads.stop()
        if self.decisions is not None:  # resigning hands leadership over at once
            await self.decisions.stop()
        if self.cluster is not None:
            await self.cluster.stop()
        for handle in self.workers.values():
            if handle.process and handle.process.returncode is None:
                self.set_state(handle, S.DRAINING, "shutting down")
                self.link.send(handle.id, wire.Shutdown(grace_s))
        deadline = time.monotonic() + grace_s + 5.0
        for handle in self.workers.values():
            await self._reap(handle, max(deadline - time.monotonic(), 0.1))
            self.set_state(handle, S.STOPPED, "")
        tasks = [h.task for h in self.workers.values() if h.task is not None]
        tasks += [self._upkeep_task] if self._upkeep_task is not None else []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def mark_draining(self) -> None:
        """Shutdown has begun: nothing new is routed or started; in-flight jobs keep their worker."""
        self._draining = True
        for handle in self.workers.values():
            if handle.state in (S.READY, S.STARTING, S.LOADING, S.WARMING):
                self.set_state(handle, S.DRAINING, "shutting down")

    def on_message(self, worker_id: str, message: wire.Message, key: WorkerKey | None = None) -> None:
        """A lifecycle frame; `key` is the CURVE key of a frame that came over tcp (the link has
        checked that a local id never arrives over tcp, nor a remote id from another key)."""
        handle = self.workers.get(worker_id)
        if handle is not None:
            with worker_log_context(handle.id, handle.model.name):
                self._on_handle_message(handle, message, key)
            return
        if key is not None:
            self.remote.on_unknown(worker_id, message, key)
        else:
            logger.warning("frame from unknown worker %s dropped", worker_id)

    def _on_handle_message(self, handle: WorkerHandle, message: wire.Message, key: WorkerKey | None) -> None:
        worker_id = handle.id
        remote = key is not None
        if handle.remote != remote:
            logger.warning("frame for worker %s on the wrong socket dropped", worker_id)
            return
        if remote and isinstance(message, wire.Hello):
            self.remote.rejoin(handle, message)
            return
        if isinstance(message, wire.Heartbeat):
            if not remote and handle.pid is None:
                return  # queued by a process that has since exited: its figures describe nothing
            load_before = handle.load
            handle.reported = message.state
            handle.on_heartbeat(message.stats, time.monotonic(), message.load)
            if remote and handle.load != load_before:
                self._on_state(handle)  # room another gateway freed on it: waiting requests look again
        elif isinstance(message, wire.Status):
            # Frames of a process that has since died may still be queued: only a live one moves on.
            if message.state is S.STOPPED:
                if remote:  # a local worker's exit is seen at once by its process watch
                    self.remote.departed(handle, message.detail)
            elif message.state is S.DRAINING and handle.state in HOLDS_PROCESS:
                self.set_state(handle, S.DRAINING, message.detail)
            elif message.state is S.UNLOADED and remote:  # a standby worker, without its model
                handle.standby_epoch = message.epoch or 0
                handle.forget_process()
                self.set_state(handle, S.UNLOADED, message.detail)
            elif message.state in STARTUP and handle.state in (*STARTUP, S.UNLOADED):
                handle.detail, handle.progress = message.detail, message.progress
                self.set_state(handle, message.state, message.detail)
        elif isinstance(message, wire.Ready):
            if self._stopping or handle.retiring or handle.state not in STARTUP:
                return
            handle.info, handle.ready_message = message.info, message
            handle.ready_at = handle.last_used = time.monotonic()
            handle.detail, handle.progress = "", None
            self.set_state(handle, S.READY, "")
            logger.info("worker %s ready (model %s, pid %s)", handle.id, handle.model.name, handle.pid)
            if self.cluster_loads is not None:
                self.cluster_loads.satisfied(handle.model.name)
        elif isinstance(message, wire.Hello):
            if message.version != wire.PROTOCOL_VERSION:
                reason = f"protocol version {message.version} != gateway's {wire.PROTOCOL_VERSION}"
                logger.error("worker %s refused: %s", worker_id, reason)
                handle.last_error = handle.death_cause = reason
                self._kill(handle)
        elif isinstance(message, wire.Fatal):
            handle.death_cause = message.message
            # A warning: the ERROR line that says why it stopped, and how many jobs end with it,
            # follows once its process is gone (one ERROR line per dying worker).
            logger.warning("worker %s reported a fatal error: %s", worker_id, message.message)
            # Its requests end now, with the cause it gave, not when its process is finally gone
            # (tearing down torch can take seconds, and a watchdog must not rename the cause meanwhile).
            self.fail_requests(handle, message.message)
            if not remote and handle.state in LIVE and not (self._stopping or handle.retiring):
                # It takes nothing new while its process winds down; the restart follows its exit.
                self.set_state(handle, S.RESTARTING, f"restarts once it exits after: {message.message}")

    # ---- per-worker task ---------------------------------------------------------------------

    async def _keep_running(self, handle: WorkerHandle) -> None:
        bind_worker_log_context(handle.id, handle.model.name)  # every line of this task names the worker
        server = self.registry.server
        backoff = server.restart_backoff_s
        while not (self._stopping or handle.retiring):
            try:
                await self.loads.before_spawn(handle)
            except LoadRefused as exc:
                handle.last_error = str(exc)
                logger.error("worker %s not started: %s", handle.id, exc)
                if handle.state is not S.STARTING:
                    self.set_state(handle, S.STARTING, "checking before the load")
                retry = f"POST /admin/models/{handle.model.name}/load to retry"
                self.set_state(handle, S.FAILED, f"{exc}; {retry}")
                return
            await self._spawn(handle)
            exit_reason = await self._watch(handle)
            handle.process_gone()  # no process now: nothing to show or to watch
            reason = f"{handle.death_cause} ({exit_reason})" if handle.death_cause else exit_reason
            stopped_on_purpose = self._stopping or handle.retiring
            if not stopped_on_purpose:  # the one line that says why, before each request ends with it
                held = len(self.link.jobs_of(handle.id))
                logger.error("worker %s stopped: %s; its %d job(s) in flight end", handle.id, reason, held)
            self.fail_requests(handle, reason)
            if stopped_on_purpose:
                return  # stop() or retire() decides the final state
            if self._draining:
                self.set_state(handle, S.STOPPED, f"exited while shutting down: {reason}")
                return
            # A crash loop is a worker that cannot get to ready; one that served and then died is
            # restarted, with a backoff that resets once it has stayed up for a while.
            if handle.ready_at is None:
                handle.consecutive_failures += 1
            else:
                handle.consecutive_failures = 0
                if time.monotonic() - handle.ready_at >= STABLE_AFTER_S:
                    backoff = server.restart_backoff_s
            handle.last_error = reason
            if handle.consecutive_failures >= server.restart_limit:
                detail = f"{handle.consecutive_failures} failed starts; last: {reason}"
                self.set_state(handle, S.FAILED, detail)
                return
            self.set_state(handle, S.RESTARTING, f"restart in {backoff:.1f}s after: {reason}")
            await asyncio.sleep(backoff)
            if self._draining:
                return  # shutdown began during the backoff: stop() ends it
            backoff = min(backoff * 2, server.restart_backoff_max_s)
            handle.restarts += 1

    async def _spawn(self, handle: WorkerHandle) -> None:
        model = handle.model
        # Workers never see API keys: a worker holds a model, not the gateway's credentials.
        env = {k: v for k, v in os.environ.items() if k not in API_KEY_VARIABLES}
        # CPU workers see no GPU at all; GPU workers see only theirs, renumbered from 0.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in handle.gpus)
        env.setdefault("PYTHONUNBUFFERED", "1")
        handle.forget_process()
        handle.death_cause = None
        self.set_state(handle, S.STARTING, "spawning process")
        spec = worker_spec(model, self.registry.server.heartbeat_interval_s)
        handle.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "model_worker",
            "--connect",
            self.link.endpoint,
            "--worker-id",
            handle.id,
            "--spec",
            json.dumps(asdict(spec)),
            "--parent-pid",
            str(os.getpid()),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
        )
        handle.pid = handle.process.pid
        handle.spawned_at = time.monotonic()
        handle.step_watch = StepWatch(handle.spawned_at)
        self.link.last_seen[handle.id] = handle.spawned_at
        logger.info("spawned worker %s for model %s (pid %s)", handle.id, model.name, handle.pid)

    async def _watch(self, handle: WorkerHandle) -> str:
        """Return when the worker is gone, with the reason; kill it if the watchdog says so."""
        assert handle.process is not None
        server = self.registry.server
        exited = asyncio.create_task(handle.process.wait())
        while True:
            done, _ = await asyncio.wait({exited}, timeout=min(server.heartbeat_interval_s, 1.0))
            if done:
                code = exited.result()
                return f"exited with code {code}" if code >= 0 else f"killed by signal {-code}"
            cause = death_cause(handle, self.link, server, time.monotonic())
            if cause is not None:
                # A cause the worker reported itself (Fatal) stays: it says why it stalled.
                handle.death_cause = handle.death_cause or cause
                self._kill(handle)

    def fail_requests(self, handle: WorkerHandle, reason: str) -> None:
        """The worker is gone or unreachable: every request it held ends now with a clear error."""
        message = f"the worker for model '{handle.model.name}' failed: {reason}"
        self.link.fail_worker(handle.id, WorkerFailed(message))

    def set_state(self, handle: WorkerHandle, state: WorkerState, detail: str) -> None:
        if handle.move_to(state, detail):
            self.loads.after_state(handle)
            self._on_state(handle)

    # ---- helpers -----------------------------------------------------------------------------

    def _restarts_so_far(self, model: str, replica: int) -> int:
        """What a model replica's workers restarted before this one: those removed, and one still
        draining for a reload (each count already includes its predecessors')."""
        present = (h for h in self.workers.values() if not h.remote and h.model.name == model)
        counts = [h.restarts for h in present if h.replica == replica]
        return max([self._removed_restarts.get((model, replica), 0), *counts])

    def _kill(self, handle: WorkerHandle) -> None:
        if handle.process and handle.process.returncode is None:
            handle.process.send_signal(signal.SIGKILL)

    async def _reap(self, handle: WorkerHandle, timeout: float) -> None:
        process = handle.process
        if process is None or process.returncode is not None:
            return
        try:
            await asyncio.wait_for(process.wait(), timeout)
        except asyncio.TimeoutError:
            logger.warning("worker %s did not exit in time; killing it", handle.id)
            self._kill(handle)
            await process.wait()
