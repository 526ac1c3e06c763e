"""`Decisions.decide` on a follower: refused at once while another gateway leads, a wait for a
takeover only while none does or the backend cannot say who does.

Runs in the pytest process, on one asyncio loop, with a fake at the `Leader` seam: the holder it
reports, and when it wins the leadership, are the test's to set. The same behaviour on real etcd
and on the fake Kubernetes API is in tests/integration/test_cluster_etcd_workers.py and
test_cluster_kubernetes_workers.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.cluster.decisions import Decisions, Outcome, Verdict
from gateway.cluster.membership import HolderUnknown
from gateway.cluster.settings import ClusterConfig

CONFIG = ClusterConfig.model_validate(
    {"backend": "etcd", "identity": "gw-a", "etcd": {"endpoints": ["127.0.0.1:2379"]}}
)


class _Leader:
    """Follows until `win()`; `holder()` answers what the test set (an exception: unreachable)."""

    def __init__(self, on_change: Callable[[bool], None]) -> None:
        self.on_change = on_change
        self.is_leader = False
        self.identity = "gw-a"
        self.held_by: str | None | HolderUnknown = None
        self.asked = asyncio.Event()
        self.claimed: set[str] = set()

    async def holder(self) -> str | None:
        self.asked.set()
        if isinstance(self.held_by, HolderUnknown):
            raise self.held_by
        return self.held_by

    async def claim(self, decision: str) -> bool:
        if not self.is_leader or decision in self.claimed:
            return False
        self.claimed.add(decision)
        return True

    def win(self) -> None:
        self.is_leader = True
        self.on_change(True)


def _decisions() -> tuple[Decisions, _Leader]:
    made: list[_Leader] = []

    def make_leader(config: ClusterConfig, on_change: Callable[[bool], None]) -> _Leader:
        made.append(_Leader(on_change))
        return made[0]

    decisions = Decisions(CONFIG, make_leader)  # type: ignore[arg-type]
    return decisions, made[0]


async def _nothing() -> None:
    pass


def test_a_follower_refuses_at_once_naming_the_gateway_that_leads() -> None:
    async def scenario() -> None:
        decisions, leader = _decisions()
        leader.held_by = "gw-b"
        assert decisions.handover_s > 10.0  # the default TTLs
        ran: list[str] = []

        async def act() -> None:
            ran.append("retire")

        verdict = await asyncio.wait_for(decisions.decide("retire/w/1", act), 1.0)
        assert verdict == Verdict(Outcome.NOT_LEADER, "gw-b")
        assert ran == [] and leader.claimed == set()

    asyncio.run(scenario())


def test_with_no_leader_a_follower_waits_for_the_takeover_and_decides() -> None:
    async def scenario() -> None:
        decisions, leader = _decisions()
        leader.held_by = None  # the leader's lease ran out: a takeover is due
        deciding = asyncio.create_task(decisions.decide("retire/w/1", _nothing))
        await asyncio.wait_for(leader.asked.wait(), 1.0)
        assert not deciding.done()  # waiting, not refused
        leader.win()
        assert await asyncio.wait_for(deciding, 1.0) == Verdict(Outcome.DONE)
        assert await decisions.decide("retire/w/1", _nothing) == Verdict(Outcome.ALREADY_DECIDED)

    asyncio.run(scenario())


def test_when_the_backend_cannot_say_who_leads_a_follower_waits_as_before() -> None:
    async def scenario() -> None:
        decisions, leader = _decisions()
        leader.held_by = HolderUnknown("etcd did not answer")
        decisions.handover_s = 0.2  # no takeover comes: refused after the (shortened) handover
        loop = asyncio.get_running_loop()
        asked_at = loop.time()
        verdict = await decisions.decide("retire/w/1", _nothing)
        assert verdict == Verdict(Outcome.NOT_LEADER, None)
        assert loop.time() - asked_at >= 0.2

        deciding = asyncio.create_task(decisions.decide("retire/w/2", _nothing))
        decisions.handover_s = 5.0
        leader.asked.clear()
        await asyncio.wait_for(leader.asked.wait(), 1.0)
        leader.win()
        assert await asyncio.wait_for(deciding, 1.0) == Verdict(Outcome.DONE)

    asyncio.run(scenario())
