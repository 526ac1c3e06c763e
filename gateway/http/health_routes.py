"""Health and admin routes: /health/live, /health/ready, /admin/workers.

Runs in the gateway process. Owns the JSON views of worker and model state; readiness is 503
until every model has a ready replica.
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, jsonify

from gateway.http.current import current_gateway
from wire.states import WorkerState

blueprint = Blueprint("health", __name__)


@blueprint.get("/health/live")
async def live() -> Any:
    return jsonify({"status": "ok"})


@blueprint.get("/health/ready")
async def ready() -> Any:
    gateway = current_gateway()
    models = {}
    for name, route in gateway.router.routes.items():
        models[name] = {
            "state": route.state.value,
            "load": route.config.load,
            "ready": any(r.ready for r in route.replicas),
            "replicas": [
                {"id": r.id, "state": r.state.value, "detail": r.detail, "last_error": r.last_error}
                for r in route.replicas
            ],
        }
    # An on-demand model that is not loaded yet is as it should be: it loads at its first request.
    all_ready = not gateway.service.draining and all(
        route.state is WorkerState.READY
        or (route.config.load == "on_demand" and route.state is not WorkerState.FAILED)
        for route in gateway.router.routes.values()
    )
    status = "ready" if all_ready else ("draining" if gateway.service.draining else "not_ready")
    return jsonify({"status": status, "models": models}), (200 if all_ready else 503)


@blueprint.get("/admin/workers")
async def workers() -> Any:
    gateway = current_gateway()
    workers = [w.describe() for w in gateway.supervisor.workers.values()]
    # Requests waiting in the gateway for a slot, per model (the status page's queue depth).
    models = {
        name: {"state": route.state.value, "category": route.state.category, "queue_depth": route.waiting}
        for name, route in gateway.router.routes.items()
    }
    return jsonify({"workers": workers, "models": models})
