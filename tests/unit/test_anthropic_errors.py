"""Anthropic's error shape for every status the gateway answers on /v1/messages, and the stream's
error event (a failure after the stream opened).

Runs in the pytest process: the formatter and the error bodies, no server (the routes' 400, 401 and
404 through the anthropic SDK are in tests/integration/test_anthropic_messages.py).
"""

from __future__ import annotations

import json

import pytest

from gateway.errors import QueueFull, RequestTimeout, ServiceUnavailable, WorkerFailed
from gateway.http.anthropic_format import MessagesFormatter, anthropic_error_body
from gateway.tools.plan import ToolPlan


@pytest.mark.parametrize(
    ("status", "kind"),
    [(429, "rate_limit_error"), (503, "overloaded_error"), (408, "timeout_error"), (413, "request_too_large"),
     (500, "api_error"), (502, "api_error")],
)  # fmt: skip
def test_each_status_has_anthropics_error_type(status: int, kind: str) -> None:
    assert anthropic_error_body(status, "why") == {"type": "error", "error": {"type": kind, "message": "why"}}


@pytest.mark.parametrize(
    ("error", "kind"),
    [(QueueFull("the queue is full"), "rate_limit_error"),
     (ServiceUnavailable("no worker"), "overloaded_error"),
     (WorkerFailed("the worker died"), "overloaded_error"),
     (RequestTimeout("deadline"), "timeout_error")],
)  # fmt: skip
def test_a_failure_mid_stream_is_an_error_event(error: Exception, kind: str) -> None:
    formatter = MessagesFormatter("m", ToolPlan("none"))
    raw = formatter.stream_error(error)  # type: ignore[arg-type]
    head, data = raw.decode().removesuffix("\n\n").split("\n")
    assert head == "event: error"
    payload = json.loads(data.removeprefix("data: "))
    assert payload == {"type": "error", "error": {"type": kind, "message": str(error)}}
