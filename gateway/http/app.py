"""The Quart app factory: routes, error rendering, and the lifecycle of the gateway's parts.

Runs in the gateway process. `before_serving` binds the worker socket and spawns workers;
`after_serving` drains and stops them. Every error leaves in OpenAI's shape (Anthropic's on the
Messages routes), without a traceback.
quart-schema validates request bodies with the pydantic models the routes declare, and generates
the OpenAPI description (/openapi.json) and interactive docs (/docs) from the routes themselves.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from quart import Quart, jsonify
from quart_schema import QuartSchema, RequestSchemaValidationError
from quart_schema.openapi import Info
from werkzeug.exceptions import HTTPException

from gateway.cluster.counters import KeyCounters
from gateway.config.registry import ConfigError, Registry
from gateway.core import Gateway
from gateway.errors import APIError, InvalidRequest, error_body
from gateway.http import (
    admin_routes,
    anthropic_routes,
    dashboard,
    embedding_routes,
    health_routes,
    metrics_route,
    openai_routes,
    probe_routes,
    responses_routes,
    tokenize_routes,
)
from gateway.http.admission_hooks import AdmissionHooks
from gateway.http.anthropic_format import anthropic_error_body
from gateway.http.anthropic_routes import is_anthropic_request
from gateway.http.auth import Authenticator
from gateway.http.browser_guard import BrowserGuard
from gateway.http.json_body import JsonRequest
from gateway.http.request_log import begin_request, end_request, finish_request
from gateway.observability import tracing
from gateway.observability.metrics import GatewayMetrics, count_response
from gateway.observability.worker_collector import WorkerCollector
from gateway.reloads import Reloads
from gateway.state.response_store import open_store

logger = logging.getLogger(__name__)

_HTTP_ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}
_HTTP_ERROR_CODES = {413: "payload_too_large", 415: "unsupported_media_type"}


def make_runtime_dir(registry: Registry) -> Path:
    """A private (0700) folder for the ipc socket, so no other local user can talk to workers."""
    if registry.server.runtime_dir is not None:
        path = Path(registry.server.runtime_dir)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.chmod(0o700)
        return path
    return Path(tempfile.mkdtemp(prefix="llm-gw-"))


def _invalid_body(error: RequestSchemaValidationError) -> InvalidRequest:
    """A body that fails its schema: a 400 naming the first offending field, as OpenAI does."""
    cause = error.validation_error
    if isinstance(cause, ValidationError) and cause.errors():
        errors = cause.errors()
        # A value that fits none of a union's shapes fails once per shape; a bound it broke says
        # more than "should be a valid string" about a shape it never meant.
        first = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
        param = ".".join(str(p) for p in first["loc"] if not _is_union_tag(p)) or None
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "model_type" and not first["loc"]:
            message = "the request body must be a JSON object"
        return InvalidRequest(f"{param}: {message}" if param else message, param=param)
    return InvalidRequest("the request body must be a JSON object")


def _is_union_tag(part: object) -> bool:
    """pydantic names the member of a union in an error's location ("str", "list[int]")."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


class GatewayApp(Quart):
    def log_exception(self, exception_info: Any) -> None:
        """A config error found while starting (no credentials for a cluster backend, say) is the
        operator's to fix: gateway.server prints it once as `config error:`, with no traceback."""
        if isinstance(exception_info[1], ConfigError):
            logger.debug("startup stopped by a config error", exc_info=exception_info)
            return
        super().log_exception(exception_info)


def create_app(registry: Registry) -> Quart:
    app = GatewayApp(__name__, static_folder=None)  # no implicit /static route: pages are served by routes
    app.request_class = JsonRequest  # bodies parsed once, with what JSON allows but we cannot pass on refused
    app.config["MAX_CONTENT_LENGTH"] = registry.server.max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # streams may legitimately run for many minutes
    app.config["BODY_TIMEOUT"] = 60
    app.config["JSON_SORT_KEYS"] = False
    QuartSchema(
        app,
        info=Info(title="LLM gateway (OpenAI-compatible)", version="1"),
        openapi_path="/openapi.json",
        swagger_ui_path="/docs",
        redoc_ui_path=None,
        scalar_ui_path=None,
    )
    # Keys first: a broken keys file stops startup before a runtime folder or socket exists.
    counters = KeyCounters(registry.server.redis_url, registry.server.redis_key_prefix)
    authenticator = Authenticator(registry, counters=counters)
    runtime_dir = make_runtime_dir(registry)
    gateway = Gateway.build(registry, runtime_dir)
    app.extensions["gateway"] = gateway
    app.extensions["auth"] = authenticator
    metrics = app.extensions["metrics"] = GatewayMetrics(counters.add_usage)
    metrics.registry.register(WorkerCollector(gateway))
    app.extensions["reloads"] = Reloads(gateway, authenticator.use_registry)
    base = registry.source.parent if registry.source is not None else Path.cwd()
    app.extensions["response_store"] = open_store(
        registry.server.responses, base, registry.server.redis_url, registry.server.redis_key_prefix
    )
    # The request id first, so a refused request is logged and answered with one too.
    app.before_request(begin_request)
    admission = AdmissionHooks(gateway.service.admissions)
    app.before_request(admission.begin)  # before auth: a burst counts from its first byte on
    app.before_request(BrowserGuard(registry.server, lambda: authenticator.enabled).before_request)
    app.before_request(authenticator.before_request)
    app.after_request(count_response)
    app.after_request(finish_request)
    app.teardown_request(end_request)
    app.teardown_request(admission.end)
    for module in (openai_routes, embedding_routes, responses_routes, anthropic_routes, health_routes,
                   probe_routes, tokenize_routes, admin_routes, metrics_route, dashboard):  # fmt: skip
        app.register_blueprint(module.blueprint)

    @app.before_serving
    async def start_gateway() -> None:
        tracing.start()  # only when the OTEL_* variables ask for it (its workers read the same ones)
        try:
            await counters.start()
            await gateway.link.start()
            gateway.service.start()
            gateway.supervisor.start()
            await gateway.supervisor.start_cluster()
        except ConfigError as exc:
            # Hypercorn wraps it in a LifespanFailureError; gateway.server says it as a config error.
            app.extensions["startup_error"] = exc
            raise
        logger.info("gateway serving %d model(s); workers on %s", len(registry.models), gateway.link.endpoint)

    @app.after_serving
    async def stop_gateway() -> None:
        gateway.service.draining = True
        await app.extensions["reloads"].stop()
        await gateway.supervisor.stop(registry.server.shutdown_grace_s)
        await gateway.service.stop()
        await gateway.link.close()
        await counters.stop()
        if app.extensions["response_store"] is not None:
            await app.extensions["response_store"].close()
        if registry.server.runtime_dir is None:
            shutil.rmtree(runtime_dir, ignore_errors=True)
        tracing.stop()  # the last spans are exported before the process exits
        logger.info("gateway stopped")

    @app.errorhandler(APIError)
    async def api_error(error: APIError) -> Any:
        body = anthropic_error_body(error.status, error.message) if is_anthropic_request() else error.body()
        return jsonify(body), error.status, error.headers

    @app.errorhandler(RequestSchemaValidationError)
    async def schema_error(error: RequestSchemaValidationError) -> Any:
        return await api_error(_invalid_body(error))

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Any:
        status = error.code or 500
        if is_anthropic_request():
            return jsonify(anthropic_error_body(status, error.description or error.name)), status
        body = error_body(
            error.description or error.name,
            _HTTP_ERROR_TYPES.get(status, "invalid_request_error"),
            code=_HTTP_ERROR_CODES.get(status),
        )
        return jsonify(body), status

    @app.errorhandler(Exception)
    async def unexpected_error(error: Exception) -> Any:
        logger.exception("unhandled error")
        if is_anthropic_request():
            return jsonify(anthropic_error_body(500, "internal server error")), 500
        return jsonify(error_body("internal server error", "server_error", None, "internal_error")), 500

    return app
