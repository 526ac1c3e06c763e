"""One connection to an etcd cluster, over its gRPC API (aetcd, native asyncio: nothing blocks the
event loop), moving to the next endpoint when the one in use fails.

Runs in the gateway process (membership, leadership); each user holds its own session. A worker's
registration has its own small client (model_worker.registration). Imports nothing else of the
gateway.

Why these gRPC options: the channel retries a lost connection with exponential backoff that grows
to two minutes by default; capped at one second, a restarted etcd is seen again within a second.
Keepalive pings find a peer that vanished without closing the connection (a host cut off), which
would otherwise leave a watch waiting forever; 10 s stays above etcd's own floor for client pings
(--grpc-keepalive-min-time, 5 s), below which etcd closes the connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import aetcd
import aetcd.exceptions

logger = logging.getLogger(__name__)

_CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.min_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 3_000,
    "grpc.keepalive_permit_without_calls": 1,
}

# What "etcd cannot be reached or did not answer in time" looks like from aetcd. Other ClientErrors
# (a wrong argument, a compacted revision) are the caller's to handle.
UNREACHABLE: tuple[type[BaseException], ...] = (
    aetcd.exceptions.ConnectionFailedError,
    aetcd.exceptions.ConnectionTimeoutError,
    aetcd.exceptions.WatchTimeoutError,
    aetcd.exceptions.InternalError,
    TimeoutError,
    OSError,
)


def prefix_end(prefix: bytes) -> bytes:
    """The end of the key range holding every key that starts with `prefix` (etcd's convention)."""
    return aetcd.utils.prefix_range_end(prefix)  # type: ignore[no-any-return]


class EtcdSession:
    """A client for one endpoint at a time; `failed()` moves to the next one."""

    def __init__(self, endpoints: Sequence[str], request_timeout_s: float) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint given")
        self.endpoints = list(endpoints)
        self.request_timeout_s = request_timeout_s
        self._index = 0
        self._client: Any = None

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._index]

    @property
    def client(self) -> Any:
        """The aetcd client of the current endpoint (its calls time out after request_timeout_s)."""
        if self._client is None:
            host, _, port = self.endpoint.rpartition(":")
            self._client = aetcd.Client(
                host=host.strip("[]"),
                port=int(port),
                # aetcd types it int; gRPC takes any number of seconds.
                timeout=self.request_timeout_s,
                options=_CHANNEL_OPTIONS,
                connect_wait_timeout=max(1, round(self.request_timeout_s)),
            )
        return self._client

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`client.<method>(...)`, bounded by the request deadline even where aetcd sets none."""
        function = getattr(self.client, method)
        return await asyncio.wait_for(function(*args, **kwargs), self.request_timeout_s)

    async def failed(self, error: BaseException) -> None:
        """The current endpoint failed: drop its client and use the next endpoint from now on."""
        logger.debug("etcd %s failed: %s", self.endpoint, error)
        await self.close()
        self._index = (self._index + 1) % len(self.endpoints)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await asyncio.wait_for(client.close(), self.request_timeout_s)
            except (*UNREACHABLE, aetcd.exceptions.ClientError) as exc:
                logger.debug("closing the etcd client: %s", exc)
