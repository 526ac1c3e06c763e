"""Tracing end to end: a real gateway and its real CPU worker export their spans over OTLP/HTTP to a
receiver that this test runs, and one request's spans form one trace across the two processes.

Runs in the pytest process. The receiver is a plain HTTP server on loopback that accepts POST
/v1/traces and decodes each body with opentelemetry-proto's ExportTraceServiceRequest, as a
collector would. The gateway's batch processor is told to export every 50 ms, so a test waits for
the spans to arrive (wait_until), never for a fixed time.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan

from gateway.demo.embedding_model import make_demo_embedding_model
from tests.harness import GatewayProcess, wait_until
from tests.integration.conftest import demo_entry, write_registry


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    events: list[str]


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, which) if which is not None else None


class OtlpReceiver:
    """A minimal OTLP/HTTP trace receiver (protobuf bodies) on a free loopback port."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the http.server API)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._add(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="otlp-receiver", daemon=True)

    def _add(self, request: ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service=resource.get("service.name", ""),
                            name=span.name,
                            kind=span.kind,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            events=[e.name for e in span.events],
                        )
                    )
        with self._lock:
            self.spans.extend(received)

    def find(self, **attributes: Any) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if all(s.attributes.get(k) == v for k, v in attributes.items())]

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_embedding_model(tmp_path_factory.mktemp("models") / "demo-embed", seed=2)


@pytest.fixture(scope="module")
def traced_gateway(
    tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path, embed_dir: Path, receiver: OtlpReceiver
) -> Iterator[GatewayProcess]:
    config = write_registry(
        tmp_path_factory.mktemp("traced") / "models.yaml",
        [
            demo_entry("demo-small", demo_model_dir, aliases=["small"]),
            demo_entry("demo-embed", embed_dir, task="embed", max_seq_len=512),
        ],
    )
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url + "/v1/traces",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    with GatewayProcess(config, env=env) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def client(traced_gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=traced_gateway.url + "/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def request_trace(
    receiver: OtlpReceiver, gateway: GatewayProcess, **attributes: Any
) -> tuple[ReceivedSpan, ReceivedSpan]:
    """The gateway span whose attributes match, and the worker span in its trace, once both arrived."""

    def both() -> tuple[ReceivedSpan, ReceivedSpan] | None:
        for top in receiver.find(**attributes):
            if top.service != "llm-gateway":
                continue
            children = [s for s in receiver.spans if s.parent_span_id == top.span_id]
            if children:
                return top, children[0]
        return None

    return wait_until(both, f"the gateway and worker spans of {attributes}", context=gateway.events)


def test_a_chat_completion_is_one_trace_across_gateway_and_worker(
    client: openai.OpenAI, receiver: OtlpReceiver, traced_gateway: GatewayProcess
) -> None:
    reply = client.chat.completions.create(
        model="demo-small", messages=[{"role": "user", "content": "Say hello"}], max_tokens=7, temperature=0
    )
    assert reply.usage is not None
    top, job = request_trace(receiver, traced_gateway, **{"gen_ai.request.max_tokens": 7})

    assert top.name == "chat demo-small" and top.kind == ProtoSpan.SPAN_KIND_SERVER
    assert top.parent_span_id == ""  # no client context: the gateway's span is the trace's root
    expected = {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "demo-small",
        "gen_ai.response.model": "demo-small",
        "gen_ai.request.temperature": 0.0,
        "gen_ai.usage.input_tokens": reply.usage.prompt_tokens,
        "gen_ai.usage.output_tokens": reply.usage.completion_tokens,
        "gen_ai.response.finish_reasons": [reply.choices[0].finish_reason],
        "http.response.status_code": 200,
    }
    assert {k: top.attributes.get(k) for k in expected} == expected
    assert top.attributes["gen_ai.server.time_to_first_token"] > 0
    assert "gen_ai.first_token" in top.events

    # The worker's span: a child of the gateway's, in the same trace, from the other process.
    assert job.service == "llm-gateway-worker" and job.trace_id == top.trace_id
    assert job.name == "chat demo-small" and job.kind == ProtoSpan.SPAN_KIND_INTERNAL
    for key in ("gen_ai.operation.name", "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
                "gen_ai.response.finish_reasons", "gen_ai.request.max_tokens"):  # fmt: skip
        assert job.attributes[key] == top.attributes[key], key
    assert (
        0
        < job.attributes["gen_ai.server.time_to_first_token"]
        <= top.attributes["gen_ai.server.time_to_first_token"]
    )
    # Nothing of the prompt or the answer is exported.
    text = repr(top) + repr(job)
    assert "Say hello" not in text and (reply.choices[0].message.content or "\0") not in text


def test_a_streamed_completion_is_traced_with_the_streams_usage(
    client: openai.OpenAI, receiver: OtlpReceiver, traced_gateway: GatewayProcess
) -> None:
    chunks = list(
        client.completions.create(
            model="demo-small",
            prompt="Once upon a time",
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
    )
    usage = chunks[-1].usage
    assert usage is not None
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    top, job = request_trace(receiver, traced_gateway, **{"gen_ai.request.max_tokens": 9})

    assert top.name == "text_completion demo-small"
    assert top.attributes["gen_ai.operation.name"] == "text_completion"
    assert top.attributes["llm_gateway.stream"] is True
    assert top.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert top.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens == 9
    assert top.attributes["gen_ai.response.finish_reasons"] == finish == ["length"]
    assert job.trace_id == top.trace_id and job.name == "text_completion demo-small"
    assert job.attributes["gen_ai.usage.output_tokens"] == 9


def test_a_client_traceparent_is_the_parent_of_the_gateway_span(
    receiver: OtlpReceiver, traced_gateway: GatewayProcess
) -> None:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    response = httpx.post(
        traced_gateway.url + "/v1/chat/completions",
        json={"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    top, job = request_trace(receiver, traced_gateway, **{"gen_ai.request.max_tokens": 5})

    assert (top.trace_id, top.parent_span_id) == (trace_id, parent_id)
    assert job.trace_id == trace_id and job.parent_span_id == top.span_id
    # The span is named after the model the client asked for; the response names the one that answered.
    assert top.name == "chat small"
    assert (top.attributes["gen_ai.request.model"], top.attributes["gen_ai.response.model"]) == (
        "small",
        "demo-small",
    )
    assert top.attributes["gen_ai.usage.output_tokens"] == response.json()["usage"]["completion_tokens"]


def test_an_embeddings_request_is_traced_in_both_processes(
    client: openai.OpenAI, receiver: OtlpReceiver, traced_gateway: GatewayProcess
) -> None:
    reply = client.embeddings.create(model="demo-embed", input=["one", "two words"], encoding_format="float")
    top, job = request_trace(receiver, traced_gateway, **{"gen_ai.operation.name": "embeddings"})

    assert top.name == "embeddings demo-embed" and job.name == "embeddings demo-embed"
    assert job.trace_id == top.trace_id and job.service == "llm-gateway-worker"
    assert top.attributes["gen_ai.usage.input_tokens"] == job.attributes["gen_ai.usage.input_tokens"]
    assert top.attributes["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens
    assert top.attributes["gen_ai.request.encoding_formats"] == ["float"]
    assert "gen_ai.usage.output_tokens" not in top.attributes
