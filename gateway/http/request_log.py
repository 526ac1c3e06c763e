"""Per-request logging hooks: the request id, the log context, and one access log line per request.

Runs in the gateway process, as Quart `before_request` / `after_request` / `teardown_request` hooks
(app.py registers them ahead of auth, so refused requests get an id and a line too). Owns
X-Request-ID: a safe incoming id is kept, anything else is replaced by a fresh one, and the id goes
back on every response, errors and event streams included.

The access line (logger `gateway.access`, INFO) tells what really happened: method, path, the
final status, duration, request id, model, the worker that served it, the client's address, the
API key's *name*, and for generations prompt and completion tokens, time to first token and
finish reason, and the model asked for when a fallback answered (`fallback_from`). A stream's
status is its real outcome, read from its RequestOwner's metrics recorder when the stream ends: a
stream that failed midway is logged with the error's status (503, 408...), not the 200 its headers
carried; one whose client left is 499. A non-streaming request whose client left never reaches
`after_request`: the teardown hook logs it as 499. Never the key, a header, the body or a prompt.
Polled endpoints (POLLED_PATHS) are logged at DEBUG.
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
from gateway.observability.metrics import CLIENT_CLOSED, RequestRecorder

access_logger = logging.getLogger("gateway.access")

REQUEST_ID_HEADER = "X-Request-ID"
_MAX_LOGGED_PATH = 256
# Polled endpoints (probes, Prometheus scrapes, the status page's fetch every second) would drown
# the access log at INFO: their lines go out at DEBUG. Refused keys are still logged by gateway.http.auth.
POLLED_PATHS = frozenset({"/health/live", "/health/ready", "/metrics", "/admin/workers"})


class AccessLine:
    """What the access line says, taken while the request context exists; emitted once."""

    __slots__ = ("fields", "started", "key_name", "level", "emitted", "recorder", "fallback_from")

    def __init__(self, started: float) -> None:
        # repr escapes control characters: a path with %0A in it must not forge a second log line.
        path = repr(request.path[:_MAX_LOGGED_PATH])[1:-1]
        self.fields: dict[str, Any] = {"method": request.method, "path": path, "client": request.remote_addr}
        self.started = started
        self.key_name: str | None = None
        self.level = (
            logging.DEBUG if request.method == "GET" and request.path in POLLED_PATHS else logging.INFO
        )
        self.emitted = False
        self.recorder: RequestRecorder | None = None
        self.fallback_from: tuple[str, str] | None = None  # (the model asked for, why it did not answer)

    def take_request_state(self) -> None:
        """What became known while the request ran: the key's name and the generation's recorder."""
        api_key = g.get("api_key")
        self.key_name = api_key.name if api_key is not None else None
        self.recorder = g.get("request_recorder")
        self.fallback_from = g.get("fallback_from")

    def outcome(self, fallback: int) -> int:
        """The request's real final status: its recorder's, once the request has finished."""
        recorder = self.recorder
        if recorder is not None and recorder.status is not None:
            return recorder.status
        return fallback

    def emit(self, status: int) -> None:
        if self.emitted:
            return
        self.emitted = True
        duration_ms = round((time.perf_counter() - self.started) * 1000.0, 1)
        extra: dict[str, Any] = {**self.fields, **log_context(), "status": status, "duration_ms": duration_ms}
        extra["key_name"] = self.key_name
        text = [f"{self.fields['method']} {self.fields['path']} {status} {duration_ms:.1f}ms"]
        recorder = self.recorder
        if recorder is not None:
            extra["prompt_tokens"] = recorder.prompt_tokens
            extra["completion_tokens"] = recorder.completion_tokens
            text.append(f"tokens={recorder.prompt_tokens}+{recorder.completion_tokens}")
            if recorder.ttft_s is not None:
                extra["ttft_ms"] = round(recorder.ttft_s * 1000.0, 1)
                text.append(f"ttft={extra['ttft_ms']:.1f}ms")
            if recorder.finish_reasons:
                extra["finish_reason"] = ",".join(sorted(set(recorder.finish_reasons)))
                text.append(f"finish={extra['finish_reason']}")
        if self.fallback_from is not None:
            extra["fallback_from"], extra["fallback_reason"] = self.fallback_from
            text.append(f"fallback_from={self.fallback_from[0]}({self.fallback_from[1]})")
        if self.key_name:
            text.append(f"key={self.key_name}")
        if self.fields["client"]:
            text.append(f"client={self.fields['client']}")
        access_logger.log(self.level, "%s", " ".join(text), extra=extra)


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
            # Closing the body ends the stream's generator, which closes its RequestOwner: the
            # recorder then holds the real outcome.
            await self.inner.__aexit__(exc_type, exc_value, tb)  # type: ignore[arg-type]
        finally:
            gone = exc_type is not None and issubclass(exc_type, (asyncio.CancelledError, GeneratorExit))
            self.line.emit(self.line.outcome(CLIENT_CLOSED if gone else self.status))

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._body.__aiter__()  # type: ignore[no-any-return]


async def begin_request() -> None:
    """before_request: the request's id and a fresh log context, before anything can log."""
    g.request_started = time.perf_counter()
    g.request_id = request_id_from(request.headers.get(REQUEST_ID_HEADER))
    start_log_context(g.request_id)
    g.access_line = AccessLine(g.request_started)


async def finish_request(response: Response) -> Response:
    """after_request: echo the id; log the request now, or when its stream ends."""
    request_id = g.get("request_id")
    if request_id is None:  # begin_request did not run (an earlier hook failed): still answer with one
        await begin_request()
        request_id = g.request_id
    response.headers[REQUEST_ID_HEADER] = request_id
    line: AccessLine = g.access_line
    line.take_request_state()
    if response.mimetype == "text/event-stream" and isinstance(response.response, ResponseBody):
        response.response = LoggedBody(response.response, line, response.status_code)
    else:
        line.emit(response.status_code)
    return response


async def end_request(exc: BaseException | None) -> None:
    """teardown_request: a request that never reached after_request (its client left while a
    non-streaming answer was being made, so the task was cancelled) still gets its line: 499."""
    line: AccessLine | None = g.get("access_line")
    if line is None or line.emitted or exc is None:
        return  # logged already, or a stream whose line comes when it ends
    line.take_request_state()
    line.emit(line.outcome(CLIENT_CLOSED if isinstance(exc, asyncio.CancelledError) else 500))
