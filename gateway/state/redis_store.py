"""The Redis backend of the response store: shared by every gateway that names the same Redis.

Runs in the gateway process, on its asyncio loop (redis-py's asyncio client; nothing blocks the
loop). Owns one Redis client and the keys `PREFIX + "response:" + OWNER + ":" + ID`, one per stored
response, each holding the record as JSON and expiring `retention_s` after the response was created
(Redis deletes it; no purge runs here). The owner is part of the key, so a read or delete by
another API key names a key that does not exist: absent, exactly like a missing response, with no
read-then-check race. A response's conversation is stored whole with it, so continuing a response
(`previous_response_id`) is one GET on any gateway.

When Redis cannot be reached, each call fails within `CONNECT_TIMEOUT_S` / `COMMAND_TIMEOUT_S` (plus
one immediate retry, which replaces a pooled connection that a Redis restart broke) with
StoreUnavailable; the first failure logs a warning, the first success after it an info line.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from gateway.state.response_store import StoredResponse, StoreUnavailable

logger = logging.getLogger(__name__)
T = TypeVar("T")

CONNECT_TIMEOUT_S = 1.0
COMMAND_TIMEOUT_S = 2.0  # a stored response may be a long text


class RedisResponseStore:
    def __init__(self, url: str, prefix: str, retention_s: float) -> None:
        self.prefix = prefix
        self.retention_s = retention_s
        # No connection is made here: the first command connects.
        self._redis: Any = aioredis.from_url(
            url,
            socket_timeout=COMMAND_TIMEOUT_S,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            retry=Retry(NoBackoff(), 1),
            decode_responses=True,
        )
        self._failing = False

    def _key(self, response_id: str, owner: str) -> str:
        return f"{self.prefix}response:{owner}:{response_id}"

    async def _call(self, command: Callable[[], Awaitable[T]]) -> T:
        try:
            result = await command()
        except (redis.exceptions.RedisError, OSError) as exc:
            if not self._failing:
                logger.warning("Redis unreachable (%s): stored responses are unavailable", type(exc).__name__)
            self._failing = True
            raise StoreUnavailable(f"Redis unreachable ({type(exc).__name__})") from exc
        if self._failing:
            self._failing = False
            logger.info("Redis reachable again: stored responses are available again")
        return result

    async def check(self) -> None:
        await self._call(self._redis.ping)

    async def put(self, record: StoredResponse) -> None:
        fields = {
            "created_at": record.created_at,
            "response": record.response,
            "conversation": record.conversation,
        }
        value = json.dumps(fields, ensure_ascii=False)
        # Relative expiry (Redis's own clock), counted from when the response was created.
        left_ms = max(1, round((record.created_at + self.retention_s - time.time()) * 1000))
        key = self._key(record.id, record.owner)
        await self._call(lambda: self._redis.set(key, value, px=left_ms))

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        value = await self._call(lambda: self._redis.get(self._key(response_id, owner)))
        if value is None:
            return None
        fields = json.loads(value)
        return StoredResponse(
            response_id, owner, fields["created_at"], fields["response"], fields["conversation"]
        )

    async def delete(self, response_id: str, owner: str) -> bool:
        deleted = await self._call(lambda: self._redis.delete(self._key(response_id, owner)))
        return bool(deleted)

    async def close(self) -> None:
        await self._redis.aclose()
