"""Admin routes that change what runs: reload models.yaml, load and unload one model.

Runs in the gateway process. Owns the operator actions; the work itself is the supervisor's
(`retire`, `launch`), the Gateway's (`apply_registry`, `unload`) and gateway.reloads' (a reload
in the background). SIGHUP (gateway/server.py) starts the same reload as POST /admin/reload.

POST /admin/reload validates the file, starts applying it and answers 202 at once, with the
changes and `progress`: GET /admin/reload/{id} (or /admin/reload for the latest) shows how it goes.
`?wait=SECONDS` (at most 600) waits that long for the apply to finish and then answers 200 with
the outcome, or 202 if it is still applying. An invalid new file changes nothing (400), and a
second reload while one applies is refused (409).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from quart import Blueprint, Quart, current_app, jsonify, request

from gateway.config.registry import ConfigError
from gateway.errors import InvalidRequest, ModelNotFound
from gateway.http.current import current_gateway
from gateway.reloads import ReloadRecord, Reloads

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
    view = record.view(current_gateway())
    headers = {"Location": view["progress"]}
    return jsonify(view), (200 if finished else 202), headers


@blueprint.get("/admin/reload")
async def latest_reload() -> Any:
    record = current_app.extensions["reloads"].latest
    if record is None:
        return jsonify({"status": "none", "message": "no reload since the gateway started"})
    return jsonify(record.view(current_gateway()))


@blueprint.get("/admin/reload/<int:reload_id>")
async def reload_progress(reload_id: int) -> Any:
    record = current_app.extensions["reloads"].records.get(reload_id)
    if record is None:
        raise InvalidRequest(f"no reload {reload_id} (the last few are kept)", code="not_found", param="id")
    return jsonify(record.view(current_gateway()))


def _handles(name: str) -> list[Any]:
    gateway = current_gateway()
    route = gateway.router.route(name)
    return list(route.replicas)


@blueprint.post("/admin/models/<path:name>/load")
async def load_model(name: str) -> Any:
    gateway = current_gateway()
    handles = _handles(name)
    if not handles:
        raise (
            ModelNotFound(name)
            if gateway.router.routes.get(name) is None
            else InvalidRequest(
                f"model '{name}' is served by remote workers; start them on their hosts", code="remote_model"
            )
        )
    for handle in handles:
        gateway.supervisor.launch(handle)
    return jsonify({"model": name, "workers": [h.describe() for h in handles]}), 202


@blueprint.post("/admin/models/<path:name>/unload")
async def unload_model(name: str) -> Any:
    gateway = current_gateway()
    handles = _handles(name)
    ended = await gateway.unload(name)
    return jsonify({"model": name, "requests_ended": ended, "workers": [h.describe() for h in handles]})
