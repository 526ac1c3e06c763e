"""A generation request's output queue, and what it holds besides outputs.

Runs in the gateway process, on its asyncio loop. Owns `OutputQueue` (one per request: the link,
the ticker and abort put, the request's stream or body takes), `KEEPALIVE` (nothing new: the
stream sends an SSE comment) and `EndOfOutputs` (the request ended, with its error if early).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any

from gateway.errors import APIError

KEEPALIVE = object()  # queue item: nothing new, the stream should send an SSE comment


@dataclass(frozen=True, slots=True)
class EndOfOutputs:
    """The last item of a request's queue: it ended, normally (no error) or early."""

    error: APIError | None = None


class OutputQueue:
    """A request's single queue: any number of producers (the link, the ticker, abort), one
    consumer. Lighter than asyncio.Queue, which it replaces on the per-token path: no join
    bookkeeping, no size bound, one waiter future instead of a deque of getters."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # cancelled when its consumer was
                waiter.set_result(None)

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> Any:
        return self._items.popleft()

    def take_all(self) -> list[Any]:
        items = list(self._items)
        self._items.clear()
        return items

    def arrival(self) -> asyncio.Future[None]:
        """A future that is done once the queue holds an item (at once if it does now)."""
        waiter = asyncio.get_running_loop().create_future()
        if self._items:
            waiter.set_result(None)
        else:
            self._waiter = waiter
        return waiter

    async def get(self) -> Any:
        while not self._items:
            await self.arrival()
        return self._items.popleft()
