"""Logging for the gateway process: text or JSON lines, with the request id and model on each line.

Runs in the gateway process. Owns the root logger's set-up (`configure_logging`, called once by
`gateway serve`), the per-request log context, and the throttled log of workers' load progress.

The context lives in contextvars: a Quart request runs in one asyncio task (hooks, view and the
body of a streamed response alike), and every task it starts copies the context, so each line
logged on behalf of a request carries its id without passing it around. Tasks started outside a
request (the supervisor's, the worker link's reader) have no request id, as they should.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import IO, Any

from wire import log_format
from wire import messages as wire

logger = logging.getLogger(__name__)

_request_id: ContextVar[str | None] = ContextVar("log_request_id", default=None)
_model: ContextVar[str | None] = ContextVar("log_model", default=None)
_worker: ContextVar[str | None] = ContextVar("log_worker", default=None)
_CONTEXT = {"request_id": _request_id, "model": _model, "worker": _worker}

# What we accept from a client's X-Request-ID: short and inert in a log line, a header or a shell.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def request_id_from(header: str | None) -> str:
    """The client's X-Request-ID if it is safe to echo and log, else a fresh one."""
    if header is not None and _REQUEST_ID.fullmatch(header):
        return header
    return uuid.uuid4().hex


def start_log_context(request_id: str) -> None:
    """A new request: its id, and no model or worker until routing finds them."""
    _request_id.set(request_id)
    _model.set(None)
    _worker.set(None)


def set_log_context(*, model: str | None = None, worker: str | None = None) -> None:
    """Add what became known while handling the request (None leaves a field as it is)."""
    if model is not None:
        _model.set(model)
    if worker is not None:
        _worker.set(worker)


def bind_worker_log_context(worker: str, model: str) -> None:
    """For a task that acts for one worker (the supervisor's per-worker task): its lines carry the
    worker and model, and never the id of a request that happened to start the task."""
    _request_id.set(None)
    _model.set(model)
    _worker.set(worker)


@contextmanager
def worker_log_context(worker: str, model: str) -> Iterator[None]:
    """The same for one call (handling one frame of a worker), restored afterwards."""
    tokens = [(var, var.set(value)) for var, value in ((_model, model), (_worker, worker))]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def log_context() -> dict[str, str]:
    """The context fields known in the current task."""
    return {name: value for name, var in _CONTEXT.items() if (value := var.get()) is not None}


class RequestContext(logging.Filter):
    """Copies the current task's context onto each record; `extra={...}` given by a caller wins."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, var in _CONTEXT.items():
            if getattr(record, name, None) is None:
                value = var.get()
                if value is not None:
                    setattr(record, name, value)
        return True


def configure_logging(level: str = "INFO", fmt: str = "text", stream: IO[str] | None = None) -> None:
    """Set up the gateway process's logging: `fmt` is "text" or "json" (see wire.log_format)."""
    log_format.install(level, fmt, RequestContext(), stream)


# ---- load progress ------------------------------------------------------------------------------


class LoadProgressLog:
    """Logs each worker's load progress at INFO, at most once per 10% step.

    Engines may report progress per layer (hundreds of Status messages for a large model); the
    state changes are logged by the supervisor, the percentages here.
    """

    STEPS = 10

    def __init__(self) -> None:
        self._logged: dict[str, int] = {}  # worker id -> last step logged

    def observe(self, worker_id: str, message: wire.Message) -> None:
        if isinstance(message, (wire.Hello, wire.Ready)):
            # A new process (or a finished load): the next load starts from 0% again.
            self._logged.pop(worker_id, None)
            return
        if not isinstance(message, wire.Status) or message.progress is None:
            return
        progress = min(max(float(message.progress), 0.0), 1.0)
        step = int(progress * self.STEPS + 1e-9)
        if step <= self._logged.get(worker_id, -1):
            return
        self._logged[worker_id] = step
        logger.info(
            "worker %s %s: %d%% (%s)",
            worker_id,
            message.state.value,
            round(progress * 100),
            message.detail,
            extra={"worker": worker_id},
        )

    def wrap(self, callback: Callable[..., None]) -> Callable[..., None]:
        """The link's lifecycle `callback` (the supervisor's), with load progress logged first;
        arguments after (worker id, message), such as the link's `remote` flag, pass through as given."""

        def observed(worker_id: str, message: wire.Message, *more: Any) -> None:
            self.observe(worker_id, message)
            callback(worker_id, message, *more)

        return observed


class RateLimitedLog:
    """Logs each kind of line at most once per `every_s`, then how many were held back.

    For lines an outsider can trigger at will (refused frames, failed accepts): an attack must not
    turn into a flood of log lines, yet each kind stays visible.
    """

    def __init__(self, target: logging.Logger, every_s: float = 10.0) -> None:
        self.target = target
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, message: str, *args: Any) -> None:
        self.log(logging.WARNING, message, *args)

    def log(self, level: int, message: str, *args: Any) -> None:
        # Lines differing in their first argument (the key or the peer) are limited separately, so
        # each offender is still named, while one offender cannot flood the log.
        kind = f"{message}\x00{args[0] if args else ''}"
        now = time.monotonic()
        if len(self._last) > 4096:
            self._last.clear()
        if now - self._last.get(kind, -self.every_s) < self.every_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        self._last[kind] = now
        held = self._held.pop(kind, 0)
        suffix = f" ({held} more like this in the last {self.every_s:g}s)" if held else ""
        self.target.log(level, message + suffix, *args)
