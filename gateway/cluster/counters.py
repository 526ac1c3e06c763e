"""Rate limits and token usage per API key: counted in this gateway, or shared by every gateway
through Redis when `server.redis_url` is set.

Runs in the gateway process, on its asyncio loop. Owns `KeyCounters`, which the authenticator asks
before admitting a request (is the key over its rate limit, has it spent its budget?) and the
metrics recorder tells when a request finishes (the tokens it used).

Without Redis every figure is this process's (a limit of 100 requests a minute on three gateways
lets 300 through). With Redis:
- rate limits are one token bucket per key in Redis, updated by a Lua script that reads Redis's own
  clock, so gateways with skewed clocks agree;
- usage is INCRBY on one counter per key and UTC day or month (expiring after its period), added in
  batches every `FLUSH_INTERVAL_S`; budgets are checked against those counters.
Every figure is also counted locally. When Redis cannot be reached (each call waits at most
`REDIS_TIMEOUT_S`), limits and budgets fall back to the local figures, with one warning, and Redis is
tried again after `RETRY_AFTER_S`; when it answers again, an info line says so and the usage counted
meanwhile is added to it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from gateway.config.api_keys import ApiKey
from gateway.observability.usage import PERIODS, BudgetSpent, Period, UsageLedger, period_end, period_id

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.5
REDIS_TIMEOUT_S = 0.25
RETRY_AFTER_S = 1.0
# Seconds a usage counter outlives its period (a late flush still lands in the right one).
_EXPIRY_S: dict[Period, int] = {"day": 2 * 86_400, "month": 33 * 86_400}

_DOWN = object()  # what _call returns while Redis cannot be reached

# KEYS[1]: the bucket; ARGV[1]: requests per minute. Returns the seconds to wait (0 when admitted).
_TOKEN_BUCKET = """
local rpm = tonumber(ARGV[1])
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000 + math.floor(tonumber(now_parts[2]) / 1000)
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or rpm
local ts = tonumber(state[2]) or now
local rate = rpm / 60000.0
tokens = math.min(rpm, tokens + math.max(now - ts, 0) * rate)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / rate / 1000.0 end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], 120000)
return tostring(wait)
"""


class TokenBucket:
    """`rpm` requests per minute, with bursts of up to `rpm` once the bucket has filled."""

    def __init__(self, rpm: int, now: float) -> None:
        self.rpm = rpm
        self.tokens = float(rpm)
        self.updated = now

    def take(self, now: float) -> float:
        """0.0 if a request may go now; otherwise the seconds until one may."""
        rate = self.rpm / 60.0
        self.tokens = min(float(self.rpm), self.tokens + (now - self.updated) * rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / rate


class KeyCounters:
    def __init__(
        self,
        redis_url: str | None = None,
        prefix: str = "llm-gateway:",
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis_url = redis_url
        self.prefix = prefix
        self._clock = clock
        self._monotonic = monotonic
        self.usage = UsageLedger(clock)
        self._buckets: dict[str, TokenBucket] = {}
        self._redis: Any = None
        self._script: Any = None
        self._pending: dict[tuple[str, Period, str], int] = {}
        self._down_since: float | None = None  # monotonic; None while Redis answers
        self._flusher: asyncio.Task[None] | None = None

    @property
    def shared(self) -> bool:
        """Whether limits are shared right now (Redis configured and answering)."""
        return self._redis is not None and self._down_since is None

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.redis_url is None:
            return
        import redis.asyncio as aioredis

        self._redis = aioredis.from_url(
            self.redis_url,
            socket_timeout=REDIS_TIMEOUT_S,
            socket_connect_timeout=REDIS_TIMEOUT_S,
            decode_responses=True,
        )
        self._script = self._redis.register_script(_TOKEN_BUCKET)
        await self._call(self._redis.ping)
        if self.shared:
            logger.info("rate limits and budgets are shared through Redis")
        self._flusher = asyncio.create_task(self._flush_forever(), name="usage-flush")

    async def stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
            self._flusher = None
        if self._redis is not None:
            await self._flush()
            await self._redis.aclose()
            self._redis = None

    # -- what the authenticator asks ----------------------------------------------------------------

    async def rate_wait(self, key: ApiKey) -> float:
        """0.0 if the key may send a request now, else the seconds until it may."""
        if key.rate_limit_rpm is None:
            return 0.0
        local = self._local_rate_wait(key)
        if self._redis is None:
            return local
        shared = await self._call(self._script, keys=[self._key("rate", key.name)], args=[key.rate_limit_rpm])
        return local if shared is _DOWN else float(shared)

    def _local_rate_wait(self, key: ApiKey) -> float:
        assert key.rate_limit_rpm is not None
        now = self._monotonic()
        bucket = self._buckets.get(key.name)
        if bucket is None or bucket.rpm != key.rate_limit_rpm:
            bucket = self._buckets[key.name] = TokenBucket(key.rate_limit_rpm, now)
        return bucket.take(now)

    async def budget_spent(self, key: ApiKey) -> BudgetSpent | None:
        budgets = key.budgets
        if not any(budgets.values()):
            return None
        now = datetime.fromtimestamp(self._clock(), tz=timezone.utc)
        names = [self._usage_key(key.name, period, period_id(period, now)) for period in PERIODS]
        shared = await self._call(self._redis.mget, names) if self._redis is not None else _DOWN
        if not isinstance(shared, list):
            return self.usage.spent(key.name, budgets)
        for period, value in zip(PERIODS, shared, strict=True):
            budget = budgets.get(period)
            used = int(value or 0) + self._pending.get((key.name, period, period_id(period, now)), 0)
            if budget is not None and used >= budget:
                return BudgetSpent(period, budget, used, period_end(period, now))
        return None

    def retry_after_s(self, spent: BudgetSpent) -> int:
        return spent.retry_after_s(datetime.fromtimestamp(self._clock(), tz=timezone.utc))

    # -- what a finished request reports ------------------------------------------------------------

    def add_usage(self, key_name: str, tokens: int) -> None:
        self.usage.add(key_name, tokens)
        if self._redis is None or tokens <= 0:
            return
        now = datetime.fromtimestamp(self._clock(), tz=timezone.utc)
        for period in PERIODS:
            slot = (key_name, period, period_id(period, now))
            self._pending[slot] = self._pending.get(slot, 0) + tokens

    # -- Redis ----------------------------------------------------------------------------------------

    def _key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def _usage_key(self, key_name: str, period: Period, ident: str) -> str:
        return self._key("usage", key_name, period, ident)

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            await self._flush()

    async def _flush(self) -> None:
        if not self._pending or self._redis is None:
            return
        batch, self._pending = self._pending, {}

        async def write() -> None:
            pipe = self._redis.pipeline(transaction=False)
            for (key_name, period, ident), tokens in batch.items():
                name = self._usage_key(key_name, period, ident)
                pipe.incrby(name, tokens)
                pipe.expire(name, _EXPIRY_S[period])
            await pipe.execute()

        if await self._call(write) is _DOWN:
            for slot, tokens in batch.items():  # kept for when Redis is back
                self._pending[slot] = self._pending.get(slot, 0) + tokens

    async def _call(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        """The call's result, or _DOWN while Redis cannot be reached (the caller then uses local figures)."""
        import redis.exceptions

        if self._down_since is not None and self._monotonic() - self._down_since < RETRY_AFTER_S:
            return _DOWN
        try:
            result = await function(*args, **kwargs)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
            if self._down_since is None:
                logger.warning(
                    "Redis unreachable (%s): rate limits and budgets fall back to this gateway's own counts",
                    type(exc).__name__,
                )
            self._down_since = self._monotonic()
            return _DOWN
        if self._down_since is not None:
            self._down_since = None
            logger.info("Redis reachable again: rate limits and budgets are shared again")
        return result
