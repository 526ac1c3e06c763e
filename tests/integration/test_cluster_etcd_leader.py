"""Leader election on a real etcd: three contenders in this process, each reaching etcd through
its own relay, so that one can be cut off (its lease no longer refreshed, as when its host dies)
while the others still reach etcd.

Runs in the pytest process. Checks: one leader at a time, on every contender's own clock (the
deposed leader steps down before another takes over); takeover within the lease TTL; an
immediate handover on resign; every contender reading the same holder (none once all resigned,
unknown while cut off); and a decision claimed exactly once while contenders race and the
leadership moves.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gateway.cluster.etcd_leader import EtcdLeader
from gateway.cluster.membership import HolderUnknown, decide_once
from gateway.cluster.settings import EtcdSettings
from tests.etcd_server import EtcdServer
from tests.harness import async_wait_until
from tests.relay import Relay

TTL_S = 3
# etcd looks for expired leases every 500 ms; then the delete reaches the followers' watches.
EXPIRY_SLACK_S = 1.0


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@dataclass
class Contender:
    name: str
    relay: Relay
    leader: EtcdLeader
    # (monotonic time, is_leader) for each change, as the on_change callback saw it.
    changes: list[tuple[float, bool]] = field(default_factory=list)


@asynccontextmanager
async def contenders(etcd: EtcdServer, count: int) -> AsyncIterator[list[Contender]]:
    prefix = f"/test-{uuid.uuid4().hex[:8]}/"
    made: list[Contender] = []
    for index in range(count):
        relay = Relay(etcd.client_port)
        await relay.start()
        settings = EtcdSettings(
            endpoints=[relay.endpoint],
            prefix=prefix,
            leader_ttl_s=TTL_S,
            request_timeout_s=0.5,
            retry_interval_s=0.2,
        )
        changes: list[tuple[float, bool]] = []

        def record(now_leading: bool, changes: list[tuple[float, bool]] = changes) -> None:
            changes.append((time.monotonic(), now_leading))

        name = f"gateway-{index}"
        contender = Contender(name, relay, EtcdLeader(settings, name, record), changes)
        made.append(contender)
    try:
        for contender in made:
            await contender.leader.start()
        yield made
    finally:
        for contender in made:
            contender.relay.mend()
            await contender.leader.stop()
            await contender.relay.close()


def leaders(group: list[Contender]) -> list[Contender]:
    return [c for c in group if c.leader.is_leader]


async def one_leader(group: list[Contender], among: list[Contender] | None = None) -> Contender:
    pool = among if among is not None else group

    def found() -> Contender | None:
        current = leaders(group)
        assert len(current) <= 1, f"two leaders at once: {[c.name for c in current]}"
        return current[0] if current and current[0] in pool else None

    return await async_wait_until(found, "one leader", poll_s=0.02)


def assert_never_two_leaders(group: list[Contender]) -> None:
    """From the callbacks' timestamps: no two leadership intervals overlap."""
    intervals = []
    for contender in group:
        start = None
        for at, leading in contender.changes:
            if leading:
                start = at
            elif start is not None:
                intervals.append((start, at, contender.name))
                start = None
        if start is not None:
            intervals.append((start, float("inf"), contender.name))
    intervals.sort()
    for (_, end, name), (start, _, next_name) in zip(intervals, intervals[1:], strict=False):
        assert end <= start, f"{name} led until {end}, but {next_name} from {start}"


def test_one_leader_and_another_takes_over_within_the_ttl_when_it_is_cut_off(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        async with contenders(etcd, 3) as group:
            first = await one_leader(group)
            term = first.leader.term
            assert term is not None
            assert [c.leader.term for c in group if c is not first] == [None, None]
            assert [await c.leader.holder() for c in group] == [first.name] * 3

            first.relay.cut()  # its keepalive no longer reaches etcd
            with pytest.raises(HolderUnknown):
                await first.leader.holder()
            cut_at = time.monotonic()
            others = [c for c in group if c is not first]
            second = await one_leader(group, among=others)
            took = time.monotonic() - cut_at
            assert took <= TTL_S + EXPIRY_SLACK_S, f"takeover took {took:.2f} s"
            assert not first.leader.is_leader
            # The deposed leader stepped down on its own clock before the new one began.
            assert first.changes[-1][1] is False and first.changes[-1][0] <= second.changes[-1][0]
            assert second.leader.term is not None and second.leader.term > term
            assert [await c.leader.holder() for c in others] == [second.name] * 2

            # Reconnected, it follows: the leader stays. When the other two go, it leads again.
            first.relay.mend()
            assert leaders(group) == [second]
            for contender in others:
                await contender.leader.resign()
            assert await one_leader(group) is first
            assert_never_two_leaders(group)

    asyncio.run(scenario())


def test_resign_hands_over_at_once(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        async with contenders(etcd, 2) as group:
            first = await one_leader(group)
            resigned_at = time.monotonic()
            await first.leader.resign()
            assert not first.leader.is_leader
            second = await one_leader(group, among=[c for c in group if c is not first])
            # Without the resignation the lease would live TTL_S more; the follower saw the delete.
            assert time.monotonic() - resigned_at < TTL_S / 2
            assert second is not first
            assert [await c.leader.holder() for c in group] == [second.name] * 2
            await second.leader.resign()  # neither campaigns now: no one leads
            assert [await c.leader.holder() for c in group] == [None, None]
            assert_never_two_leaders(group)

    asyncio.run(scenario())


def test_a_decision_runs_exactly_once_while_contenders_race_and_the_leader_changes(
    etcd: EtcdServer,
) -> None:
    async def scenario() -> None:
        runs: dict[str, list[str]] = {}

        def action(decision: str, who: str) -> Callable[[], Awaitable[str]]:
            async def run() -> str:
                runs.setdefault(decision, []).append(who)
                return who

            return run

        async def race(contender: Contender, decision: str) -> None:
            # Every contender, twice concurrently, tries until the decision has been taken.
            while decision not in runs:
                await asyncio.gather(
                    *(
                        decide_once(contender.leader, decision, action(decision, contender.name))
                        for _ in range(2)
                    )
                )
                await asyncio.sleep(0.01)

        async with contenders(etcd, 3) as group:
            first = await one_leader(group)
            await asyncio.gather(*(race(c, "load/qwen/1") for c in group))
            assert runs["load/qwen/1"] == [first.name]

            # The leader is cut off; the decisions raced from now on are taken by its successor,
            # once each, and the cut-off one, when it is back as a follower, takes none.
            first.relay.cut()
            second = await one_leader(group, among=[c for c in group if c is not first])
            first.relay.mend()
            await asyncio.gather(*(race(c, f"load/llama/{n}") for c in group for n in range(3)))
            for n in range(3):
                assert runs[f"load/llama/{n}"] == [second.name]
            # Taken decisions stay taken, even for the leader, until forgotten.
            assert await decide_once(second.leader, "load/qwen/1", action("load/qwen/1", second.name)) is None
            await second.leader.forget("load/qwen/1")
            assert await decide_once(second.leader, "load/qwen/1", action("load/qwen/1", second.name))
            assert runs["load/qwen/1"] == [first.name, second.name]
            # A follower can claim nothing.
            follower = next(c for c in group if c is not second)
            assert not await follower.leader.claim("load/mistral/1")
            assert_never_two_leaders(group)

    asyncio.run(scenario())
