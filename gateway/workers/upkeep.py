"""The supervisor's slow rounds: idle workers unloaded, failed workers tried again.

Runs in the gateway process, on its asyncio loop: one task started with the supervisor, ticking
every half second. Owns the two decisions taken on time alone, not on any frame:

- a ready worker of a model with `idle_unload_s` that has had no request for that long is retired
  (its process exits, its memory is free; the next request loads it again); a remote worker is
  not this gateway's to unload (in cluster mode the leader does: gateway.workers.cluster_loads);
- a worker `failed` for `server.retry_failed_after_s` is tried again: a startup model's worker is
  launched (another `restart_limit` starts), an on-demand model's goes back to `unloaded`, so its
  next request loads it. A crash loop that was caused by something passing (a full GPU, a
  model folder being copied) so heals without an operator.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from gateway.link.handle import WorkerHandle
from wire.states import WorkerState

if TYPE_CHECKING:
    from gateway.workers.pool import UpkeepPool

logger = logging.getLogger(__name__)
S = WorkerState
TICK_S = 0.5


class Upkeep:
    def __init__(self, pool: UpkeepPool) -> None:
        self.pool = pool
        self._retiring: set[asyncio.Task[None]] = set()

    async def run_forever(self) -> None:
        try:
            while True:
                await asyncio.sleep(TICK_S)
                now = time.monotonic()
                for handle in list(self.pool.workers.values()):
                    if self._idle_too_long(handle, now):
                        self._unload(handle, now)
                    elif self._failed_long_enough(handle, now):
                        self._retry(handle, now)
        finally:
            for task in self._retiring:
                task.cancel()
            await asyncio.gather(*self._retiring, return_exceptions=True)

    @staticmethod
    def _idle_too_long(handle: WorkerHandle, now: float) -> bool:
        idle_s = handle.model.idle_unload_s
        if handle.remote:  # idle for this gateway is not idle for all: the leader decides (cluster_loads)
            return False
        return bool(idle_s and handle.ready and not handle.in_flight and now - handle.last_used >= idle_s)

    def _failed_long_enough(self, handle: WorkerHandle, now: float) -> bool:
        retry_s = self.pool.registry.server.retry_failed_after_s
        if not retry_s or handle.state is not S.FAILED or handle.remote or handle.retiring:
            return False
        return now - handle.state_since >= retry_s and (handle.task is None or handle.task.done())

    def _unload(self, handle: WorkerHandle, now: float) -> None:
        logger.info("worker %s idle for %.0fs; unloading", handle.id, now - handle.last_used)
        task = asyncio.create_task(self.pool.retire(handle, 0.0))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def _retry(self, handle: WorkerHandle, now: float) -> None:
        failed_for = now - handle.state_since
        if handle.model.load == "on_demand":
            logger.warning("worker %s failed %.0fs ago; its next request loads it", handle.id, failed_for)
            detail = f"loads at its next request (failed: {handle.detail})"
            self.pool.set_state(handle, S.UNLOADED, detail)
            return
        logger.warning("worker %s failed %.0fs ago; trying again", handle.id, failed_for)
        handle.restarts += 1
        self.pool.launch(handle)
