"""OpenTelemetry tracing in the gateway: one span per request, the parent of its worker spans.

Runs in the gateway process, on its asyncio loop (the SDK's batch processor exports from its own
thread). Owns the process's tracer provider, built at startup from the standard `OTEL_*` variables
(wire.trace_context.tracing_requested) and flushed at shutdown, and `ENABLED`, the module flag a
request checks once: while it is False (the default) no span is ever created. Owns `RequestSpan`, a
generation or embeddings request's SERVER span after the OpenTelemetry GenAI conventions: named
`{operation} {model}`, the child of a client's `traceparent` header when it sends one, with the
request's parameters when it starts and its usage, finish reasons and time to first token when it
ends. Nothing is done per token: the span is touched when the request starts and when it closes.
No prompt or output text is ever put on a span.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from wire import trace_context as names
from wire.params import SamplingParams

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from gateway.errors import APIError

logger = logging.getLogger(__name__)

SERVICE_NAME = "llm-gateway"  # unless OTEL_SERVICE_NAME names it
INSTRUMENTATION_SCOPE = "llm_gateway.gateway"

ENABLED = False  # set by start(); a request creates a span only while it is True
_tracer: trace.Tracer | None = None
_provider: TracerProvider | None = None
# The frames to the workers carry W3C trace context whatever propagators clients use (OTEL_PROPAGATORS).
_WIRE_FORMAT = TraceContextTextMapPropagator()


def start(environ: Mapping[str, str] = os.environ) -> bool:
    """Build the tracer provider if the `OTEL_*` variables ask for tracing; whether they did. A
    malformed setting raises ValueError (the gateway refuses to start rather than run untraced)."""
    global ENABLED, _tracer, _provider
    exporter_name = names.tracing_requested(environ)
    if exporter_name is None:
        return False
    service = {"service.name": environ.get("OTEL_SERVICE_NAME") or SERVICE_NAME}
    provider = names.build_provider(exporter_name, service)
    _provider, _tracer, ENABLED = provider, provider.get_tracer(INSTRUMENTATION_SCOPE), True
    logger.info("tracing on: spans exported with the %s exporter", exporter_name)
    return True


def stop() -> None:
    """Export what is still buffered and stop the provider (the gateway's shutdown)."""
    global ENABLED, _tracer, _provider
    provider, _provider, _tracer, ENABLED = _provider, None, None, False
    if provider is not None:
        provider.shutdown()  # flushes the batch processor first


class RequestSpan:
    """One request's span, from its start in the serving path to its owner's close (a generation)
    or its answer (embeddings)."""

    __slots__ = ("span", "traceparent", "_start_ns")

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self._start_ns = time.time_ns()
        carrier: dict[str, str] = {}
        _WIRE_FORMAT.inject(carrier, context=trace.set_span_in_context(span))
        # What each Generate of this request carries: its worker span becomes this span's child.
        self.traceparent: str | None = carrier.get("traceparent")

    def end(
        self,
        status: int,
        finish_reasons: list[str],
        input_tokens: int,
        output_tokens: int | None,
        ttft_s: float | None,
        error: APIError | None,
    ) -> None:
        """The request's outcome; `output_tokens` None for an operation without output (embeddings)."""
        span = self.span
        span.set_attribute("http.response.status_code", status)
        span.set_attribute(names.INPUT_TOKENS, input_tokens)
        if output_tokens is not None:
            span.set_attribute(names.OUTPUT_TOKENS, output_tokens)
        if finish_reasons:
            span.set_attribute(names.FINISH_REASONS, finish_reasons)
        if ttft_s is not None:
            span.set_attribute(names.TIME_TO_FIRST_TOKEN, ttft_s)
            span.add_event(names.FIRST_TOKEN_EVENT, timestamp=self._start_ns + int(ttft_s * 1e9))
        if error is not None:
            span.set_attribute(names.ERROR_TYPE, error.code or type(error).__name__)
            if status >= 500:  # a server span's 4xx is the client's error, not the server's
                span.set_status(Status(StatusCode.ERROR, error.message))
        span.end()


def start_request_span(
    operation: str,
    request_model: str,
    response_model: str,
    params: SamplingParams | None,
    headers: object,
    streaming: bool,
    **attributes: Any,
) -> RequestSpan | None:
    """The span of a generation request, or None while tracing is off. `headers` are the client's
    (any mapping with a case-insensitive `get`, as the request's are): a `traceparent` among them
    makes the span its child (the propagators of OTEL_PROPAGATORS, W3C trace context by default).
    `params` are a generation's (None for embeddings); `attributes` are the operation's own."""
    if _tracer is None:
        return None
    attributes.update(
        {
            names.OPERATION: operation,
            names.REQUEST_MODEL: request_model,
            names.RESPONSE_MODEL: response_model,
            "llm_gateway.stream": streaming,
        }
    )
    if params is not None:
        attributes.update(names.request_attributes(params))
    span = _tracer.start_span(
        names.span_name(operation, request_model),
        context=propagate.extract(headers),
        kind=SpanKind.SERVER,
        attributes=attributes,
    )
    return RequestSpan(span)
