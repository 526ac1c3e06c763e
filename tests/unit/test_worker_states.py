"""The worker state table (wire.states): every allowed and every forbidden transition, the paths a
worker really takes, and the one place in the gateway that changes a state (WorkerHandle.move_to)."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import pytest

from gateway.config.models import ModelConfig
from gateway.link.handle import WorkerHandle
from wire.states import (
    MAY_SERVE,
    TRANSITIONS,
    InvalidTransition,
    WorkerState,
    can_transition,
    check_transition,
    model_state,
)

S = WorkerState
ALL_PAIRS = list(itertools.product(WorkerState, WorkerState))

# The journeys workers take (supervisor, remote membership, the worker's own lifecycle): each step
# must be allowed.
PATHS = {
    "start and serve": [S.STARTING, S.LOADING, S.WARMING, S.READY],
    "shutdown": [S.READY, S.DRAINING, S.STOPPED],
    "unload and load again": [S.READY, S.DRAINING, S.UNLOADED, S.STARTING, S.LOADING],
    "crash while serving": [S.READY, S.RESTARTING, S.STARTING],
    "crash loop": [S.STARTING, S.RESTARTING, S.STARTING, S.LOADING, S.RESTARTING, S.FAILED],
    "manual load after failing": [S.FAILED, S.STARTING],
    "unload a failed worker": [S.FAILED, S.UNLOADED],
    "remote lost and back ready": [S.READY, S.LOST, S.READY],
    "remote lost while loading": [S.LOADING, S.LOST, S.LOADING, S.WARMING, S.READY],
    "remote process restarted": [S.READY, S.STARTING, S.LOADING],
    "remote drains itself, then goes silent": [S.READY, S.DRAINING, S.LOST],
    "shutdown while loading": [S.LOADING, S.DRAINING, S.STOPPED],
    "on-demand removed by reload": [S.UNLOADED, S.STOPPED],
    "retire while restarting": [S.RESTARTING, S.UNLOADED],
    "standby worker loaded by the leader": [S.STARTING, S.UNLOADED, S.STARTING, S.LOADING, S.WARMING],
    "standby worker unloaded by the leader": [S.WARMING, S.READY, S.DRAINING, S.UNLOADED, S.STARTING],
    "standby worker lost and back": [S.UNLOADED, S.LOST, S.UNLOADED],
}
FORBIDDEN = [
    (S.STOPPED, S.STARTING),  # stopped is final: reloads make new handles
    (S.READY, S.LOADING),  # a worker never unloads its model in place
    (S.READY, S.WARMING),
    (S.FAILED, S.READY),  # a failed worker needs a new process first
    (S.RESTARTING, S.READY),
    (S.DRAINING, S.READY),  # draining never turns back
    (S.UNLOADED, S.READY),
    (S.LOST, S.DRAINING),
    (S.WARMING, S.LOADING),
]


@pytest.mark.parametrize(("old", "new"), ALL_PAIRS, ids=lambda s: s.value)
def test_every_pair_follows_the_table(old: WorkerState, new: WorkerState) -> None:
    allowed = old is new or new in TRANSITIONS[old]
    assert can_transition(old, new) is allowed
    if allowed:
        check_transition(old, new)
    else:
        with pytest.raises(InvalidTransition, match=f"{old.value} -> {new.value}"):
            check_transition(old, new)


@pytest.mark.parametrize("name", sorted(PATHS))
def test_real_paths_are_allowed(name: str) -> None:
    path = PATHS[name]
    for old, new in zip(path, path[1:], strict=False):
        assert can_transition(old, new), f"{name}: {old.value} -> {new.value}"


@pytest.mark.parametrize(("old", "new"), FORBIDDEN, ids=lambda s: s.value)
def test_known_bugs_are_forbidden(old: WorkerState, new: WorkerState) -> None:
    assert not can_transition(old, new)


def test_table_covers_every_state_and_stopped_is_final() -> None:
    assert set(TRANSITIONS) == set(WorkerState)
    assert TRANSITIONS[S.STOPPED] == frozenset()
    # Every state is reachable from another, and every state has a category.
    assert set().union(*TRANSITIONS.values()) == set(WorkerState)
    assert {s.category for s in WorkerState} == {"serving", "loading", "draining", "idle", "down"}


def test_model_state_is_its_best_replica() -> None:
    assert model_state([S.FAILED, S.READY, S.LOADING]) is S.READY
    assert model_state([S.FAILED, S.LOADING]) is S.LOADING
    assert model_state([S.LOST, S.FAILED]) is S.LOST
    assert model_state([]) is S.STOPPED
    assert S.LOST not in MAY_SERVE and S.FAILED not in MAY_SERVE and S.READY in MAY_SERVE


def test_handle_refuses_and_logs_a_forbidden_change(caplog: pytest.LogCaptureFixture) -> None:
    handle = WorkerHandle("m#0", ModelConfig(name="m", engine="transformers", path=Path("x")))
    assert handle.move_to(S.LOADING, "loading") and handle.state is S.LOADING
    with caplog.at_level(logging.ERROR, logger="gateway.link.handle"):
        assert not handle.move_to(S.READY, "skipping warm-up")
    assert handle.state is S.LOADING
    assert "invalid worker state transition loading -> ready" in caplog.text
