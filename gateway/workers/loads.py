"""What must hold before a model's worker process starts: weights on disk, group peers gone, a load
slot free, and room on its GPUs.

Runs in the gateway process, on its asyncio loop, inside the supervisor's per-worker task (so a
retire or unload that cancels the task also cancels the wait). Owns, in this order:

0. a local model's folder: one that is not there refuses the start at once, naming the file, the
   model and the field (a worker would only crash on it, `restart_limit` times, with the engine's
   own and less clear message);
1. the Hugging Face download of an `hf://` model (in a thread; progress shown as the worker's
   detail and progress, as loading is);
2. exclusive groups: a model of an `exclusive_group` first drains and unloads the other models of
   its group that hold a process (llama-swap's swap); their waiting requests end with
   `model_swapped`;
3. `server.max_concurrent_loads`: a worker holds a load slot from here until it leaves the start-up
   states (ready, failed, gone);
4. before an on-demand load on GPUs, their free memory now must hold the model's weights.

A refusal raises `LoadRefused`; the supervisor marks the worker failed with its reason, so waiting
requests get a 503 that says why.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from gateway.config import hub
from gateway.config.host_checks import is_folder
from gateway.config.placement import free_memory_bytes, memory_shortfall
from gateway.link.handle import WorkerHandle
from wire.states import HOLDS_PROCESS, WorkerState

if TYPE_CHECKING:
    from gateway.workers.pool import WorkerPool

logger = logging.getLogger(__name__)
S = WorkerState
STARTUP = (S.STARTING, S.LOADING, S.WARMING)

# (model name, why) -> how many requests it ended; Gateway.unload, wired by gateway.core.
Unloader = Callable[[str, str], Awaitable[int]]
FreeMemory = Callable[[list[int]], "dict[int, int] | None"]


class LoadRefused(Exception):
    """The worker must not start; str() is the reason shown to operators and waiting clients."""


class LoadGate:
    def __init__(self, pool: WorkerPool, free_memory: FreeMemory = free_memory_bytes) -> None:
        self.pool = pool
        self.free_memory = free_memory
        self.unload: Unloader | None = None
        limit = pool.registry.server.max_concurrent_loads
        self._slots = asyncio.Semaphore(limit) if limit else None
        self._holding: set[str] = set()  # ids of the workers that hold a load slot
        self._group_locks: dict[str, asyncio.Lock] = {}

    async def before_spawn(self, handle: WorkerHandle) -> None:
        model = handle.model
        if model.hub is not None:
            await self._download(handle)
        elif not await asyncio.to_thread(is_folder, model.path):
            source = self.pool.registry.source
            where = f"{source}: " if source is not None else ""
            where += f"model {model.name!r}, field 'path'"
            raise LoadRefused(f"{where}: {model.path} is not a folder on this host")
        if model.exclusive_group is not None:
            await self._swap_out_peers(handle, model.exclusive_group)
        if self._slots is not None and handle.id not in self._holding:
            if self._slots.locked():
                self.pool.set_state(handle, S.STARTING, "waiting for a free load slot")
            await self._slots.acquire()
            self._holding.add(handle.id)
        if model.load == "on_demand" and handle.gpus:
            free = await asyncio.to_thread(self.free_memory, handle.gpus)
            shortfall = memory_shortfall(model, handle.gpus, free) if free is not None else None
            if shortfall is not None:
                self.release(handle)
                raise LoadRefused(shortfall)

    def after_state(self, handle: WorkerHandle) -> None:
        """A state change: a worker that left the start-up states gives its load slot back."""
        if handle.state not in STARTUP:
            self.release(handle)

    def release(self, handle: WorkerHandle) -> None:
        if handle.id in self._holding and self._slots is not None:
            self._holding.discard(handle.id)
            self._slots.release()

    async def _download(self, handle: WorkerHandle) -> None:
        model = handle.model
        assert model.hub is not None
        cache_dir = self.pool.registry.server.model_cache_dir
        assert cache_dir is not None  # parse_registry always sets it
        if hub.is_downloaded(model.path):
            return
        loop = asyncio.get_running_loop()
        self.pool.set_state(handle, S.STARTING, f"downloading {model.hub}")
        logger.info("downloading %s into %s", model.hub, model.path)

        def progress(done: int, total: int, what: str) -> None:
            def show() -> None:
                handle.progress = done / total if total else None
                handle.detail = f"downloading {model.hub}: {done}/{total} files"
                logger.info("%s: %d/%d files (%s)", model.hub, done, total, what)

            loop.call_soon_threadsafe(show)

        try:
            await asyncio.to_thread(hub.download, model.hub, cache_dir, progress)
        except hub.DownloadError as exc:
            raise LoadRefused(str(exc)) from None
        handle.progress = None
        logger.info("downloaded %s", model.hub)

    async def _swap_out_peers(self, handle: WorkerHandle, group: str) -> None:
        lock = self._group_locks.setdefault(group, asyncio.Lock())
        async with lock:  # one swap at a time per group
            peers = sorted(
                {
                    peer.model.name
                    for peer in self.pool.workers.values()
                    if peer.model.exclusive_group == group
                    and peer.model.name != handle.model.name
                    and (peer.state in HOLDS_PROCESS or (peer.task is not None and not peer.task.done()))
                }
            )
            for name in peers:
                if self.unload is None:
                    raise LoadRefused(f"cannot unload {name!r} of exclusive group {group!r}")
                self.pool.set_state(handle, S.STARTING, f"unloading {name} (exclusive group {group})")
                logger.info("exclusive group %s: unloading %s to load %s", group, name, handle.model.name)
                why = f"model '{name}' was unloaded to load '{handle.model.name}' (exclusive group {group})"
                await self.unload(name, why)
