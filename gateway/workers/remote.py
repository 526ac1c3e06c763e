"""Workers on other hosts: joining over the CURVE tcp listener, losing contact, and rejoining.

Runs in the gateway process, on its asyncio loop, as part of the supervisor. Owns the membership of
remote workers: a worker whose id is `MODEL@SOMETHING` joins with a Hello when its CURVE key is
authorized and names MODEL among the models it may serve; its id is then bound to that key (the
link refuses the id from any other key or socket). Membership is bounded: at most `max_workers` in
all and `max_workers_per_key` per key, and a worker lost for `forget_lost_after_s` is forgotten.
When no frame arrives for `heartbeat_timeout_s` a worker is `lost` (unready; its requests end with a
clear error and are never re-sent); when frames arrive again it rejoins, and the jobs it still holds
for those ended requests are cancelled, so no request runs twice. A worker that exits on purpose
(SIGTERM) says so in its last frame (Status `stopped`): it is `lost` at once, and nothing waits for
the heartbeat timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from gateway.link.handle import WorkerHandle
from gateway.link.remote_keys import WorkerKey
from gateway.observability.logging_setup import RateLimitedLog, bind_worker_log_context
from wire import messages as wire
from wire.states import WorkerState

if TYPE_CHECKING:
    from gateway.workers.pool import RemotePool

S = WorkerState

logger = logging.getLogger(__name__)
REINTRODUCE_EVERY_S = 5.0
MAX_ASKED = 1024  # ids asked to reintroduce themselves, remembered (then the oldest are dropped)


class RemoteMembers:
    def __init__(self, pool: RemotePool) -> None:
        self.pool = pool
        self._asked: dict[str, float] = {}
        self._refusals = RateLimitedLog(logger, every_s=10.0)

    def on_unknown(self, worker_id: str, message: wire.Message, key: WorkerKey) -> None:
        """A frame over tcp from a worker we do not know: a new worker, or one that outlived us."""
        if isinstance(message, wire.Hello):
            self.join(worker_id, message, key)
            return
        now = time.monotonic()
        if now - self._asked.get(worker_id, 0.0) >= REINTRODUCE_EVERY_S:
            # The gateway restarted while this worker kept running: ask it to introduce itself.
            if len(self._asked) >= MAX_ASKED:
                self._asked = dict(sorted(self._asked.items(), key=lambda item: item[1])[MAX_ASKED // 2 :])
            self._asked[worker_id] = now
            self.pool.link.send(worker_id, wire.Reintroduce())

    def _refuse(self, worker_id: str, key: WorkerKey, reason: str) -> None:
        # Limited per key: a key may flood Hellos, but not the log.
        self._refusals.warning("key %r: remote worker %r refused: %s", key.name, worker_id, reason)
        self.pool.link.send(worker_id, wire.Shutdown(0.0))

    def join(self, worker_id: str, hello: wire.Hello, key: WorkerKey) -> WorkerHandle | None:
        pool = self.pool
        remote = pool.registry.server.remote_workers
        model = pool.registry.model(worker_id.split("@", 1)[0])
        if model is None or not model.remote or "@" not in worker_id:
            self._refuse(worker_id, key, "its id must be MODEL@NAME for a remote model")
            return None
        if not key.allows(model.name):
            self._refuse(worker_id, key, f"the key may not serve model {model.name!r}")
            return None
        if hello.version != wire.PROTOCOL_VERSION:
            self._refuse(worker_id, key, f"protocol {hello.version} != {wire.PROTOCOL_VERSION}")
            return None
        members = [h for h in pool.workers.values() if h.remote]
        if remote is not None and len(members) >= remote.max_workers:
            self._refuse(worker_id, key, f"max_workers={remote.max_workers} remote workers are known already")
            return None
        same_key = sum(1 for h in members if h.key_name == key.name)
        if remote is not None and same_key >= remote.max_workers_per_key:
            self._refuse(
                worker_id, key, f"max_workers_per_key={remote.max_workers_per_key} already use this key"
            )
            return None
        handle = WorkerHandle(id=worker_id, model=model, remote=True, pid=hello.pid, key_name=key.name)
        pool.link.bind_remote(worker_id, key)
        handle.spawned_at = time.monotonic()
        pool.workers[worker_id] = handle
        pool.set_state(handle, S.STARTING, f"remote worker joined (pid {hello.pid})")
        handle.task = asyncio.get_running_loop().create_task(self._watch(handle), name=f"remote:{worker_id}")
        logger.info("remote worker %s joined for model %s", worker_id, model.name)
        return handle

    def rejoin(self, handle: WorkerHandle, hello: wire.Hello) -> None:
        """The same id said Hello again: a restarted process. Whatever it held is gone with it."""
        handle.pid = hello.pid
        handle.forget_process()
        handle.stale_rids.clear()
        self.pool.set_state(handle, S.STARTING, "remote worker restarted")

    def departed(self, handle: WorkerHandle, detail: str) -> None:
        """The worker's last frame before it exits: its requests end now, and it is lost until it
        (or a new process under its id) says Hello again."""
        if handle.state is S.LOST:
            return
        reason = f"remote worker {handle.id} exited ({detail or 'stopped'})"
        self.pool.fail_requests(handle, reason)
        handle.last_error = reason
        handle.stale_rids = []
        # The goodbye itself is a frame: forget it, or the watch would take the worker for back.
        self.pool.link.last_seen.pop(handle.id, None)
        self._mark_lost(handle, reason)
        logger.info("remote worker %s left: %s", handle.id, detail)

    def _mark_lost(self, handle: WorkerHandle, reason: str) -> None:
        handle.lost_since = time.monotonic()
        self.pool.set_state(handle, S.LOST, reason)

    async def _watch(self, handle: WorkerHandle) -> None:
        bind_worker_log_context(handle.id, handle.model.name)
        server = self.pool.registry.server
        link = self.pool.link
        while True:
            await asyncio.sleep(min(server.heartbeat_interval_s, 0.5))
            silent_s = time.monotonic() - link.last_seen.get(handle.id, 0.0)
            remote = server.remote_workers
            lost_for = time.monotonic() - (handle.lost_since or time.monotonic())
            if handle.state is S.LOST and remote is not None and lost_for > remote.forget_lost_after_s:
                logger.info("remote worker %s lost for %.0fs; forgetting it", handle.id, lost_for)
                self.pool.forget_remote(handle)
                return
            # Loading blocks the worker's only thread (no heartbeats), so it gets the start deadline.
            starting = handle.state in (S.STARTING, S.LOADING, S.WARMING)
            limit = server.worker_start_timeout_s if starting else server.heartbeat_timeout_s
            if handle.state is not S.LOST and silent_s > limit:
                handle.stale_rids = [job.rid for job in link.jobs_of(handle.id)]
                reason = f"lost contact with remote worker {handle.id} (no frame for {silent_s:.0f}s)"
                self.pool.fail_requests(handle, reason)
                handle.last_error = reason
                self._mark_lost(handle, reason)
            elif handle.state is S.LOST and silent_s < server.heartbeat_interval_s * 3:
                link.reachable(handle.id)
                for rid in handle.stale_rids:
                    link.send(handle.id, wire.Cancel(rid))  # ended on our side: must not run on
                logger.info(
                    "remote worker %s is back; cancelled %d stale job(s)", handle.id, len(handle.stale_rids)
                )
                handle.stale_rids = []
                back = S.READY if handle.info else S.LOADING
                if handle.reported is S.UNLOADED:  # a standby worker (cluster mode)
                    back = S.UNLOADED
                self.pool.set_state(handle, back, "reconnected")
