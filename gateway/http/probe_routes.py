"""Probe routes that clients call before they start: GET /health, /ping and /version.

Runs in the gateway process. Owns these aliases only: /health and /ping answer like /health/live
(the process serves HTTP), as vLLM's do; guidellm and load balancers call them. Readiness stays
/health/ready's business (gateway.http.health_routes). /version names the gateway's version.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from quart import Blueprint, jsonify

blueprint = Blueprint("probes", __name__)


def gateway_version() -> str:
    try:
        return metadata.version("llm-gateway")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


@blueprint.get("/health")
@blueprint.get("/ping")
async def alive() -> Any:
    return jsonify({"status": "ok"})


@blueprint.get("/version")
async def version() -> Any:
    return jsonify({"version": gateway_version()})
