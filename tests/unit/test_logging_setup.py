"""Log formats, the per-request log context, the access line, and the load-progress throttle.

Runs in the pytest process, with no gateway or worker: a small Quart app carries the same
request hooks as the real one (gateway/app.py registers them the same way).
"""

from __future__ import annotations

import asyncio
import contextvars
import io
import json
import logging
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from quart import Quart, Response, g

from gateway.http.request_log import begin_request, finish_request
from gateway.observability.logging_setup import (
    LoadProgressLog,
    configure_logging,
    log_context,
    request_id_from,
    set_log_context,
    start_log_context,
)
from wire import log_format
from wire import messages as wire
from wire.states import WorkerState

SECRET = "sk-secret-0123456789abcdef"
PROMPT = "the secret prompt text"


@pytest.fixture()
def log_stream() -> Iterator[io.StringIO]:
    """Root logging into a buffer (JSON), restored afterwards so pytest's own capture keeps working."""
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    stream = io.StringIO()
    configure_logging("INFO", "json", stream)
    yield stream
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in saved_handlers:
        root.addHandler(handler)
    root.setLevel(saved_level)


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def test_json_lines_carry_the_request_context(log_stream: io.StringIO) -> None:
    def handle() -> None:
        start_log_context("req-1")
        set_log_context(model="demo")
        logging.getLogger("gateway.test").info("hello %s", "world")
        logging.getLogger("gateway.test").warning("with worker", extra={"worker": "demo#0"})

    contextvars.copy_context().run(handle)
    logging.getLogger("gateway.test").info("outside any request")
    first, second, third = lines(log_stream)
    assert first["message"] == "hello world" and first["level"] == "INFO"
    assert first["logger"] == "gateway.test" and first["time"].endswith("+00:00")
    assert first["request_id"] == "req-1" and first["model"] == "demo" and "worker" not in first
    assert second["worker"] == "demo#0" and second["request_id"] == "req-1"
    assert "request_id" not in third and "model" not in third  # the context stayed in its task


def test_exceptions_stay_inside_one_json_line(log_stream: io.StringIO) -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("gateway.test").exception("failed")
    (entry,) = lines(log_stream)
    assert entry["message"] == "failed" and "ValueError: boom" in entry["exception"]


def test_text_format_appends_known_context() -> None:
    record = logging.LogRecord("gateway.x", logging.INFO, __file__, 1, "msg %d", (1,), None)
    record.request_id, record.model = "abc", "demo"
    line = log_format.TextFormatter().format(record)
    assert line.endswith("INFO gateway.x: msg 1 [request_id=abc model=demo]")
    bare = logging.LogRecord("gateway.x", logging.INFO, __file__, 1, "plain", (), None)
    assert log_format.TextFormatter().format(bare).endswith("gateway.x: plain")


def test_worker_context_is_static() -> None:
    context = log_format.StaticContext(worker="demo#0")
    context.fields["model"] = "demo"
    record = logging.LogRecord("model_worker", logging.INFO, __file__, 1, "ready", (), None)
    assert context.filter(record)
    entry = json.loads(log_format.JsonFormatter().format(record))
    assert entry["worker"] == "demo#0" and entry["model"] == "demo"


def test_format_choice() -> None:
    assert log_format.resolve_format(None, {}) == "text"
    assert log_format.resolve_format(None, {"LOG_FORMAT": "JSON"}) == "json"
    assert log_format.resolve_format("text", {"LOG_FORMAT": "json"}) == "text"
    with pytest.raises(ValueError, match="LOG_FORMAT"):
        log_format.resolve_format(None, {"LOG_FORMAT": "xml"})


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("abc-123_X.y", True),
        ("a" * 64, True),
        ("a" * 65, False),
        ("", False),
        ("has space", False),
        ("new\nline", False),
        ("semi;colon", False),
        (None, False),
    ],
)
def test_request_ids_are_sanitized(given: str | None, kept: bool) -> None:
    result = request_id_from(given)
    if kept:
        assert result == given
    else:
        assert result != given and len(result) == 32 and int(result, 16) >= 0


# ---- the hooks, through a Quart app ------------------------------------------------------------


def make_app() -> Quart:
    app = Quart(__name__)

    async def fake_auth() -> None:
        g.api_key = SimpleNamespace(name="alice", key=SECRET)

    app.before_request(begin_request)
    app.before_request(fake_auth)
    app.after_request(finish_request)

    @app.post("/generate")
    async def generate() -> Any:
        set_log_context(model="demo")
        logging.getLogger("gateway.test").debug("prompt: %s", PROMPT)  # DEBUG only, as the code does
        return {"ok": True, "context": log_context()}

    @app.get("/stream")
    async def stream() -> Response:
        set_log_context(model="demo")

        async def body() -> AsyncIterator[bytes]:
            for _ in range(3):
                await asyncio.sleep(0.01)  # a body that streams over time (the behaviour logged)
                yield b"data: x\n\n"
            logging.getLogger("gateway.test").info("stream done")

        return Response(body(), content_type="text/event-stream")

    return app


def request(
    app: Quart, method: str, path: str, headers: dict[str, str], **kwargs: Any
) -> tuple[int, Any, bytes]:
    async def go() -> tuple[int, Any, bytes]:
        response = await app.test_client().open(path, method=method, headers=headers, **kwargs)
        return response.status_code, response.headers, await response.get_data()

    return asyncio.run(go())


def access_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [line for line in lines(stream) if line["logger"] == "gateway.access"]


def test_access_line_and_request_id(log_stream: io.StringIO) -> None:
    app = make_app()
    headers = {"Authorization": f"Bearer {SECRET}", "X-Request-ID": "client-id-1"}
    status, response_headers, body = request(app, "POST", "/generate", headers, json={"prompt": PROMPT})
    assert status == 200 and response_headers["X-Request-ID"] == "client-id-1"
    assert json.loads(body)["context"] == {"request_id": "client-id-1", "model": "demo"}
    (line,) = access_lines(log_stream)
    # Quart's test client has no socket: its client address is "<local>".
    assert line["message"] == f"POST /generate 200 {line['duration_ms']:.1f}ms key=alice client=<local>"
    assert line["client"] == "<local>"
    assert line["request_id"] == "client-id-1" and line["model"] == "demo" and line["key_name"] == "alice"
    assert line["method"] == "POST" and line["path"] == "/generate" and line["status"] == 200
    output = log_stream.getvalue()
    assert SECRET not in output and PROMPT not in output


def test_errors_get_an_id_and_a_line(log_stream: io.StringIO) -> None:
    status, headers, _ = request(make_app(), "GET", "/missing", {"X-Request-ID": "bad id!"})
    assert status == 404
    generated = headers["X-Request-ID"]
    assert generated != "bad id!" and len(generated) == 32
    (line,) = access_lines(log_stream)
    assert line["status"] == 404 and line["request_id"] == generated and "model" not in line


def test_streams_are_logged_when_they_end(log_stream: io.StringIO) -> None:
    status, headers, body = request(make_app(), "GET", "/stream", {"X-Request-ID": "s-1"})
    assert status == 200 and headers["X-Request-ID"] == "s-1" and body.count(b"data: x") == 3
    entries = lines(log_stream)
    done = next(i for i, e in enumerate(entries) if e["message"] == "stream done")
    access = next(i for i, e in enumerate(entries) if e["logger"] == "gateway.access")
    assert done < access  # the line is written after the last chunk, with the whole duration
    assert entries[done]["request_id"] == "s-1" and entries[access]["model"] == "demo"


def test_polled_paths_are_logged_at_debug(log_stream: io.StringIO) -> None:
    app = make_app()
    request(app, "GET", "/health/ready", {})
    assert access_lines(log_stream) == []  # probes and the status page's polling stay out of INFO
    logging.getLogger().setLevel(logging.DEBUG)
    request(app, "GET", "/health/ready", {})
    (line,) = access_lines(log_stream)
    assert line["level"] == "DEBUG" and line["path"] == "/health/ready"


def test_control_characters_in_paths_cannot_forge_lines() -> None:
    root = logging.getLogger()
    saved = list(root.handlers)
    stream = io.StringIO()
    configure_logging("INFO", "text", stream)
    try:
        request(make_app(), "GET", "/x%0Afake INFO gateway.access: GET /admin 200", {})
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved:
            root.addHandler(handler)
    access = [line for line in stream.getvalue().splitlines() if "gateway.access" in line]
    assert len(access) == 1 and "\\n" in access[0]


# ---- load progress ------------------------------------------------------------------------------


def test_load_progress_is_logged_at_most_every_ten_percent(caplog: pytest.LogCaptureFixture) -> None:
    progress_log = LoadProgressLog()
    seen: list[wire.Message] = []
    observe = progress_log.wrap(lambda worker_id, message: seen.append(message))
    caplog.set_level(logging.INFO, logger="gateway.observability.logging_setup")
    for step in range(1001):
        observe("demo#0", wire.Status(WorkerState.LOADING, f"module {step}/1000", step / 1000))
    assert len(seen) == 1001  # the supervisor still sees every message
    logged = [r for r in caplog.records if r.name == "gateway.observability.logging_setup"]
    assert [r.getMessage().split(": ")[1].split()[0] for r in logged] == [f"{p}%" for p in range(0, 101, 10)]
    assert all(r.levelno == logging.INFO and r.worker == "demo#0" for r in logged)  # type: ignore[attr-defined]
    caplog.clear()
    observe("demo#0", wire.Status(WorkerState.LOADING, "again", 0.5))
    assert not caplog.records  # no going back while the same load runs
    observe("demo#0", wire.Hello(wire.PROTOCOL_VERSION, "demo#0", 1))  # a restarted process
    observe("demo#0", wire.Status(WorkerState.LOADING, "again", 0.05))
    observe("demo#0", wire.Status(WorkerState.WARMING, "warm-up", None))
    assert [r.getMessage() for r in caplog.records] == ["worker demo#0 loading: 5% (again)"]


def test_wrapped_callbacks_get_every_argument() -> None:
    received: list[tuple[Any, ...]] = []
    observe = LoadProgressLog().wrap(lambda *args: received.append(args))
    status = wire.Status(WorkerState.LOADING, "weights", 0.5)
    observe("demo#0", status, True)  # the link adds whether the frame came in over tcp
    observe("demo#0", status)
    assert received == [("demo#0", status, True), ("demo#0", status)]
