"""The leader's steps for a registry reload that listening workers must follow
(gateway.workers.reload_plan): which models' workers a reload changes, one fingerprint for one
change, and each recorded worker restarted once, one replica of a model at a time, whichever
leader looks at the claims and the states."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.cluster.reload_request import ReloadRequest
from gateway.config.models import ModelConfig
from gateway.workers.cluster_plan import WorkerView
from gateway.workers.reload_plan import fingerprint, next_steps, worker_changes
from wire.states import WorkerState

S = WorkerState
FP = "f1"


def _model(**fields: Any) -> ModelConfig:
    values: dict[str, Any] = {"name": "a", "path": Path("/models/a"), "remote": True, "max_seq_len": 2048}
    return ModelConfig.model_validate({**values, **fields})


def _w(worker_id: str, state: WorkerState, pid: int = 7, epoch: int = 0) -> WorkerView:
    return WorkerView(
        worker_id=worker_id, model=worker_id.split("@")[0], state=state, pid=pid, epoch=epoch, host="h"
    )


def _request(**workers: str) -> ReloadRequest:
    return ReloadRequest(FP, ("a",), {f"a@{k}": v for k, v in workers.items()}, "gw-2")


def _decided(claimed: set[str], views: list[WorkerView], request: ReloadRequest) -> list[str]:
    return [a.decision for a in next_steps(request, claimed, views).actions]


def test_only_remote_models_whose_worker_settings_change_need_their_workers_restarted() -> None:
    old = [_model(), _model(name="local", remote=False)]
    assert worker_changes(old, [_model(max_seq_len=1024), _model(name="local", remote=False)]).keys() == {"a"}
    # What only gateways read (aliases, queues, timeouts) restarts no worker.
    gateway_only = _model(aliases=["alias"], limits={"max_queued_requests": 3, "request_timeout_s": 5})
    assert worker_changes(old, [gateway_only]) == {}
    assert worker_changes(old, [_model(name="local", remote=False, max_seq_len=1024)]) == {}
    # One change, one name, whichever gateway computes it.
    assert fingerprint({"a": _model(max_seq_len=1024)}) == fingerprint({"a": _model(max_seq_len=1024)})
    assert fingerprint({"a": _model(max_seq_len=1024)}) != fingerprint({"a": _model(max_seq_len=512)})


def test_replicas_are_restarted_one_at_a_time_each_once() -> None:
    request = _request(x="7-0", y="8-0")
    unload_x, unload_y = f"reload/{FP}/unload/a@x/7-0", f"reload/{FP}/unload/a@y/8-0"
    ready = [_w("a@x", S.READY), _w("a@y", S.READY, pid=8)]
    assert _decided(set(), ready, request) == [unload_x]  # the first only
    claimed = {unload_x}
    # Claimed, the worker not draining yet: the same decision again (sent again, never re-claimed).
    assert _decided(claimed, ready, request) == [unload_x]
    assert _decided(claimed, [_w("a@x", S.DRAINING), ready[1]], request) == []
    # Standing by in its next period: loaded (the name an on-demand load of that period has too).
    standby = _w("a@x", S.UNLOADED, epoch=1)
    assert _decided(claimed, [standby, ready[1]], request) == ["load/a@x/7-1"]
    assert _decided(claimed, [_w("a@x", S.LOADING, epoch=1), ready[1]], request) == []
    # Ready again in a new period: the next replica goes.
    renewed = _w("a@x", S.READY, epoch=1)
    assert _decided(claimed, [renewed, ready[1]], request) == [unload_y]
    claimed.add(unload_y)
    steps = next_steps(request, claimed, [renewed, _w("a@y", S.READY, pid=8, epoch=1)])
    assert steps.actions == [] and steps.finished == {"a@x": "7-1", "a@y": "8-1"}


def test_workers_gone_restarted_or_unloaded_by_another_decision_are_left_be() -> None:
    request = _request(x="7-0", y="8-0", z="9-0")
    views = [
        _w("a@x", S.READY, pid=17),  # a new process read its file at its start
        _w("a@y", S.UNLOADED, pid=8, epoch=1),  # an idle unload, not this reload's: loads when wanted
        _w("a@z", S.LOST, pid=9),
    ]
    steps = next_steps(request, set(), views)
    assert steps.actions == [] and steps.finished == {"a@x": "17-0", "a@y": "8-1"}
