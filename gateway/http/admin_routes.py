"""Admin routes that change what runs: reload models.yaml, load and unload one model.

Runs in the gateway process. Owns the operator actions; the work itself is the supervisor's
(`retire`, `launch`) and the Gateway's (`apply_registry`). SIGHUP (gateway/server.py) calls the same
`reload_registry` as POST /admin/reload. An invalid new file changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from quart import Blueprint, Quart, current_app, jsonify

from gateway.config.registry import ConfigError, load_registry
from gateway.core import Gateway
from gateway.errors import InvalidRequest
from gateway.http.current import current_gateway

logger = logging.getLogger(__name__)
blueprint = Blueprint("admin", __name__)

_reload_lock = asyncio.Lock()


async def reload_registry(app: Quart) -> dict[str, Any]:
    """Re-read the registry file the gateway started from and apply the difference."""
    gateway: Gateway = app.extensions["gateway"]
    source = gateway.registry.source
    if source is None:
        raise ConfigError("the running registry was not loaded from a file")
    async with _reload_lock:  # two reloads at once would race over the same workers
        new = load_registry(source)
        changes = await gateway.apply_registry(new)
        auth = app.extensions.get("auth")
        if auth is not None:
            auth.use_registry(gateway.registry)
    return changes


@blueprint.post("/admin/reload")
async def reload() -> Any:
    try:
        changes = await reload_registry(current_app)
    except ConfigError as exc:
        logger.error("reload refused; the running models are unchanged: %s", exc)
        raise InvalidRequest(f"reload refused, nothing changed: {exc}", code="invalid_config") from None
    return jsonify({"status": "applied", **changes})


def _handles(name: str) -> list[Any]:
    gateway = current_gateway()
    route = gateway.router.route(name)
    return list(route.replicas)


@blueprint.post("/admin/models/<path:name>/load")
async def load_model(name: str) -> Any:
    gateway = current_gateway()
    for handle in _handles(name):
        gateway.supervisor.launch(handle)
    return jsonify({"model": name, "workers": [h.describe() for h in _handles(name)]}), 202


@blueprint.post("/admin/models/<path:name>/unload")
async def unload_model(name: str) -> Any:
    gateway = current_gateway()
    handles = _handles(name)
    ended = await gateway.unload(name)
    return jsonify({"model": name, "requests_ended": ended, "workers": [h.describe() for h in handles]})
