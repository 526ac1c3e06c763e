"""What the supervisor's helpers may ask of it: narrow protocols instead of the whole supervisor.

Runs in the gateway process, on its asyncio loop. Owns the protocols only: `WorkerPool` (the
workers, the registry they come from, and the one way to change a worker's state), and the
additions each helper needs: `UpkeepPool` (gateway.workers.upkeep: launch and retire) and
`RemotePool` (gateway.workers.remote: the link, failing a worker's requests, forgetting a remote
worker). gateway.workers.loads needs only `WorkerPool`. The supervisor satisfies all three (mypy
checks it where it hands itself over), and tests can hand a helper something smaller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gateway.config.registry import Registry
    from gateway.link.handle import WorkerHandle
    from gateway.link.worker_link import WorkerLink
    from wire.states import WorkerState


class WorkerPool(Protocol):
    @property
    def registry(self) -> Registry: ...

    @property
    def workers(self) -> dict[str, WorkerHandle]: ...

    def set_state(self, handle: WorkerHandle, state: WorkerState, detail: str) -> None: ...


class UpkeepPool(WorkerPool, Protocol):
    def launch(self, handle: WorkerHandle) -> None: ...

    async def retire(self, handle: WorkerHandle, grace_s: float) -> None: ...


class RemotePool(WorkerPool, Protocol):
    @property
    def link(self) -> WorkerLink: ...

    def fail_requests(self, handle: WorkerHandle, reason: str) -> None: ...

    def forget_remote(self, handle: WorkerHandle) -> None: ...
