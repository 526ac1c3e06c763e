"""The supervisor's slow rounds: idle workers unloaded.

Runs in the gateway process, on its asyncio loop: one task started with the supervisor, ticking
every half second. Owns the decisions taken on time alone, not on any frame: a ready worker of a
model with `idle_unload_s` that has had no request for that long is retired (its process exits,
its memory is free; the next request loads it again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from gateway.workers.handle import WorkerHandle

if TYPE_CHECKING:
    from gateway.workers.supervisor import Supervisor

logger = logging.getLogger(__name__)
TICK_S = 0.5


class Upkeep:
    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self._retiring: set[asyncio.Task[None]] = set()

    async def run_forever(self) -> None:
        try:
            while True:
                await asyncio.sleep(TICK_S)
                now = time.monotonic()
                for handle in list(self.supervisor.workers.values()):
                    if self._idle_too_long(handle, now):
                        self._unload(handle, now)
        finally:
            for task in self._retiring:
                task.cancel()
            await asyncio.gather(*self._retiring, return_exceptions=True)

    @staticmethod
    def _idle_too_long(handle: WorkerHandle, now: float) -> bool:
        idle_s = handle.model.idle_unload_s
        return bool(idle_s and handle.ready and not handle.in_flight and now - handle.last_used >= idle_s)

    def _unload(self, handle: WorkerHandle, now: float) -> None:
        logger.info("worker %s idle for %.0fs; unloading", handle.id, now - handle.last_used)
        task = asyncio.create_task(self.supervisor.retire(handle, 0.0))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
