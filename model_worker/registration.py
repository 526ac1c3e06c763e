"""A listening worker's record in etcd: put under PREFIX/workers/WORKER_ID on a lease, kept alive
while the worker lives, revoked when it stops, so that gateways forget it at once (or, if it dies,
when the lease's TTL runs out).

Runs in a worker process started with `model-worker --listen` whose registry file says
`server.cluster.backend: etcd`, on a thread of its own with its own asyncio loop (aetcd is
asyncio-native; the engine thread and the link thread never wait for etcd). Owns the worker's etcd
client, its lease and its record. The record's JSON is the contract with the gateway's
`gateway.cluster.membership.WorkerRecord` (the two processes never import each other; a unit test
reads what this writes with the gateway's model).

While etcd cannot be reached the worker keeps serving (gateways that know it keep routing to it)
and keeps trying, moving to the next endpoint: the same lease when it is back in time, a new lease
and a new put when the old one expired meanwhile (a restarted etcd that lost its data, or an
outage longer than the TTL).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from typing import Any

import aetcd
import aetcd.exceptions
import msgspec

logger = logging.getLogger(__name__)

# As the gateway's etcd session (gateway.cluster.etcd_session): a restarted etcd is seen again within
# a second, and keepalive pings find a peer that vanished without closing the connection.
_CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.min_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 3_000,
    "grpc.keepalive_permit_without_calls": 1,
}
UNREACHABLE: tuple[type[BaseException], ...] = (
    aetcd.exceptions.ConnectionFailedError,
    aetcd.exceptions.ConnectionTimeoutError,
    aetcd.exceptions.InternalError,
    TimeoutError,
    OSError,
)


class Capacity(msgspec.Struct, frozen=True):
    max_jobs: int
    max_queue: int


class Record(msgspec.Struct, frozen=True, omit_defaults=True):
    """What gateways need to connect to this worker and route to it (read by the gateway as
    `WorkerRecord`; fields it does not know are ignored there)."""

    worker_id: str
    model: str
    replica: int
    endpoint: str
    public_key: str | None = None
    capacity: Capacity | None = None
    protocol_version: int | None = None

    def encode(self) -> bytes:
        return msgspec.json.encode(self)


def worker_key(prefix: str, worker_id: str) -> bytes:
    return f"{prefix}workers/{worker_id}".encode()


class Registration:
    """The record on its lease, in the background of an asyncio loop."""

    def __init__(
        self,
        record: Any,
        endpoints: Sequence[str],
        *,
        prefix: str = "/llm-gateway/",
        ttl_s: int = 10,
        request_timeout_s: float = 1.0,
        retry_interval_s: float = 1.0,
    ) -> None:
        """`record` has a `worker_id` and an `encode()` to JSON bytes (a `Record`)."""
        if not endpoints:
            raise ValueError("no etcd endpoint given")
        self.record = record
        self.key = worker_key(prefix, record.worker_id)
        self.ttl_s = ttl_s
        self.retry_interval_s = retry_interval_s
        self._endpoints = list(endpoints)
        self._index = 0
        self._request_timeout_s = request_timeout_s
        self._client: Any = None
        self._lease_id: int | None = None
        self._registered = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def registered(self) -> bool:
        """Whether the record is known to be in etcd now (False from the first failed refresh on)."""
        return self._registered.is_set()

    @property
    def endpoint(self) -> str:
        return self._endpoints[self._index]

    async def wait_registered(self) -> None:
        await self._registered.wait()

    async def start(self) -> None:
        """Register in the background (returns at once: a worker serves whether etcd answers or not)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"etcd-registration-{self.record.worker_id}")

    async def stop(self) -> None:
        """Remove the record now: revoking the lease deletes it, and every gateway sees it leave."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._lease_id is not None:
            try:
                await self._call("revoke_lease", self._lease_id)
            except UNREACHABLE as exc:
                logger.warning(
                    "could not remove worker %s from etcd (%s): gateways forget it when its lease "
                    "expires, within %s s",
                    self.record.worker_id,
                    type(exc).__name__,
                    self.ttl_s,
                )
            self._lease_id = None
        self._registered.clear()
        await self._close_client()

    async def _run(self) -> None:
        failing = False
        while True:
            try:
                if self._lease_id is None or not await self._refresh():
                    await self._register()
                if failing:
                    logger.info("etcd reachable again: worker %s is registered", self.record.worker_id)
                    failing = False
                await asyncio.sleep(self.ttl_s / 3)
            except UNREACHABLE as exc:
                self._registered.clear()
                if not failing:
                    logger.warning(
                        "etcd unreachable at %s (%s): worker %s goes on serving and keeps trying to register",
                        self.endpoint,
                        type(exc).__name__,
                        self.record.worker_id,
                    )
                    failing = True
                await self._close_client()
                self._index = (self._index + 1) % len(self._endpoints)
                await asyncio.sleep(self.retry_interval_s)

    async def _register(self) -> None:
        if self._lease_id is not None:  # expired: etcd deleted the record with it
            logger.info("the lease of worker %s expired; registering anew", self.record.worker_id)
        lease = await self._call("lease", self.ttl_s)
        self._lease_id = lease.id
        await self._call("put", self.key, self.record.encode(), lease=lease.id)
        self._registered.set()
        logger.info(
            "worker %s registered in etcd at %s (lease %x, TTL %s s)",
            self.record.worker_id,
            self.endpoint,
            lease.id,
            self.ttl_s,
        )

    async def _refresh(self) -> bool:
        """Keep the lease alive; False when etcd says it has expired."""
        reply = await self._call("refresh_lease", self._lease_id)
        if reply is None or reply.TTL <= 0:
            return False
        self._registered.set()
        return True

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`client.<method>(...)`, bounded by the request deadline even where aetcd sets none."""
        if self._client is None:
            host, _, port = self.endpoint.rpartition(":")
            self._client = aetcd.Client(
                host=host.strip("[]"),
                port=int(port),
                timeout=self._request_timeout_s,
                options=_CHANNEL_OPTIONS,
                connect_wait_timeout=max(1, round(self._request_timeout_s)),
            )
        function = getattr(self._client, method)
        return await asyncio.wait_for(function(*args, **kwargs), self._request_timeout_s)

    async def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await asyncio.wait_for(client.close(), self._request_timeout_s)
            except (*UNREACHABLE, aetcd.exceptions.ClientError) as exc:
                logger.debug("closing the etcd client: %s", exc)


class RegistrationThread:
    """A `Registration` on a daemon thread with its own loop, for the worker's synchronous main."""

    def __init__(self, registration: Registration) -> None:
        self.registration = registration
        self._loop = asyncio.new_event_loop()
        self._loop_ready = threading.Event()
        self._stop_event: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="etcd-registration", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        stop = asyncio.Event()
        self._stop_event = stop
        self._loop_ready.set()
        await self.registration.start()
        await stop.wait()
        await self.registration.stop()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Revoke the lease (gateways forget this worker at once) and end the thread."""
        if not self._thread.is_alive():
            return
        if self._loop_ready.wait(timeout_s) and self._stop_event is not None:
            self._loop.call_soon_threadsafe(self._stop_event.set)
        self._thread.join(timeout_s)
