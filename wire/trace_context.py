"""What both processes agree on about tracing: the trace context a Generate carries, and when tracing
is switched on.

Imported by the gateway and by every worker; stdlib and msgspec only (the OpenTelemetry SDK lives in
each process's own tracing module, gateway.observability.tracing and model_worker.tracing). Owns
`TraceParent`, the W3C `traceparent` string as a wire field type (its shape checked while a frame
decodes), and `tracing_requested`, the one reading of the standard `OTEL_*` variables: tracing is
off unless they ask for an exporter, so a gateway without them creates no span at all. Also the
OpenTelemetry GenAI semantic conventions' names (span name, attributes) that both processes write.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

if TYPE_CHECKING:
    from wire.params import SamplingParams

# version-trace_id-parent_id-flags, lower-case hex (W3C Trace Context, level 1); 55 characters.
TRACEPARENT_PATTERN = "^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"
TraceParent = Annotated[str, msgspec.Meta(pattern=TRACEPARENT_PATTERN, max_length=55)]

# The exporters the processes can build (the OTLP/HTTP protobuf one, and the SDK's console one for a
# quick look); `none` switches tracing off explicitly.
EXPORTERS = ("otlp", "console")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"


def tracing_requested(environ: Mapping[str, str]) -> str | None:
    """The exporter the standard variables ask for, or None (tracing off, the default).

    `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` switch it off. `OTEL_TRACES_EXPORTER=otlp`
    (or `console`) switches it on; so does an OTLP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT` or
    `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) when no exporter is named. Unlike the SDK's own default
    (otlp), nothing set means off: a gateway must not try to reach a collector nobody configured.
    Raises ValueError for an exporter this project does not ship."""
    if _truthy(environ.get("OTEL_SDK_DISABLED")):
        return None
    exporter = _exporter(environ)
    if exporter == "otlp":
        _check_protocol(environ)
    return exporter


def _exporter(environ: Mapping[str, str]) -> str | None:
    named = [e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]
    if not named:
        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        return "otlp" if endpoint else None
    if named == ["none"]:
        return None
    if len(named) != 1 or named[0] not in EXPORTERS:
        given = environ["OTEL_TRACES_EXPORTER"]
        raise ValueError(f"OTEL_TRACES_EXPORTER={given!r}: give one of {', '.join(EXPORTERS)} or none")
    return named[0]


def _check_protocol(environ: Mapping[str, str]) -> None:
    # Only the OTLP/HTTP exporter ships: a grpc request must be refused, not quietly sent over HTTP.
    for variable in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        given = environ.get(variable, "").strip()
        if given and given != "http/protobuf":
            raise ValueError(f"{variable}={given!r}: only http/protobuf is supported (OTLP over HTTP)")


def build_provider(exporter_name: str, resource_attributes: dict[str, str]) -> Any:
    """The SDK's TracerProvider exporting in batches with the named exporter, for either process.

    The SDK and the exporter are imported here, only when tracing is on: a process without it never
    loads them. The OTLP exporter reads OTEL_EXPORTER_OTLP_* (endpoint, headers, timeout,
    compression), the sampler OTEL_TRACES_SAMPLER, the batch processor OTEL_BSP_*."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    exporter: SpanExporter
    if exporter_name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    else:
        exporter = ConsoleSpanExporter()
    provider = TracerProvider(resource=Resource.create(resource_attributes))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


# ---- OpenTelemetry GenAI semantic conventions: the attribute names both processes write ---------

OPERATION = "gen_ai.operation.name"
CHAT, TEXT_COMPLETION, EMBEDDINGS = "chat", "text_completion", "embeddings"  # its values here
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"  # seconds; the event below marks the moment
FIRST_TOKEN_EVENT = "gen_ai.first_token"
ERROR_TYPE = "error.type"


def span_name(operation: str, model: str) -> str:
    """`{gen_ai.operation.name} {gen_ai.request.model}`, the conventions' span name."""
    return f"{operation} {model}"


def request_attributes(params: SamplingParams) -> dict[str, Any]:
    """The `gen_ai.request.*` attributes of a job's sampling parameters."""
    attributes: dict[str, Any] = {
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
    }
    if params.top_k:
        attributes["gen_ai.request.top_k"] = params.top_k
    if params.frequency_penalty:
        attributes["gen_ai.request.frequency_penalty"] = params.frequency_penalty
    if params.presence_penalty:
        attributes["gen_ai.request.presence_penalty"] = params.presence_penalty
    if params.seed is not None:
        attributes["gen_ai.request.seed"] = params.seed
    if params.stop:
        attributes["gen_ai.request.stop_sequences"] = list(params.stop)
    return attributes
