"""What the leading gateway does next for a registry reload that the cluster's workers must follow.

Runs in the gateway process (called by gateway.workers.cluster_reloads, on every gateway when a
reload is asked for, and on the leader every round); pure: no I/O, no clock. Owns:

- which models a reload changes for their workers (`worker_changes`): remote models whose
  settings as a worker reads them (gateway.workers.worker_settings: engine, path, context, engine
  settings, template, capacity) differ; what only gateways read (queues, timeouts, aliases) needs
  no worker restarted;
- the name of such a change (`fingerprint`), so two gateways asking for it ask once;
- the steps (`next_steps`): each loaded worker recorded in the request is restarted in place,
  one replica of a model at a time, the next only once the last is ready again: Unload (claimed
  as `reload/FINGERPRINT/unload/WORKER/PID-EPOCH`), then, once it stands by, Load
  (`load/WORKER/PID-EPOCH`, the name an on-demand load of that standby period has too, so the
  two never load it twice); a worker loads what its registry file says then (model_worker.standby).

A worker counts as reloaded once it is ready in a later incarnation than the one recorded (a new
standby period, or a new process, which read the file at its start); one that left the cluster,
was lost, or was unloaded by another decision meanwhile is left be (it reads the file when it
loads next). So whichever leader looks, a worker is restarted once: the claims and the workers'
states, not a leader's memory, say how far the reload got.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.cluster.reload_request import ReloadRequest
from gateway.config.models import ModelConfig
from gateway.workers.cluster_plan import Action, WorkerView
from gateway.workers.worker_settings import worker_settings
from wire.states import WorkerState

S = WorkerState
GONE = frozenset({S.LOST, S.STOPPED, S.FAILED})


def worker_changes(old: list[ModelConfig], new: list[ModelConfig]) -> dict[str, ModelConfig]:
    """The remote models, in both registries, whose workers would read other settings from `new`."""
    before = {m.name: m for m in old if m.remote}
    return {
        m.name: m
        for m in new
        if m.remote and m.name in before and worker_settings(m) != worker_settings(before[m.name])
    }


def fingerprint(changed: Mapping[str, ModelConfig]) -> str:
    body = {name: worker_settings(model) for name, model in sorted(changed.items())}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:24]


def incarnation(worker: WorkerView) -> str:
    """A worker's process and standby period: both change when it is restarted or reloaded."""
    return worker.incarnation


def unload_decision(request: ReloadRequest, worker_id: str, was: str) -> str:
    return f"reload/{request.fingerprint}/unload/{worker_id}/{was}"


@dataclass(frozen=True)
class Steps:
    actions: list[Action]
    finished: dict[str, str] | None  # every worker done: worker id -> its incarnation now


def next_steps(request: ReloadRequest, claimed: set[str], workers: list[WorkerView]) -> Steps:
    views = {w.worker_id: w for w in workers}
    actions: list[Action] = []
    finished: dict[str, str] = {}
    busy: set[str] = set()  # models with a replica being restarted now
    waiting: list[tuple[WorkerView, str]] = []  # (worker, the decision) not yet started
    for worker_id, was in sorted(request.workers.items()):
        view = views.get(worker_id)
        if view is None or view.state in GONE:
            continue  # gone: a worker that comes back reads its file at its start
        now = incarnation(view)
        unload = unload_decision(request, worker_id, was)
        why = f"reload {request.fingerprint} of {view.model}"
        if now == was:
            if view.state is S.READY and unload not in claimed:
                waiting.append((view, unload))
                continue
            if view.state is S.READY:  # claimed, not in effect yet: sent again (the worker acts once)
                actions.append(Action("unload", worker_id, view.epoch, why, unload))
            busy.add(view.model)
        elif view.state is S.UNLOADED and unload in claimed:
            busy.add(view.model)
            decision = f"load/{worker_id}/{now}"
            actions.append(Action("load", worker_id, view.epoch, why, decision))
        elif view.state is S.READY or view.state is S.UNLOADED:
            finished[worker_id] = now  # reloaded (or unloaded by another decision: it loads anew)
        else:
            busy.add(view.model)  # draining or loading
    for view, unload in waiting:
        if view.model not in busy:
            busy.add(view.model)
            why = f"reload {request.fingerprint} of {view.model}"
            actions.append(Action("unload", view.worker_id, view.epoch, why, unload))
    done = not busy and not waiting
    return Steps(actions, finished if done else None)
