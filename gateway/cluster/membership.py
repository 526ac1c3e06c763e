"""What every membership and leadership backend shares: the worker record, the change events, the
two interfaces the gateway calls, and the table that turns snapshots into join/leave events.

Runs in the gateway process. The worker publishes its own record (model_worker.registration, the
same JSON fields) without importing this module: the two processes never import each other.

A backend (etcd or Kubernetes) owns how records are found; the gateway sees only `Membership`
(who is there now, and what changed) and `Leader` (am I the one who decides, who does now, and
claim a decision exactly once). Both keep working from their last view while their backend is
unreachable; `Leader.holder` alone asks the backend each time, and says so when it cannot
(`HolderUnknown`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Capacity(BaseModel):
    """What a worker admits at once; it enforces this itself, whatever the gateways send."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    max_jobs: int = Field(ge=1, description="Jobs the worker runs at once.")
    max_queue: int = Field(ge=0, description="Jobs it holds waiting beyond those.")


class WorkerRecord(BaseModel):
    """One worker as the gateways find it. Records come from other processes (and may come from a
    newer version), so unknown fields are ignored here; `protocol_version` is what decides
    whether a gateway may talk to the worker, at the handshake."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    worker_id: str = Field(min_length=1, description="Unique in the cluster, e.g. MODEL@HOST-or-POD.")
    model: str = Field(min_length=1, description="The registry name of the model it serves.")
    replica: int = Field(ge=0, description="Its replica index within the model.")
    endpoint: str = Field(pattern=r"^tcp://", description="Where gateways connect (tcp://host:port).")
    public_key: str | None = Field(
        None,
        min_length=40,
        max_length=40,
        description="The worker's CURVE public key (Z85). None: the cluster's shared worker key.",
    )
    capacity: Capacity | None = Field(None, description="None: learned from the worker's hello.")
    protocol_version: int | None = Field(None, ge=1, description="None: learned from the worker's hello.")

    def encode(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> WorkerRecord:
        return cls.model_validate_json(data)


@dataclass(frozen=True)
class MembershipChange:
    """A worker appeared (`join`) or went away (`leave`). A record that changed in place (a
    restarted worker with a new key or port) is a leave of the old record, then a join."""

    kind: Literal["join", "leave"]
    record: WorkerRecord


class Membership(Protocol):
    """The gateway's view of the workers of the cluster."""

    async def start(self) -> None:
        """Begin listing and watching in the background; returns at once (the source may be down)."""

    async def stop(self) -> None: ...

    async def synced(self) -> None:
        """Returns once the first full listing has been taken."""

    @property
    def connected(self) -> bool:
        """Whether the view is being kept current; while False, it is the last one known."""

    def members(self) -> Mapping[str, WorkerRecord]:
        """The workers now, by worker id."""

    def changes(self) -> AsyncIterator[MembershipChange]:
        """Every change in order, beginning with a join for each worker of the first listing.
        One consumer: the gateway's link layer, which connects on join and forgets on leave."""


class HolderUnknown(Exception):
    """The backend could not be read (unreachable, or no answer in time): who leads is not known."""


class Leader(Protocol):
    """One gateway of many decides what must be decided once (loads, GPU groups, reloads)."""

    async def start(self) -> None:
        """Campaign in the background until `resign` or `stop`; returns at once."""

    async def resign(self) -> None:
        """Give up leadership now (another takes over at once) and stop campaigning."""

    async def stop(self) -> None:
        """Resign if leading, and release every resource."""

    @property
    def is_leader(self) -> bool: ...

    @property
    def identity(self) -> str: ...

    async def holder(self) -> str | None:
        """The identity of the gateway that holds a live leadership now, read from the backend (this
        gateway's own, when it leads); None when none does (a takeover is due). Raises
        `HolderUnknown` when the backend cannot be read."""

    async def claim(self, decision: str) -> bool:
        """Atomically mark `decision` (a key such as `load/qwen/3`) as taken by this leader: True
        for exactly one caller in the cluster, ever (until `forget`); False if someone already
        did, or if this gateway is not the leader."""

    async def forget(self, decision: str) -> None:
        """Remove a decision's mark, so that it may be taken again."""


async def decide_once(leader: Leader, decision: str, action: Callable[[], Awaitable[T]]) -> T | None:
    """Run `action` if this gateway leads and is the first to claim `decision`; else None. The
    claim is taken before the action runs: a leader that dies in the middle leaves the decision
    claimed, and the next leader sees that (it does not run it again by itself)."""
    if not leader.is_leader or not await leader.claim(decision):
        return None
    return await action()


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel `task` and wait for its end. Cancelled again until it ends: aetcd swallows a
    CancelledError that lands while it shuts a watch stream down (watcher._terminate_stream)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    if not task.cancelled() and task.exception() is not None:
        logger.debug("%s ended with %r", task.get_name(), task.exception())


class MemberTable:
    """The current records and the queue of changes; backends feed it snapshots or single
    updates, and it emits exactly the difference."""

    def __init__(self) -> None:
        self._records: dict[str, WorkerRecord] = {}
        self._changes: asyncio.Queue[MembershipChange] = asyncio.Queue()

    def members(self) -> Mapping[str, WorkerRecord]:
        return dict(self._records)

    def put(self, record: WorkerRecord) -> None:
        old = self._records.get(record.worker_id)
        if old == record:
            return
        if old is not None:
            self._emit("leave", old)
        self._records[record.worker_id] = record
        self._emit("join", record)

    def remove(self, worker_id: str) -> None:
        old = self._records.pop(worker_id, None)
        if old is not None:
            self._emit("leave", old)

    def replace(self, records: Mapping[str, WorkerRecord]) -> None:
        """A fresh full listing: leaves for what is gone or changed, joins for what is new."""
        for worker_id in [w for w in self._records if records.get(w) != self._records[w]]:
            self.remove(worker_id)
        for record in records.values():
            self.put(record)

    async def changes(self) -> AsyncIterator[MembershipChange]:
        while True:
            yield await self._changes.get()

    def _emit(self, kind: Literal["join", "leave"], record: WorkerRecord) -> None:
        logger.info(
            "worker %s %s (model %s, %s)", record.worker_id, kind + "s", record.model, record.endpoint
        )
        self._changes.put_nowait(MembershipChange(kind, record))
