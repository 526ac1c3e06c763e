"""The leader's loads and unloads of listening workers (gateway.workers.cluster_plan and
gateway.workers.cluster_loads' DecisionSender): what is decided from the wants and the workers' states, each
decision's name, and a decision claimed once, then sent again (never claimed again) when it has
not taken effect."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.workers.cluster_loads import DecisionSender
from gateway.workers.cluster_plan import WorkerView, ended, plan
from wire import messages as wire
from wire.states import WorkerState

S = WorkerState


def _w(worker_id: str, state: WorkerState, **fields: Any) -> WorkerView:
    values: dict[str, Any] = {"model": worker_id.split("@")[0], "pid": 7, "epoch": 1, "host": "h1"}
    return WorkerView(worker_id=worker_id, state=state, **{**values, **fields})


def _decided(wanted: set[str], workers: list[WorkerView]) -> list[tuple[str, str]]:
    return [(a.kind, a.decision) for a in plan(wanted, workers)]


def test_a_wanted_model_with_only_standby_workers_gets_one_loaded() -> None:
    workers = [_w("a@2", S.UNLOADED, replica=1), _w("a@1", S.UNLOADED, replica=0, epoch=3)]
    assert _decided({"a"}, workers) == [("load", "load/a@1/7-3")]
    assert _decided(set(), workers) == []  # nobody wants it: it stands by


def test_a_model_loading_or_ready_anywhere_needs_no_load() -> None:
    for state in (S.STARTING, S.LOADING, S.WARMING, S.READY):
        assert _decided({"a"}, [_w("a@1", S.UNLOADED), _w("a@2", state)]) == []
    # Draining (being unloaded) is not loaded: the standby one is loaded.
    assert _decided({"a"}, [_w("a@1", S.UNLOADED), _w("a@2", S.DRAINING)]) == [("load", "load/a@1/7-1")]


def test_an_exclusive_group_unloads_the_other_model_on_the_host_first() -> None:
    a = _w("a@1", S.READY, group="g", epoch=2)
    b = _w("b@1", S.UNLOADED, group="g")
    assert _decided({"b"}, [a, b]) == [("unload", "unload/a@1/7-2")]
    # While it drains, nothing more; once it stands by, b loads.
    assert _decided({"b"}, [_w("a@1", S.DRAINING, group="g"), b]) == []
    assert _decided({"b"}, [_w("a@1", S.UNLOADED, group="g", epoch=3), b]) == [("load", "load/b@1/7-1")]
    # Another host's member of the group is not in the way.
    assert _decided({"b"}, [_w("a@1", S.READY, group="g", host="h2"), b]) == [("load", "load/b@1/7-1")]


def test_a_host_free_of_the_group_is_preferred_and_two_wanted_models_of_a_group_take_turns() -> None:
    busy = _w("a@1", S.READY, group="g")
    b_here, b_there = _w("b@1", S.UNLOADED, group="g"), _w("b@2", S.UNLOADED, group="g", host="h2", replica=0)
    assert _decided({"b"}, [busy, b_here, b_there]) == [("load", "load/b@2/7-1")]
    both = [_w("a@1", S.UNLOADED, group="g"), _w("b@1", S.UNLOADED, group="g")]
    assert _decided({"a", "b"}, both) == [("load", "load/a@1/7-1")]


def test_an_idle_worker_is_unloaded_unless_its_model_is_wanted() -> None:
    idle = _w("a@1", S.READY, idle_s=31.0, idle_unload_s=30.0)
    assert _decided(set(), [idle]) == [("unload", "unload/a@1/7-1")]
    assert _decided({"a"}, [idle]) == []
    assert _decided(set(), [_w("a@1", S.READY, idle_s=29.0, idle_unload_s=30.0)]) == []
    assert _decided(set(), [_w("a@1", S.READY, idle_s=99.0)]) == []  # no idle_unload_s


def test_a_decision_ends_when_its_worker_moves_on_or_leaves() -> None:
    taken = {
        "load/a@1/7-4": ("a@1", "7-4"),  # loaded from period 4, still: stays
        "unload/b@1/8-2": ("b@1", "8-2"),  # unloaded: its period is 3 now
        "load/c@1/9-1": ("c@1", "9-1"),  # no member now
        "load/d@1/5-1": ("d@1", "5-1"),  # restarted: another process
    }
    workers = [
        _w("a@1", S.READY, epoch=4),
        _w("b@1", S.UNLOADED, pid=8, epoch=3),
        _w("d@1", S.UNLOADED, pid=6),
    ]
    assert sorted(ended(taken, workers)) == ["load/c@1/9-1", "load/d@1/5-1", "unload/b@1/8-2"]


class _Leader:
    """Claims as etcd does: once per decision, ever, and only while leading."""

    def __init__(self, claimed: set[str]) -> None:
        self.claimed = claimed
        self.is_leader = True
        self.identity = "gw"

    async def holder(self) -> str | None:
        return self.identity if self.is_leader else None

    async def claim(self, decision: str) -> bool:
        if not self.is_leader or decision in self.claimed:
            return False
        self.claimed.add(decision)
        return True


class _Link:
    def __init__(self) -> None:
        self.sent: list[tuple[str, wire.Message]] = []

    def send(self, worker_id: str, message: wire.Message) -> bool:
        self.sent.append((worker_id, message))
        return True


def _loads(leader: _Leader, link: _Link) -> DecisionSender:
    return DecisionSender(link, leader, grace_s=2.0)  # type: ignore[arg-type]


def test_a_decision_is_claimed_once_and_sent_again_only_while_it_has_not_taken_effect() -> None:
    async def scenario() -> None:
        claimed: set[str] = set()
        first_link = _Link()
        first = _loads(_Leader(claimed), first_link)
        (action,) = plan({"a"}, [_w("a@1", S.UNLOADED, epoch=4)])
        await first.act(action)
        await first.act(action)  # the next round, before the worker said it is loading
        assert claimed == {"load/a@1/7-4"}
        assert first_link.sent == [("a@1", wire.Load(4))]  # not again within RESEND_S

        # The leader died after its claim; its successor finds the worker still in standby
        # period 4: it does not claim again, it sends the same Load (taken once by the worker).
        second_link = _Link()
        second = _loads(_Leader(claimed), second_link)
        await second.act(action)
        assert claimed == {"load/a@1/7-4"}
        assert second_link.sent == [("a@1", wire.Load(4))]

        # A follower neither claims nor sends.
        follower_leader = _Leader(claimed)
        follower_leader.is_leader = False
        follower_link = _Link()
        await _loads(follower_leader, follower_link).act(action)
        assert follower_link.sent == []

        (unload,) = plan(set(), [_w("a@1", S.READY, epoch=4, idle_s=9.0, idle_unload_s=1.0)])
        await second.act(unload)
        assert second_link.sent[-1] == ("a@1", wire.Unload(2.0, 4))

    asyncio.run(scenario())
