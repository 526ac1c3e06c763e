"""The tests' one way to wait for an event (tests/harness.py): what it returns and how it fails.

Runs in the pytest process; no I/O beyond the clock.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.harness import WaitTimeout, async_wait_until, settle, wait_until


def test_returns_the_first_truthy_value() -> None:
    counter = itertools.count()
    assert wait_until(lambda: next(counter) >= 3 and "third", "the third poll") == "third"


def test_times_out_naming_the_event_the_last_value_and_the_context() -> None:
    with pytest.raises(WaitTimeout) as failed:
        wait_until(lambda: [], "a worker to be ready", 0.05, context=lambda: "x" * 5000 + "LOG TAIL")
    message = str(failed.value)
    assert "waiting for a worker to be ready" in message and "gave []" in message
    assert message.endswith("LOG TAIL") and len(message) < 4200  # only the tail of a long log


def test_retries_only_the_exceptions_it_is_told_to() -> None:
    attempts = itertools.count()

    def flaky() -> bool:
        if next(attempts) < 2:
            raise ConnectionError("not listening yet")
        return True

    assert wait_until(flaky, "the server", retry_on=(ConnectionError,))
    with pytest.raises(ZeroDivisionError):
        wait_until(lambda: 1 / 0, "a broken predicate", retry_on=(ConnectionError,))


def test_the_async_variant_lets_the_loop_run_and_awaits_coroutine_predicates() -> None:
    async def scenario() -> None:
        event = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, event.set)
        assert await async_wait_until(event.is_set, "the event") is True

        async def later() -> int:
            return 7

        assert await async_wait_until(later, "a coroutine predicate") == 7
        with pytest.raises(WaitTimeout, match="waiting for nothing"):
            await async_wait_until(lambda: None, "nothing", 0.05)

    asyncio.run(scenario())


def test_settle_runs_what_is_ready_and_nothing_more() -> None:
    async def scenario() -> None:
        condition = asyncio.Condition()

        async def waiter() -> None:
            async with condition:
                await condition.wait()

        task = asyncio.create_task(waiter())
        await settle()
        assert not task.done()  # nothing woke it
        async with condition:
            condition.notify()
        await settle()
        assert task.done()  # woken, it ran to its end within the turns settle gives

    asyncio.run(scenario())
