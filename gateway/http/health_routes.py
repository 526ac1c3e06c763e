"""Health routes: /health/live, /health/ready (the gateway), /health/ready/{model}, /admin/workers.

Runs in the gateway process. Owns the readiness verdicts and the JSON views of worker and model
state. A model is *ready* when one of its replicas is ready. The gateway's verdict follows
`server.readiness`:

- `all_startup` (default): every `load: startup` model is ready. A model unloaded on purpose (by
  hand, or idle) does not count, nor does an on-demand model, which loads at its first request;
- `any`: at least one model can serve now: it is ready, or it is an on-demand model that will
  load at its first request.

/health/live and /health/ready need no key: load balancers and orchestrators probe them. Without a
key /health/ready says only `{"status"}`; with a valid key it also lists the models that key may
use. /health/ready/{model} (Triton's /v2/models/{m}/ready) answers like an inference route: a key
that may not use the model gets the same 404 as an unknown model.
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, current_app, g, jsonify, request

from gateway.errors import ModelNotFound
from gateway.http.auth import may_use, presented_key
from gateway.http.current import current_gateway
from gateway.serving.router import ModelRoute
from wire.states import WorkerState

blueprint = Blueprint("health", __name__)


def model_ready(route: ModelRoute) -> bool:
    return any(r.ready for r in route.replicas)


def counts_for_readiness(route: ModelRoute) -> bool:
    """Under `all_startup`: a startup model, unless it was unloaded on purpose."""
    unloaded = bool(route.replicas) and route.state is WorkerState.UNLOADED
    return route.config.load == "startup" and not unloaded


def can_serve(route: ModelRoute) -> bool:
    """Under `any`: ready, or on demand and idle (its first request loads it)."""
    return model_ready(route) or (route.config.load == "on_demand" and route.state is WorkerState.UNLOADED)


def gateway_ready(routes: list[ModelRoute], policy: str) -> bool:
    if policy == "any":
        return any(can_serve(route) for route in routes)
    return all(model_ready(route) for route in routes if counts_for_readiness(route))


def _caller_authenticated() -> bool:
    """Whether this open route's caller showed a valid key (or no keys are configured)."""
    auth = current_app.extensions.get("auth")
    if auth is None or not auth.enabled:
        return True
    presented = presented_key(request.headers)
    key = auth.lookup(presented) if presented is not None else None
    if key is not None:
        g.api_key = key  # may_use() and the access log see it
    return key is not None


def _model_view(route: ModelRoute) -> dict[str, Any]:
    return {
        "state": route.state.value,
        "category": route.state.category,
        "load": route.config.load,
        "ready": model_ready(route),
        "replicas": [
            {"id": r.id, "state": r.state.value, "detail": r.detail, "last_error": r.last_error}
            for r in route.replicas
        ],
    }


@blueprint.get("/health/live")
async def live() -> Any:
    return jsonify({"status": "ok"})


@blueprint.get("/health/ready")
async def ready() -> Any:
    gateway = current_gateway()
    policy = gateway.registry.server.readiness
    is_ready = not gateway.service.draining and gateway_ready(list(gateway.router.routes.values()), policy)
    status = "ready" if is_ready else ("draining" if gateway.service.draining else "not_ready")
    body: dict[str, Any] = {"status": status}
    if _caller_authenticated():
        body["policy"] = policy
        body["models"] = {
            name: _model_view(route) for name, route in gateway.router.routes.items() if may_use(name)
        }
    return jsonify(body), (200 if is_ready else 503)


@blueprint.get("/health/ready/<path:model>")
async def model_readiness(model: str) -> Any:
    gateway = current_gateway()
    route = gateway.router.route(model)
    if not may_use(route.config.name):
        raise ModelNotFound(model)
    is_ready = model_ready(route) and not gateway.service.draining
    body = {"model": route.config.name, "ready": is_ready, "state": route.state.value}
    return jsonify(body), (200 if is_ready else 503)


@blueprint.get("/admin/workers")
async def workers() -> Any:
    gateway = current_gateway()
    workers = [w.describe() for w in gateway.supervisor.workers.values()]
    recent = current_app.extensions["metrics"].recent
    # Requests waiting in the gateway for a slot, per model (the status page's queue depth), and
    # the last minutes' request outcomes and latency (its error rate and latency columns).
    models = {
        name: {
            "state": route.state.value,
            "category": route.state.category,
            "queue_depth": route.waiting,
            "load": route.config.load,
            "requests": recent.summary(name),
        }
        for name, route in gateway.router.routes.items()
    }
    return jsonify({"workers": workers, "models": models})
