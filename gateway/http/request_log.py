"""Per-request logging hooks: the request id, the log context, and one access log line per request.

Runs in the gateway process, as Quart `before_request` / `after_request` hooks (app.py registers
them ahead of auth, so refused requests get an id and a line too). Owns X-Request-ID: a safe
incoming id is kept, anything else is replaced by a fresh one, and the id goes back on every
response, errors and event streams included. The access line (logger `gateway.access`, INFO) holds
method, path, status, duration, request id, model and the API key's *name*; never the key, a
header, the body or a prompt. Polled endpoints (POLLED_PATHS) are logged at DEBUG.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

from quart import Response, g, request
from quart.wrappers.response import ResponseBody

from gateway.observability.logging_setup import log_context, request_id_from, start_log_context
from gateway.observability.metrics import CLIENT_CLOSED

access_logger = logging.getLogger("gateway.access")

REQUEST_ID_HEADER = "X-Request-ID"
_MAX_LOGGED_PATH = 256
# Polled endpoints (probes, Prometheus scrapes, the status page's fetch every second) would drown
# the access log at INFO: their lines go out at DEBUG. Refused keys are still logged by gateway.http.auth.
POLLED_PATHS = frozenset({"/health/live", "/health/ready", "/metrics", "/admin/workers"})


class AccessLine:
    """What the access line says, taken while the request context exists; emitted once."""

    __slots__ = ("fields", "started", "key_name", "level", "emitted")

    def __init__(self, started: float, key_name: str | None) -> None:
        # repr escapes control characters: a path with %0A in it must not forge a second log line.
        path = repr(request.path[:_MAX_LOGGED_PATH])[1:-1]
        self.fields: dict[str, Any] = {"method": request.method, "path": path, **log_context()}
        self.started = started
        self.key_name = key_name
        self.level = (
            logging.DEBUG if request.method == "GET" and request.path in POLLED_PATHS else logging.INFO
        )
        self.emitted = False

    def emit(self, status: int) -> None:
        if self.emitted:
            return
        self.emitted = True
        duration_ms = round((time.perf_counter() - self.started) * 1000.0, 1)
        key = f" key={self.key_name}" if self.key_name else ""
        access_logger.log(
            self.level,
            "%s %s %d %.1fms%s",
            self.fields["method"],
            self.fields["path"],
            status,
            duration_ms,
            key,
            extra={**self.fields, "status": status, "duration_ms": duration_ms, "key_name": self.key_name},
        )


class LoggedBody(ResponseBody):
    """A streamed body that emits its access line when the stream ends, not when it starts."""

    def __init__(self, inner: ResponseBody, line: AccessLine, status: int) -> None:
        self.inner = inner
        self.line = line
        self.status = status
        self._body: Any = None

    async def __aenter__(self) -> LoggedBody:
        self._body = await self.inner.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc_value: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self.inner.__aexit__(exc_type, exc_value, tb)  # type: ignore[arg-type]
        finally:
            gone = exc_type is not None and issubclass(exc_type, (asyncio.CancelledError, GeneratorExit))
            self.line.emit(CLIENT_CLOSED if gone else self.status)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._body.__aiter__()  # type: ignore[no-any-return]


async def begin_request() -> None:
    """before_request: the request's id and a fresh log context, before anything can log."""
    g.request_started = time.perf_counter()
    g.request_id = request_id_from(request.headers.get(REQUEST_ID_HEADER))
    start_log_context(g.request_id)


async def finish_request(response: Response) -> Response:
    """after_request: echo the id; log the request now, or when its stream ends."""
    request_id = g.get("request_id")
    if request_id is None:  # begin_request did not run (an earlier hook failed): still answer with one
        await begin_request()
        request_id = g.request_id
    response.headers[REQUEST_ID_HEADER] = request_id
    api_key = g.get("api_key")
    line = AccessLine(g.request_started, api_key.name if api_key is not None else None)
    if response.mimetype == "text/event-stream" and isinstance(response.response, ResponseBody):
        response.response = LoggedBody(response.response, line, response.status_code)
    else:
        line.emit(response.status_code)
    return response
