"""Prometheus metrics: request counters and latency histograms, and worker gauges read at scrape time.

Runs in the gateway process, on its asyncio loop. Owns one `CollectorRegistry` per app (never the
module-global default, so two apps in one process do not clash), the per-request
`RequestRecorder` that the OpenAI routes feed (one histogram observe per output chunk, nothing
per token), and `WorkerCollector`, which turns router and supervisor state into gauges only when
/metrics is scraped. Worker figures arrive with heartbeats; there are no multiprocess files.

Worker gauges come from each heartbeat's typed EngineStats (wire.stats), the same shape for every
engine: GPU memory per device, KV cache usage, jobs per generator step, active and queued jobs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from quart import Response, current_app, g, request

from gateway.errors import ClientClosed
from wire.results import JobOutput
from wire.states import WorkerState

if TYPE_CHECKING:
    from gateway.core import Gateway

CLIENT_CLOSED = ClientClosed.status  # nginx's 499: the client went away before the response was complete

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)


class GatewayMetrics:
    def __init__(self, gateway: Gateway) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "gateway_requests",
            "Requests by model, endpoint and final status.",
            ["model", "endpoint", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "gateway_time_to_first_token_seconds",
            "Request start to first generated output.",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "gateway_inter_token_latency_seconds",
            "Gap between consecutive output chunks of a request.",
            ["model"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "gateway_request_duration_seconds",
            "Request start to last byte (or failure).",
            ["model"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "gateway_prompt_tokens", "Prompt tokens processed.", ["model"], registry=r
        )
        self.completion_tokens = Counter(
            "gateway_completion_tokens", "Completion tokens generated.", ["model"], registry=r
        )
        r.register(WorkerCollector(gateway))

    def render(self) -> Response:
        return Response(generate_latest(self.registry), content_type=CONTENT_TYPE_LATEST)


class RequestRecorder:
    """One generation request's figures; `finish` counts it exactly once, whatever way it ends."""

    __slots__ = ("metrics", "model", "endpoint", "started", "last_output", "finished", "_ttft", "_itl")

    def __init__(self, metrics: GatewayMetrics, model: str, endpoint: str) -> None:
        self.metrics = metrics
        self.model = model
        self.endpoint = endpoint
        self.started = time.perf_counter()
        self.last_output: float | None = None
        self.finished = False
        # Bound once per request: the per-chunk path is then one clock read and one observe.
        self._ttft = metrics.ttft.labels(model)
        self._itl = metrics.itl.labels(model)

    def output(self, item: JobOutput) -> None:
        if not (item.token_ids or item.text):
            return
        now = time.perf_counter()
        if self.last_output is None:
            self._ttft.observe(now - self.started)
        else:
            self._itl.observe(now - self.last_output)
        self.last_output = now

    def finish(self, status: int, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        if self.finished:
            return
        self.finished = True
        metrics, model = self.metrics, self.model
        metrics.requests.labels(model, self.endpoint, str(status)).inc()
        metrics.duration.labels(model).observe(time.perf_counter() - self.started)
        if prompt_tokens:
            metrics.prompt_tokens.labels(model).inc(prompt_tokens)
        if completion_tokens:
            metrics.completion_tokens.labels(model).inc(completion_tokens)


def _endpoint() -> str:
    # The matched rule, not the raw path: label values must stay few whatever clients send.
    return request.url_rule.rule if request.url_rule is not None else "unmatched"


def start_request(model: str) -> RequestRecorder:
    """A recorder for the current request (`model` is the canonical name, never client text)."""
    recorder = RequestRecorder(current_app.extensions["metrics"], model, _endpoint())
    g.request_recorder = recorder
    return recorder


async def count_response(response: Response) -> Response:
    """after_request: count /v1 requests that ended before a recorder existed (auth, 400, 404)."""
    recorder: RequestRecorder | None = g.get("request_recorder")
    if recorder is None:
        if request.path.startswith("/v1/"):
            current_app.extensions["metrics"].requests.labels(
                "", _endpoint(), str(response.status_code)
            ).inc()
    elif response.mimetype != "text/event-stream":
        recorder.finish(response.status_code)  # a no-op when the route already counted it
    return response


# ---- gauges at scrape time ----------------------------------------------------------------------


class WorkerCollector:
    """Reads supervisor and router state when scraped; the request path pays nothing for these."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def collect(self) -> Iterator[Metric]:
        gateway = self.gateway
        queue = GaugeMetricFamily(
            "gateway_queue_depth", "Requests waiting in the gateway for a slot.", labels=["model"]
        )
        for name, route in gateway.router.routes.items():
            queue.add_metric([name], route.waiting)
        yield queue
        pair = ["model", "worker"]
        up = GaugeMetricFamily("gateway_worker_up", "1 if the worker is ready to serve.", labels=pair)
        state = GaugeMetricFamily(
            "gateway_worker_state", "1 for the worker's current state.", labels=[*pair, "state"]
        )
        restarts = CounterMetricFamily("gateway_worker_restarts", "Worker restarts.", labels=pair)
        in_flight = GaugeMetricFamily(
            "gateway_worker_in_flight", "Gateway slots taken on the worker.", labels=pair
        )
        active = GaugeMetricFamily(
            "gateway_active_jobs", "Jobs the engine is running (heartbeat).", labels=pair
        )
        queued = GaugeMetricFamily("gateway_worker_queued_jobs", "Jobs queued in the engine.", labels=pair)
        memory = GaugeMetricFamily(
            "gateway_worker_gpu_memory_used_bytes", "GPU memory in use (heartbeat).", labels=[*pair, "device"]
        )
        kv = GaugeMetricFamily("gateway_kv_cache_usage_ratio", "Share of the KV cache in use.", labels=pair)
        per_step = GaugeMetricFamily("gateway_jobs_per_step", "Active jobs per generator step.", labels=pair)
        for worker in gateway.supervisor.workers.values():
            labels = [worker.model.name, worker.id]
            up.add_metric(labels, 1.0 if worker.ready else 0.0)
            for each in WorkerState:
                state.add_metric([*labels, each.value], 1.0 if worker.state is each else 0.0)
            restarts.add_metric(labels, worker.restarts)
            in_flight.add_metric(labels, worker.in_flight)
            stats = worker.stats
            active.add_metric(labels, stats.active_jobs)
            queued.add_metric(labels, stats.queued_jobs)
            for device, used in stats.gpu_memory_used_bytes.items():
                memory.add_metric([*labels, device], used)
            if worker.info is not None:  # figures of a worker whose engine has loaded
                kv.add_metric(labels, stats.kv_cache_usage_ratio)
                per_step.add_metric(labels, stats.jobs_per_step)
        yield from (up, state, restarts, in_flight, active, queued)
        # Families with no sample (no engine reports them here) are left out rather than empty.
        yield from (family for family in (memory, kv, per_step) if family.samples)
