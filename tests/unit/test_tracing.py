"""Tracing's switch and bookkeeping, without a gateway process: off by default (nothing created, the
SDK never imported), which OTEL_* settings turn it on, the trace context field of Generate, the
worker's job spans, and a request owner's span over the real worker link with scripted workers
(tests.unit.test_request_owner's rig), all over the SDK's in-memory exporter.

Runs in the pytest process (and, for the import check, in a fresh interpreter it starts).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.errors import RequestTimeout
from gateway.observability import tracing as gateway_tracing
from gateway.observability.metrics import RequestRecorder
from gateway.serving.outputs import ChoiceInput
from model_worker.tracing import JobSpans
from tests.harness import REPO_ROOT
from tests.unit.test_request_owner import consume, output, rig
from wire import messages as wire
from wire.codec import ProtocolError, to_plain
from wire.params import ChatMessage, SamplingParams
from wire.results import FinishReason, JobOutput, Usage
from wire.trace_context import tracing_requested

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(
    ("environ", "exporter"),
    [
        ({}, None),  # off by default, unlike the SDK's own default
        ({"OTEL_SERVICE_NAME": "gw"}, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, "otlp"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, "otlp"),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, "otlp"),
        ({"OTEL_TRACES_EXPORTER": "console"}, "console"),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, None),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, None),
    ],
)
def test_the_otel_variables_decide_whether_to_trace(environ: dict[str, str], exporter: str | None) -> None:
    assert tracing_requested(environ) == exporter


def test_an_exporter_this_project_does_not_ship_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="zipkin"):
        tracing_requested({"OTEL_TRACES_EXPORTER": "zipkin"})


def test_a_transport_this_project_does_not_ship_is_a_config_error() -> None:
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL='grpc'"):
        tracing_requested({**endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    with pytest.raises(ValueError, match="only http/protobuf"):
        tracing_requested({**endpoint, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})
    assert tracing_requested({**endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) == "otlp"
    # Tracing off: the protocol is never used, so it is not judged.
    assert tracing_requested({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) is None


def test_tracing_off_creates_nothing_and_loads_no_sdk() -> None:
    """A fresh interpreter without OTEL_* variables: both processes' tracing stays off, a request
    gets no span, a worker no job spans, and the SDK and exporter modules are never imported."""
    script = textwrap.dedent(
        """
        import asyncio, os, sys
        for name in [n for n in os.environ if n.startswith("OTEL_")]:
            del os.environ[name]
        from gateway.observability import tracing as gateway_tracing
        from model_worker import tracing as worker_tracing
        import gateway.http.serving_path, model_worker.jobs
        from wire.params import SamplingParams
        assert gateway_tracing.start() is False and gateway_tracing.ENABLED is False
        assert worker_tracing.start("w#0", "m") is False and worker_tracing.ENABLED is False
        assert gateway_tracing.start_request_span("chat", "m", "m", SamplingParams(), {}, False) is None
        assert worker_tracing.job_spans("m") is None
        gateway_tracing.stop(); worker_tracing.stop()
        sdk = ("opentelemetry.sdk", "opentelemetry.exporter")
        loaded = sorted(m for m in sys.modules if m.startswith(sdk))
        assert not loaded, loaded
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_generate_carries_a_checked_traceparent_and_old_frames_still_decode() -> None:
    params = SamplingParams(max_tokens=4)
    traced = wire.Generate("r", "p", None, None, params, None, TRACEPARENT)
    assert wire.decode(wire.encode(traced)) == traced
    # A frame without the field (protocol 3's Generate) decodes, untraced.
    old = msgpack.packb(["gen", ["r", "p", None, None, to_plain(params), None]])
    assert wire.decode(old).traceparent is None  # type: ignore[attr-defined]
    for bad in ("not-a-traceparent", TRACEPARENT.upper(), TRACEPARENT + "0", 7):
        frame = msgpack.packb(["gen", ["r", "p", None, None, to_plain(params), None, bad]])
        with pytest.raises(ProtocolError, match="Generate.traceparent"):
            wire.decode(frame)


@pytest.fixture
def exported() -> Iterator[tuple[JobSpans, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield JobSpans("demo", provider.get_tracer("test")), exporter
    provider.shutdown()


def test_a_job_span_follows_the_gateway_context_and_records_its_end(
    exported: tuple[JobSpans, InMemorySpanExporter],
) -> None:
    spans, exporter = exported
    messages = [ChatMessage("user", "secret prompt")]
    spans.start(
        wire.Generate(
            "r1", None, None, messages, SamplingParams(max_tokens=3, temperature=0.5), None, TRACEPARENT
        )
    )
    spans.start(
        wire.Generate("r2", "untraced", None, None, SamplingParams(), None, None)
    )  # no context: no span
    spans.accepted("r1", 11)
    spans.outputs([JobOutput("r1", "", [])])  # a prefill step: no token yet
    spans.outputs([JobOutput("r1", "a", [5]), JobOutput("r2", "b", [6])])
    spans.outputs([JobOutput("r1", "b", [6]), JobOutput("r1", "", [], FinishReason.STOP, Usage(11, 2))])
    (span,) = exporter.get_finished_spans()
    assert span.name == "chat demo"
    assert span.context is not None and span.parent is not None
    assert format(span.context.trace_id, "032x") == TRACEPARENT.split("-")[1]
    assert format(span.parent.span_id, "016x") == TRACEPARENT.split("-")[2]
    attributes = dict(span.attributes or {})
    assert attributes["gen_ai.usage.input_tokens"] == 11 and attributes["gen_ai.usage.output_tokens"] == 2
    assert attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert attributes["gen_ai.request.max_tokens"] == 3 and attributes["gen_ai.request.temperature"] == 0.5
    assert attributes["gen_ai.server.time_to_first_token"] > 0
    assert [e.name for e in span.events] == ["gen_ai.first_token"]
    assert "secret prompt" not in repr(attributes)


def test_cancelled_refused_and_aborted_jobs_end_their_spans(
    exported: tuple[JobSpans, InMemorySpanExporter],
) -> None:
    spans, exporter = exported
    for rid in ("cancelled", "refused", "aborted", "left"):
        spans.start(wire.Generate(rid, "p", None, None, SamplingParams(), None, TRACEPARENT))
    spans.cancelled("cancelled")
    spans.rejected("refused", "context_length_exceeded")
    spans.aborted("aborted", "shutdown")
    spans.close()  # the worker exits with a job still open
    spans.cancelled("cancelled")  # a second end is a no-op
    ended = {s.attributes["llm_gateway.job_id"]: s for s in exporter.get_finished_spans() if s.attributes}
    assert set(ended) == {"cancelled", "refused", "aborted", "left"}
    assert {rid: s.attributes["error.type"] for rid, s in ended.items() if s.attributes} == {
        "cancelled": "cancelled",
        "refused": "context_length_exceeded",
        "aborted": "shutdown",
        "left": "worker_exit",
    }
    assert [rid for rid, s in ended.items() if not s.status.is_ok] == ["aborted", "left"]


@pytest.fixture
def gateway_tracer(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """The gateway's tracing switched on, its spans kept in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(gateway_tracing, "_tracer", provider.get_tracer("test"))
    monkeypatch.setattr(gateway_tracing, "ENABLED", True)
    yield exporter
    provider.shutdown()


def test_a_traced_request_sends_its_context_and_its_span_ends_with_the_outcome(
    tmp_path: Path, gateway_tracer: InMemorySpanExporter
) -> None:
    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"traceparent": f"00-{client_trace}-{client_span}-01"}

    async def scenario() -> None:
        async with rig(tmp_path) as r:
            params = SamplingParams(max_tokens=8)
            span = gateway_tracing.start_request_span("text_completion", "m", "m", params, headers, True)
            recorder = RequestRecorder(r.metrics, "m", "/v1/completions")
            loop = asyncio.get_running_loop()
            owner = r.service.open(
                r.route, [ChoiceInput(prompt="hi")], params, loop.time() + 10, recorder, True, None, span
            )
            handler = asyncio.create_task(consume(owner))
            (generate,) = await r.peers["w0"].generates(1, accept=True)
            assert span is not None and generate.traceparent == span.traceparent
            await r.peers["w0"].send(wire.Step([output(generate.rid, "a", FinishReason.STOP)]))
            await asyncio.wait_for(handler, 2)

    asyncio.run(scenario())
    (span,) = gateway_tracer.get_finished_spans()
    assert span.name == "text_completion m" and span.parent is not None and span.context is not None
    assert format(span.context.trace_id, "032x") == client_trace
    assert format(span.parent.span_id, "016x") == client_span
    attributes = dict(span.attributes or {})
    assert attributes["gen_ai.usage.input_tokens"] == 3 and attributes["gen_ai.usage.output_tokens"] == 2
    assert attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert attributes["http.response.status_code"] == 200 and "error.type" not in attributes


def test_a_traced_request_that_times_out_says_so_on_its_span(
    tmp_path: Path, gateway_tracer: InMemorySpanExporter
) -> None:
    async def scenario() -> None:
        async with rig(tmp_path) as r:
            params = SamplingParams(max_tokens=8)
            span = gateway_tracing.start_request_span("chat", "m", "m", params, {}, False)
            recorder = RequestRecorder(r.metrics, "m", "/v1/chat/completions")
            loop = asyncio.get_running_loop()
            owner = r.service.open(
                r.route, [ChoiceInput(prompt="hi")], params, loop.time() + 0.3, recorder, False, None, span
            )
            handler = asyncio.create_task(consume(owner))
            await r.peers["w0"].generates(1, accept=True)
            with pytest.raises(RequestTimeout):
                await asyncio.wait_for(handler, 2)

    asyncio.run(scenario())
    (span,) = gateway_tracer.get_finished_spans()
    assert span.parent is None  # no client context: a root span
    attributes = dict(span.attributes or {})
    assert attributes["error.type"] == "request_timeout" and attributes["http.response.status_code"] == 408
    assert span.status.is_ok  # a 4xx is not the server's error
