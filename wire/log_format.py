"""Log line formats shared by the gateway and the worker processes: plain text or JSON lines.

Runs in the gateway process and in every worker process; each sets up its own root logger once,
at start-up, through `install`. Owns the two formatters and the choice between them
(`--log-format`, else $LOG_FORMAT, else text; workers inherit the gateway's environment, so both
sides agree), and the capture of Python warnings into the same lines. Context fields (request_id,
model, worker) are record attributes that a process-specific `logging.Filter` fills in; a field that
is not known is left out of the line.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import IO, Any

FORMATS = ("text", "json")
CONTEXT_FIELDS = ("request_id", "model", "worker")
# Structured fields of the gateway's access log line. A whitelist, not "every extra attribute":
# whatever else a caller attaches to a record (a request, a body) must never reach a log line.
ACCESS_FIELDS = (
    "method", "path", "status", "duration_ms", "key_name", "client",
    "prompt_tokens", "completion_tokens", "ttft_ms", "finish_reason",
)  # fmt: skip

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def resolve_format(option: str | None, environ: Mapping[str, str]) -> str:
    """The format to use: the command-line option, else $LOG_FORMAT, else text."""
    chosen = (option or environ.get("LOG_FORMAT") or "text").strip().lower()
    if chosen not in FORMATS:
        raise ValueError(
            f"log format {chosen!r} is not one of {', '.join(FORMATS)} (LOG_FORMAT / --log-format)"
        )
    return chosen


def _iso_utc(created: float) -> str:
    return datetime.fromtimestamp(created, tz=timezone.utc).isoformat(timespec="milliseconds")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, then the context fields known."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": _iso_utc(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in (*CONTEXT_FIELDS, *ACCESS_FIELDS):
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        # default=str: a stray object must cost a less pretty line, never a lost one.
        return json.dumps(entry, ensure_ascii=False, default=str)


# Control characters in a message are written escaped (a newline as \n), so that nothing a
# client sends (a path with %0A, a model name) can start what looks like a second log line.
_ESCAPES = {code: repr(chr(code))[1:-1] for code in (*range(32), 127) if chr(code) != "\t"}


class TextFormatter(logging.Formatter):
    """The classic line, with the known context fields appended as `[request_id=... model=...]`.
    One record is one line (a traceback below it stays as it is)."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = record.message.translate(_ESCAPES)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = " ".join(
            f"{name}={value}" for name in CONTEXT_FIELDS if (value := getattr(record, name, None)) is not None
        )
        if not context:
            return line
        # Keep a traceback below the line it belongs to: the context goes at the end of line one.
        first, sep, rest = line.partition("\n")
        return f"{first} [{context}]{sep}{rest}"


class StaticContext(logging.Filter):
    """Fills in context fields that are fixed for the whole process (a worker's id and model)."""

    def __init__(self, **fields: str | None) -> None:
        super().__init__()
        self.fields = dict(fields)

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in self.fields.items():
            if value is not None and getattr(record, name, None) is None:
                setattr(record, name, value)
        return True


def install(
    level: str, fmt: str, context: logging.Filter | None = None, stream: IO[str] | None = None
) -> logging.Handler:
    """Replace the root logger's handlers with one stream handler in `fmt` ("text" or "json")."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    if context is not None:
        # On the handler, not a logger: logger filters see only records logged on that very logger.
        handler.addFilter(context)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # A library's warning (warnings.warn) becomes a record of the `py.warnings` logger, so it is one
    # line in this format (its source line escaped within it), never raw text on stderr.
    logging.captureWarnings(True)
    return handler
