"""OpenTelemetry tracing in the worker: one span per generation job, the child of the gateway's span.

Runs in the worker process, on the serve loop's thread (the SDK's batch processor exports from its
own thread). Owns the process's tracer provider, built at start-up from the same standard `OTEL_*`
variables the gateway reads (wire.trace_context.tracing_requested; a spawned worker inherits the
gateway's environment) and flushed when the process exits, and `JobSpans`: the spans of the live
jobs whose Generate (or Embed) carried a `traceparent`. A job without one (its gateway does not trace) gets no
span, and while tracing is off there is no `JobSpans` at all. The spans follow the OpenTelemetry
GenAI conventions like the gateway's; a span starts when the Generate arrives and ends when the job
finishes, is refused, cancelled or aborted. Per step, only the jobs still waiting for their first
token or ending in that step touch their span; no span work is ever done per token.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from wire import messages as wire
from wire import trace_context as names
from wire.results import JobOutput

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

logger = logging.getLogger(__name__)

SERVICE_NAME = "llm-gateway-worker"  # unless OTEL_SERVICE_NAME names it
INSTRUMENTATION_SCOPE = "llm_gateway.worker"

ENABLED = False  # set by start(); JobDesk makes its JobSpans only while it is True
_tracer: trace.Tracer | None = None
_provider: TracerProvider | None = None
_WIRE_FORMAT = TraceContextTextMapPropagator()  # what Generate.traceparent is


def start(worker_id: str, model: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Build the tracer provider if the `OTEL_*` variables ask for tracing; whether they did. A
    setting this worker cannot follow is logged and tracing stays off: a worker never fails over it
    (the gateway that spawned it checked the same variables before it started)."""
    global ENABLED, _tracer, _provider
    try:
        exporter_name = names.tracing_requested(environ)
    except ValueError as exc:
        logger.warning("tracing off: %s", exc)
        return False
    if exporter_name is None:
        return False
    resource = {
        "service.name": environ.get("OTEL_SERVICE_NAME") or SERVICE_NAME,
        "service.instance.id": worker_id,
        "llm_gateway.model": model,
    }
    provider = names.build_provider(exporter_name, resource)
    _provider, _tracer, ENABLED = provider, provider.get_tracer(INSTRUMENTATION_SCOPE), True
    logger.info("tracing on: spans exported with the %s exporter", exporter_name)
    return True


def stop() -> None:
    """Export what is still buffered and stop the provider (the process is about to exit)."""
    global ENABLED, _tracer, _provider
    provider, _provider, _tracer, ENABLED = _provider, None, None, False
    if provider is not None:
        provider.shutdown()


@dataclass(eq=False, slots=True)
class _JobSpan:
    span: trace.Span
    started: float  # time.perf_counter() when the Generate arrived
    waiting_first_token: bool = True


class JobSpans:
    """The spans of this worker's traced jobs, by job id (rid)."""

    def __init__(self, model: str, tracer: trace.Tracer) -> None:
        self.model = model
        self._tracer = tracer
        self._open: dict[str, _JobSpan] = {}

    def start(self, msg: wire.Generate | wire.Embed) -> None:
        """A Generate (or Embed) arrived; a span for it if it carries the gateway's trace context."""
        if msg.traceparent is None:
            return
        parent = _WIRE_FORMAT.extract({"traceparent": msg.traceparent})
        attributes: dict[str, Any] = {
            names.REQUEST_MODEL: self.model,
            names.RESPONSE_MODEL: self.model,
            "llm_gateway.job_id": msg.rid,
        }
        if isinstance(msg, wire.Embed):
            operation = names.EMBEDDINGS
        else:
            operation = names.CHAT if msg.messages is not None else names.TEXT_COMPLETION
            attributes.update(names.request_attributes(msg.params))
        attributes[names.OPERATION] = operation
        span = self._tracer.start_span(
            names.span_name(operation, self.model),
            context=parent,
            kind=SpanKind.INTERNAL,
            attributes=attributes,
        )
        self._open[msg.rid] = _JobSpan(span, time.perf_counter())

    def accepted(self, rid: str, prompt_tokens: int) -> None:
        job = self._open.get(rid)
        if job is not None:
            job.span.set_attribute(names.INPUT_TOKENS, prompt_tokens)

    def outputs(self, outputs: list[JobOutput]) -> None:
        """One step's outputs: a job's first token and its end are marked on its span."""
        if not self._open:
            return
        for output in outputs:
            job = self._open.get(output.rid)
            if job is None:
                continue
            if job.waiting_first_token and output.token_ids:
                job.waiting_first_token = False
                job.span.set_attribute(names.TIME_TO_FIRST_TOKEN, time.perf_counter() - job.started)
                job.span.add_event(names.FIRST_TOKEN_EVENT)
            if output.finish_reason is not None:
                del self._open[output.rid]
                span = job.span
                span.set_attribute(names.FINISH_REASONS, [output.finish_reason.value])
                if output.usage is not None:
                    span.set_attribute(names.INPUT_TOKENS, output.usage.prompt_tokens)
                    span.set_attribute(names.OUTPUT_TOKENS, output.usage.completion_tokens)
                span.end()

    def embedded(self, rid: str, input_tokens: int) -> None:
        """An Embed was answered."""
        job = self._open.pop(rid, None)
        if job is not None:
            job.span.set_attribute(names.INPUT_TOKENS, input_tokens)
            job.span.end()

    def rejected(self, rid: str, code: str) -> None:
        """The job was refused before it started (a request error, or a worker shutting down)."""
        self._end(rid, code, error=False)

    def cancelled(self, rid: str) -> None:
        """The gateway cancelled the job (its client left, a stop string, a deadline, a budget)."""
        self._end(rid, "cancelled", error=False)

    def aborted(self, rid: str, reason: str) -> None:
        """The worker ended the job itself (its drain grace ran out, or the process is exiting)."""
        self._end(rid, reason, error=True)

    def close(self) -> None:
        for rid in list(self._open):
            self.aborted(rid, "worker_exit")

    def _end(self, rid: str, error_type: str, error: bool) -> None:
        job = self._open.pop(rid, None)
        if job is None:
            return
        job.span.set_attribute(names.ERROR_TYPE, error_type)
        if error:
            job.span.set_status(Status(StatusCode.ERROR, error_type))
        job.span.end()


def job_spans(model: str) -> JobSpans | None:
    """The job spans of a worker serving `model`, or None while tracing is off."""
    return JobSpans(model, _tracer) if _tracer is not None else None
