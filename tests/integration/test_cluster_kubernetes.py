"""The Kubernetes backends against the API's contract: EndpointSlice membership and the Lease
leader, talking real HTTP (lightkube) to the fake API server of tests/fake_kube_api.py.

Runs in the pytest process, on one event loop per test: the fake API (Quart on Hypercorn), the
backends, and for the leader tests one relay per contender so that one can be cut off. Every wait
is on an event (a membership change, a leadership change) with a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from gateway.cluster.k8s_leader import LeaseLeader
from gateway.cluster.k8s_membership import KubernetesMembership
from gateway.cluster.membership import HolderUnknown, MembershipChange, WorkerRecord, decide_once
from gateway.cluster.settings import KubernetesSettings
from tests.fake_kube_api import FakeKubeApi, endpoint_slice
from tests.harness import async_wait_until
from tests.relay import Relay

NAMESPACE = "llm-gateway"
CHANGE_TIMEOUT_S = 20.0


@asynccontextmanager
async def fake_api() -> AsyncIterator[FakeKubeApi]:
    api = FakeKubeApi()
    await api.start()
    try:
        yield api
    finally:
        await api.close()


def settings(url: str, **overrides: object) -> KubernetesSettings:
    values: dict[str, object] = {
        "api_server": url, "namespace": NAMESPACE, "request_timeout_s": 2.0,
        "lease_duration_s": 3, "renew_deadline_s": 2.0, "retry_period_s": 0.3,
    }  # fmt: skip
    return KubernetesSettings.model_validate({**values, **overrides})


async def next_change(changes: AsyncIterator[MembershipChange]) -> tuple[str, str, str]:
    change = await asyncio.wait_for(anext(changes), CHANGE_TIMEOUT_S)
    return change.kind, change.record.worker_id, change.record.endpoint


def test_workers_come_and_go_with_their_endpoint_slices() -> None:
    async def scenario() -> None:
        async with fake_api() as api:
            api.apply_slice(
                endpoint_slice(
                    "llm-workers-qwen-abcde", "qwen2.5-7b",
                    {"llm-worker-qwen-0": "10.1.0.10", "llm-worker-qwen-1": "10.1.0.11",
                     "llm-worker-qwen-2": "10.1.0.12", "llm-worker-qwen-3": "10.1.0.13"},
                    not_ready=("llm-worker-qwen-2",), terminating=("llm-worker-qwen-3",),
                )
            )  # fmt: skip
            # Another deployment's slice, and the governing Service's (no model label): never seen.
            api.apply_slice(
                endpoint_slice("other-xyz", "qwen2.5-7b", {"p-0": "10.9.9.9"}, labels={"app": "x"})
            )
            governing = {"app.kubernetes.io/component": "worker", "app.kubernetes.io/part-of": "llm-gateway"}
            api.apply_slice(
                endpoint_slice("llm-workers-k2", "qwen2.5-7b", {"p-1": "10.9.9.8"}, labels=governing)
            )
            membership = KubernetesMembership(settings(api.url))
            await membership.start()
            changes = membership.changes()
            try:
                first = {await next_change(changes) for _ in range(2)}
                assert first == {
                    ("join", "qwen2.5-7b@llm-worker-qwen-0", "tcp://10.1.0.10:5555"),
                    ("join", "qwen2.5-7b@llm-worker-qwen-1", "tcp://10.1.0.11:5555"),
                }
                record = membership.members()["qwen2.5-7b@llm-worker-qwen-1"]
                assert record == WorkerRecord(
                    worker_id="qwen2.5-7b@llm-worker-qwen-1", model="qwen2.5-7b", replica=1,
                    endpoint="tcp://10.1.0.11:5555",
                )  # fmt: skip
                # ADDED: a second model's Service.
                api.apply_slice(
                    endpoint_slice("llm-workers-llama-fghij", "llama", {"llm-worker-llama-0": "10.2.0.5"})
                )
                assert await next_change(changes) == (
                    "join",
                    "llama@llm-worker-llama-0",
                    "tcp://10.2.0.5:5555",
                )
                # MODIFIED: a pod turns not ready (and another becomes ready).
                api.apply_slice(
                    endpoint_slice(
                        "llm-workers-qwen-abcde", "qwen2.5-7b",
                        {"llm-worker-qwen-0": "10.1.0.10", "llm-worker-qwen-1": "10.1.0.11",
                         "llm-worker-qwen-2": "10.1.0.12"},
                        not_ready=("llm-worker-qwen-0",),
                    )
                )  # fmt: skip
                assert {await next_change(changes) for _ in range(2)} == {
                    ("leave", "qwen2.5-7b@llm-worker-qwen-0", "tcp://10.1.0.10:5555"),
                    ("join", "qwen2.5-7b@llm-worker-qwen-2", "tcp://10.1.0.12:5555"),
                }
                # DELETED: the Service is gone.
                api.delete_slice("llm-workers-llama-fghij")
                assert await next_change(changes) == (
                    "leave",
                    "llama@llm-worker-llama-0",
                    "tcp://10.2.0.5:5555",
                )
                assert set(membership.members()) == {
                    "qwen2.5-7b@llm-worker-qwen-1",
                    "qwen2.5-7b@llm-worker-qwen-2",
                }
                # The watch asked for the selector and resumed from the listing's resourceVersion.
                (watch,) = [p for m, p, _ in api.requests if "watch=true" in p]
                assert "llm-gateway.io%2Fmodel" in watch and "resourceVersion=1003" in watch
            finally:
                await membership.stop()

    asyncio.run(scenario())


def test_a_watch_answered_410_gone_is_followed_by_a_fresh_listing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.cluster")

    async def scenario() -> None:
        async with fake_api() as api:
            api.apply_slice(endpoint_slice("a", "qwen", {"w-0": "10.0.0.1", "w-1": "10.0.0.2"}))
            membership = KubernetesMembership(settings(api.url))
            await membership.start()
            changes = membership.changes()
            try:
                assert {(await next_change(changes))[0] for _ in range(2)} == {"join"}
                # While the watch is down, w-1 goes, w-2 comes, and the history is compacted: the
                # watch's resumption gets 410, and only a listing can show what happened.
                api.drop_watches()
                api.apply_slice(endpoint_slice("a", "qwen", {"w-0": "10.0.0.1", "w-2": "10.0.0.3"}))
                api.compact()
                seen = {await next_change(changes) for _ in range(2)}
                assert seen == {
                    ("leave", "qwen@w-1", "tcp://10.0.0.2:5555"),
                    ("join", "qwen@w-2", "tcp://10.0.0.3:5555"),
                }
                assert api.count("GET", "endpointslices?", 200) >= 2  # listed again
                assert any("410 Gone" in r.getMessage() for r in caplog.records)
                # Nothing else is queued: the next change is the marker's.
                api.apply_slice(endpoint_slice("b", "marker", {"m-0": "10.0.0.9"}))
                assert await next_change(changes) == ("join", "marker@m-0", "tcp://10.0.0.9:5555")
            finally:
                await membership.stop()

    asyncio.run(scenario())


def test_the_view_outlives_the_api_server_and_catches_up(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.cluster")

    async def scenario() -> None:
        async with fake_api() as api:
            api.apply_slice(endpoint_slice("a", "qwen", {"w-0": "10.0.0.1", "w-1": "10.0.0.2"}))
            membership = KubernetesMembership(settings(api.url))
            await membership.start()
            changes = membership.changes()
            try:
                await membership.synced()
                assert {(await next_change(changes))[0] for _ in range(2)} == {"join"}
                api.down = True
                api.drop_watches()
                await async_wait_until(lambda: not membership.connected, "the API to be seen down")
                api.apply_slice(endpoint_slice("a", "qwen", {"w-0": "10.0.0.1", "w-2": "10.0.0.3"}))
                assert set(membership.members()) == {"qwen@w-0", "qwen@w-1"}  # the last view stays
                api.down = False
                await async_wait_until(lambda: membership.connected, "the API to be seen back")
                seen = {await next_change(changes) for _ in range(2)}
                assert seen == {
                    ("leave", "qwen@w-1", "tcp://10.0.0.2:5555"),
                    ("join", "qwen@w-2", "tcp://10.0.0.3:5555"),
                }
                api.apply_slice(endpoint_slice("b", "marker", {"m-0": "10.0.0.9"}))
                assert await next_change(changes) == ("join", "marker@m-0", "tcp://10.0.0.9:5555")
            finally:
                await membership.stop()
        messages = [r.getMessage() for r in caplog.records]
        assert any("routing goes on with the last membership (2 workers)" in m for m in messages), messages
        assert any("Kubernetes API reachable again" in m for m in messages), messages

    asyncio.run(scenario())


# ---- the Lease leader ---------------------------------------------------------------------------


@dataclass
class Contender:
    name: str
    relay: Relay
    leader: LeaseLeader
    changes: list[tuple[float, bool]] = field(default_factory=list)


@asynccontextmanager
async def contenders(api: FakeKubeApi, count: int, start: bool = True) -> AsyncIterator[list[Contender]]:
    made = []
    for index in range(count):
        relay = Relay(api.port)
        await relay.start()
        changes: list[tuple[float, bool]] = []

        def record(now_leading: bool, changes: list[tuple[float, bool]] = changes) -> None:
            changes.append((time.monotonic(), now_leading))

        name = f"gateway-{index}"
        leader = LeaseLeader(settings(f"http://{relay.endpoint}"), name, record)
        made.append(Contender(name, relay, leader, changes))
    try:
        if start:
            await asyncio.gather(*(c.leader.start() for c in made))
        yield made
    finally:
        for contender in made:
            contender.relay.mend()
            await contender.leader.stop()
            await contender.relay.close()


async def one_leader(group: list[Contender], among: list[Contender] | None = None) -> Contender:
    pool = among if among is not None else group

    def found() -> Contender | None:
        current = [c for c in group if c.leader.is_leader]
        assert len(current) <= 1, f"two leaders at once: {[c.name for c in current]}"
        return current[0] if current and current[0] in pool else None

    return await async_wait_until(found, "one leader", poll_s=0.02)


def assert_never_two_leaders(group: list[Contender]) -> None:
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


def test_one_lease_holder_and_a_takeover_after_the_lease_duration() -> None:
    async def scenario() -> None:
        async with fake_api() as api, contenders(api, 3) as group:
            first = await one_leader(group)
            # Three started at once on no Lease: every create but one got 409 AlreadyExists.
            creates = api.count("POST", "/leases")
            assert creates >= 1 and api.count("POST", "/leases", 409) == creates - 1
            lease = api.lease("llm-gateway-leader")
            assert lease is not None and lease["spec"]["holderIdentity"] == first.name
            assert lease["spec"]["leaseDurationSeconds"] == 3 and lease["spec"]["leaseTransitions"] == 0
            # It renews: renewTime moves while it leads.
            renewed = lease["spec"]["renewTime"]
            await async_wait_until(
                lambda: (api.lease("llm-gateway-leader") or {})["spec"]["renewTime"] != renewed, "a renewal"
            )

            first.relay.cut()  # it can no longer renew
            cut_at = time.monotonic()
            second = await one_leader(group, among=[c for c in group if c is not first])
            took = time.monotonic() - cut_at
            # The others wait lease_duration_s from when they saw the last renewal, checking every
            # retry_period_s: at most duration + two periods, plus the calls.
            s = second.leader._settings  # noqa: SLF001
            assert took <= s.lease_duration_s + 2 * s.retry_period_s + 1.0, f"takeover took {took:.2f} s"
            assert not first.leader.is_leader
            assert first.changes[-1][1] is False
            assert first.changes[-1][0] <= second.changes[-1][0]
            lease = api.lease("llm-gateway-leader")
            assert lease is not None and lease["spec"]["holderIdentity"] == second.name
            assert lease["spec"]["leaseTransitions"] == 1 and second.leader.term == 1

            first.relay.mend()  # back, it follows
            await second.leader.resign()  # an empty holder: taken at the next read, well within the duration
            resigned_at = time.monotonic()
            third = await one_leader(group, among=[c for c in group if c is not second])
            assert time.monotonic() - resigned_at < s.lease_duration_s
            assert third.leader.term == 2
            assert_never_two_leaders(group)

    asyncio.run(scenario())


def test_the_holder_is_read_from_the_lease_and_none_once_it_ran_out() -> None:
    """What a follower asked for a decision reads: the Lease's holder, none before the Lease exists
    and once renewTime + leaseDurationSeconds has passed, unknown while the API cannot be reached."""

    async def scenario() -> None:
        async with fake_api() as api, contenders(api, 2, start=False) as group:
            observer = LeaseLeader(settings(f"http://127.0.0.1:{api.port}"), "observer")  # never campaigns
            try:
                assert await observer.holder() is None  # no Lease yet
                for contender in group:
                    await contender.leader.start()
                first = await one_leader(group)
                assert [await c.leader.holder() for c in group] == [first.name] * 2
                assert await observer.holder() == first.name

                first.relay.cut()
                with pytest.raises(HolderUnknown):
                    await first.leader.holder()

                # Nobody can renew or take over now: the Lease runs out, and with it the holder.
                for contender in group:
                    contender.relay.cut()
                cut_at = time.monotonic()
                assert await observer.holder() == first.name
                await async_wait_until(lambda: _no_holder(observer), "the Lease to run out", 10, poll_s=0.05)
                took = time.monotonic() - cut_at
                duration = observer._settings.lease_duration_s  # noqa: SLF001
                # The last renewal was at most a retry period before the cut.
                assert duration - 0.3 - 0.2 <= took <= duration + 1.0, f"ran out after {took:.2f} s"
            finally:
                await observer.stop()

    asyncio.run(scenario())


async def _no_holder(leader: LeaseLeader) -> bool:
    return await leader.holder() is None


def test_a_decision_is_claimed_once_through_the_api() -> None:
    async def scenario() -> None:
        runs: list[str] = []

        def action(who: str) -> Callable[[], Awaitable[str]]:
            async def run() -> str:
                runs.append(who)
                return who

            return run

        async with fake_api() as api, contenders(api, 3) as group:
            leader = await one_leader(group)
            refused_before = api.count("POST", "/leases", 409)
            results = await asyncio.gather(
                *(decide_once(c.leader, "load/qwen/1", action(c.name)) for c in group for _ in range(3))
            )
            assert runs == [leader.name] and results.count(leader.name) == 1
            # The leader's three concurrent claims: one created, two refused with 409 AlreadyExists.
            assert api.count("POST", "/leases", 409) - refused_before == 2
            follower = next(c for c in group if c is not leader)
            assert not await follower.leader.claim("load/llama/1")
            await leader.leader.forget("load/qwen/1")
            assert await decide_once(leader.leader, "load/qwen/1", action(leader.name)) == leader.name
            assert runs == [leader.name, leader.name]

    asyncio.run(scenario())
