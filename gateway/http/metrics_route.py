"""GET /metrics: the Prometheus text exposition of this gateway's registry.

Runs in the gateway process. Owns no state: the figures live in the app's `GatewayMetrics`
(gateway/metrics.py). Like every route but /health/live, it needs an API key once keys exist.
"""

from __future__ import annotations

from quart import Blueprint, Response, current_app

blueprint = Blueprint("metrics", __name__)


@blueprint.get("/metrics")
async def metrics() -> Response:
    return current_app.extensions["metrics"].render()  # type: ignore[no-any-return]
