"""Admin routes that change what runs: reload models.yaml, load and unload one model, and in
cluster mode retire a listening worker for every gateway (decided once, by the leader).

Runs in the gateway process. Owns the operator actions; the work itself is the supervisor's
(`retire`, `launch`), the Gateway's (`apply_registry`, `unload`) and gateway.reloads' (a reload
in the background). SIGHUP (gateway/server.py) starts the same reload as POST /admin/reload.

POST /admin/reload validates the file, starts applying it and answers 202 at once, with the
changes and `progress`: GET /admin/reload/{id} (or /admin/reload for the latest) shows how it goes
(in cluster mode also `workers_reload.status`: the leader's restarts of listening workers, read
from etcd).
`?wait=SECONDS` (at most 600) waits that long for the apply to finish and then answers 200 with
the outcome, or 202 if it is still applying. An invalid new file, or one whose added or changed
local models fail `gateway check-config`'s host checks (a missing folder), changes nothing (400); a
second reload while one applies is refused (409), and so is any once the SIGTERM drain has begun
(503 `shutting_down`). Load and unload take a model's name or alias and answer with its name.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from quart import Blueprint, Quart, current_app, jsonify, request

from gateway.cluster.decisions import Outcome
from gateway.config.registry import ConfigError
from gateway.errors import Conflict, InvalidRequest, NotFound
from gateway.http.current import current_gateway
from gateway.reloads import ReloadRecord, Reloads
from wire import messages as wire

logger = logging.getLogger(__name__)
blueprint = Blueprint("admin", __name__)

MAX_WAIT_S = 600.0


async def start_reload(app: Quart) -> ReloadRecord:
    """Validate the registry file the gateway started from and start applying the difference."""
    reloads: Reloads = app.extensions["reloads"]
    record = await reloads.start()
    changing = {k: v for k, v in record.changes.items() if k != "unchanged" and v}
    logger.info("reload %d started: %s", record.id, changing)
    return record


def _wait_seconds() -> float:
    text = request.args.get("wait")
    if text is None:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and 0.0 <= value <= MAX_WAIT_S):
        raise InvalidRequest(f"wait must be a number of seconds from 0 to {MAX_WAIT_S:g}", param="wait")
    return value


@blueprint.post("/admin/reload")
async def reload() -> Any:
    wait_s = _wait_seconds()
    try:
        record = await start_reload(current_app)
    except ConfigError as exc:
        logger.error("reload refused; the running models are unchanged: %s", exc)
        raise InvalidRequest(f"reload refused, nothing changed: {exc}", code="invalid_config") from None
    reloads: Reloads = current_app.extensions["reloads"]
    finished = wait_s > 0 and await reloads.wait(record, wait_s)
    view = await _reload_view(record)
    headers = {"Location": view["progress"]}
    return jsonify(view), (200 if finished else 202), headers


@blueprint.get("/admin/reload")
async def latest_reload() -> Any:
    record = current_app.extensions["reloads"].latest
    if record is None:
        return jsonify({"status": "none", "message": "no reload since the gateway started"})
    return jsonify(await _reload_view(record))


@blueprint.get("/admin/reload/<int:reload_id>")
async def reload_progress(reload_id: int) -> Any:
    record = current_app.extensions["reloads"].records.get(reload_id)
    if record is None:
        raise NotFound(f"no reload {reload_id} (the last few are kept)", param="id")
    return jsonify(await _reload_view(record))


async def _reload_view(record: ReloadRecord) -> dict[str, Any]:
    """The record, and in cluster mode where the leader's restarts of its workers stand."""
    gateway = current_gateway()
    view = record.view(gateway)
    cluster_reloads = gateway.supervisor.cluster_reloads
    if record.workers_reload is not None and cluster_reloads is not None:
        status = await cluster_reloads.progress(record.workers_reload)
        view["workers_reload"] = {**record.workers_reload, "status": status}
    return view


@blueprint.post("/admin/models/<path:name>/load")
async def load_model(name: str) -> Any:
    gateway = current_gateway()
    route = gateway.router.route(name)  # `name` may be an alias; the answer names the model itself
    model, handles = route.config.name, list(route.replicas)
    if not handles:  # a local model always has its workers' handles: these are remote
        raise InvalidRequest(
            f"model '{model}' is served by remote workers; start them on their hosts", code="remote_model"
        )
    for handle in handles:
        gateway.supervisor.launch(handle)
    return jsonify({"model": model, "workers": [h.describe() for h in handles]}), 202


@blueprint.post("/admin/models/<path:name>/unload")
async def unload_model(name: str) -> Any:
    gateway = current_gateway()
    route = gateway.router.route(name)  # `name` may be an alias; the answer names the model itself
    model, handles = route.config.name, list(route.replicas)
    ended = await gateway.unload(model)
    return jsonify({"model": model, "requests_ended": ended, "workers": [h.describe() for h in handles]})


@blueprint.post("/admin/workers/<path:worker_id>/retire")
async def retire_worker(worker_id: str) -> Any:
    """Cluster mode: stop a listening worker for every gateway, decided once by the leader
    (gateway.cluster.decisions). `?grace_s=` lets its jobs finish first (default shutdown_grace_s)."""
    gateway = current_gateway()
    decisions = gateway.supervisor.decisions
    if decisions is None:
        raise InvalidRequest(
            "retiring a worker is decided by the cluster's leader: it needs server.cluster with "
            "backend etcd or kubernetes",
            code="no_leader_election",
        )
    handle = gateway.supervisor.workers.get(worker_id)
    if handle is None or not handle.remote:
        raise NotFound(f"no cluster worker {worker_id!r} is known to this gateway")
    grace_s = _grace_seconds(gateway.registry.server.shutdown_grace_s)
    # One decision per worker process: a worker restarted under the same id may be retired again.
    decision = f"retire/{worker_id}/{handle.pid if handle.pid is not None else 'unknown'}"

    async def send_retire() -> None:
        if not gateway.link.send(worker_id, wire.Retire(grace_s)):
            logger.warning("retire of %s decided, but the frame could not be sent now", worker_id)

    verdict = await decisions.decide(decision, send_retire)
    body = {"worker": worker_id, "decision": decision, "outcome": verdict.outcome.value, **decisions.view()}
    if verdict.outcome is Outcome.NOT_LEADER:
        here = f"this gateway ({decisions.leader.identity}) does not lead the cluster"
        if verdict.leader is not None:
            raise NotLeader(f"{here}: gateway {verdict.leader} leads it; send the request there")
        raise NotLeader(f"{here} and no gateway took over within {decisions.handover_s:g} s; ask again")
    return jsonify(body), 202 if verdict.outcome is Outcome.DONE else 200


@blueprint.get("/admin/cluster")
async def cluster_view() -> Any:
    decisions = current_gateway().supervisor.decisions
    return jsonify({"leader_election": decisions.view() if decisions is not None else None})


class NotLeader(Conflict):
    code = "not_leader"


def _grace_seconds(default: float) -> float:
    text = request.args.get("grace_s")
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and 0.0 <= value <= MAX_WAIT_S):
        raise InvalidRequest(f"grace_s must be a number of seconds from 0 to {MAX_WAIT_S:g}", param="grace_s")
    return value
