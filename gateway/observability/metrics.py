"""Prometheus metrics: request counters and latency histograms, and worker gauges read at scrape time.

Runs in the gateway process, on its asyncio loop. Owns one `CollectorRegistry` per app (never the
module-global default, so two apps in one process do not clash), the per-request
`RequestRecorder` that the OpenAI routes feed (one histogram observe per output chunk, nothing
per token). Worker gauges, read from router and supervisor state only when /metrics is scraped,
are gateway.observability.worker_collector's. Worker figures arrive with heartbeats; there are no
multiprocess files.

Worker gauges come from each heartbeat's typed EngineStats (wire.stats), the same shape for every
engine: GPU memory per device, KV cache usage, jobs per generator step, active and queued jobs.
Worker series are labelled `model` and `replica` (the replica's index, or a remote worker's name
after `@`), never the worker id, which changes with each reload: a restarted or reloaded worker
continues its series. `RecentRequests` keeps each model's last few minutes of outcomes and
latencies for the status page.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from quart import Response, current_app, g, request
from werkzeug.exceptions import HTTPException

from gateway.config.api_keys import ANONYMOUS  # the key label of requests without a (valid) key
from gateway.errors import ClientClosed
from gateway.observability.logging_setup import log_context

if TYPE_CHECKING:
    from gateway.serving.outputs import Delta

CLIENT_CLOSED = ClientClosed.status  # nginx's 499: the client went away before the response was complete

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
_PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
RECENT_WINDOW_S = 300.0
RECENT_MAX = 2000  # per model: the window's figures come from at most this many requests


class GatewayMetrics:
    def __init__(self, add_usage: Callable[[str, int], None] | None = None) -> None:
        self.registry = CollectorRegistry()
        # Where a finished request's tokens go for its key's budget (gateway.cluster.counters).
        self.add_usage = add_usage if add_usage is not None else (lambda key, tokens: None)
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
        self.cached_prompt_tokens = Counter(
            "gateway_prompt_tokens_cached",
            "Prompt tokens the engine found in its prefix cache instead of computing them (a part of "
            "gateway_prompt_tokens; as the usage's prompt_tokens_details.cached_tokens).",
            ["model"],
            registry=r,
        )
        self.queue_time = Histogram(
            "gateway_request_queue_time_seconds",
            "Request start until every choice was accepted by a worker: waiting in the gateway's queue "
            "for a slot (and for a model to load), then the hand-off.",
            ["model"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.engine_queue_time = Histogram(
            "gateway_engine_queue_time_seconds",
            "Time a finished job waited in the engine before its prefill (worker-reported).",
            ["model"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram(
            "gateway_request_prefill_time_seconds",
            "Prefill time of a finished job (worker-reported).",
            ["model"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.decode_time = Histogram(
            "gateway_request_decode_time_seconds",
            "Decode time of a finished job: first to last token (worker-reported).",
            ["model"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        # Per API key (its configured name, never the secret): few series, one per key and model.
        self.key_requests = Counter(
            "gateway_key_requests",
            "Requests by API key name, model and final status.",
            ["key", "model", "status"],
            registry=r,
        )
        self.key_tokens = Counter(
            "gateway_key_tokens",
            "Tokens by API key name and model; kind is prompt or completion.",
            ["key", "model", "kind"],
            registry=r,
        )
        self.fallbacks = Counter(
            "gateway_fallbacks",
            "Requests a fallback model answered, by the model asked for, the one that answered and why "
            "(queue_full, no_ready_worker).",
            ["model", "fallback", "reason"],
            registry=r,
        )
        self.recent = RecentRequests()
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        # process_cpu_seconds_total, process_resident_memory_bytes, open fds...: the gateway process.
        ProcessCollector(registry=r)

    def child(self, metric: Counter | Histogram, *values: str) -> Any:
        """`metric.labels(*values)`, looked up once: prometheus_client checks the values and takes a
        lock on every labels() call (about 1.5 µs), and a request makes thirteen of them. No series
        is ever removed here, so the child found once stays the one the registry exports; the label
        values are the same few (canonical model names, routes, statuses, key names) either way."""
        key = (metric, values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def render(self) -> Response:
        return Response(generate_latest(self.registry), content_type=CONTENT_TYPE_LATEST)


class RequestRecorder:
    """One generation request's figures; `finish` counts it exactly once, whatever way it ends. The
    access log line reads the same figures (status, tokens, time to first token, finish reason)."""

    __slots__ = (
        "metrics", "model", "endpoint", "key", "started", "last_output", "finished", "status", "ttft_s",
        "finish_reasons", "prompt_tokens", "completion_tokens", "was_admitted", "_ttft", "_itl",
    )  # fmt: skip

    def __init__(self, metrics: GatewayMetrics, model: str, endpoint: str, key: str = ANONYMOUS) -> None:
        self.metrics = metrics
        self.model = model
        self.endpoint = endpoint
        self.key = key
        self.started = time.perf_counter()
        self.last_output: float | None = None
        self.finished = False
        self.status: int | None = None
        self.ttft_s: float | None = None
        self.finish_reasons: list[str] = []
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.was_admitted = False
        # Bound once per request: the per-chunk path is then one clock read and one observe.
        self._ttft = metrics.child(metrics.ttft, model)
        self._itl = metrics.child(metrics.itl, model)

    def admitted(self) -> None:
        """Every choice was accepted by a worker: the request's queue time ends here."""
        self.was_admitted = True
        metrics = self.metrics
        metrics.child(metrics.queue_time, self.model).observe(time.perf_counter() - self.started)

    def output(self, item: Delta) -> None:
        if item.finish_reason is not None:
            self.finish_reasons.append(item.finish_reason.value)
            if item.usage is not None:  # a choice's last output: its (last job's) engine-side phases
                metrics, usage, model = self.metrics, item.usage, self.model
                metrics.child(metrics.engine_queue_time, model).observe(usage.queue_s)
                metrics.child(metrics.prefill_time, model).observe(usage.prefill_s)
                metrics.child(metrics.decode_time, model).observe(usage.decode_s)
        if not (item.token_count or item.text or item.reasoning):
            return
        now = time.perf_counter()
        if self.last_output is None:
            self.ttft_s = now - self.started
            self._ttft.observe(self.ttft_s)
        else:
            self._itl.observe(now - self.last_output)
        self.last_output = now

    def finish(
        self, status: int, prompt_tokens: int = 0, completion_tokens: int = 0, cached_tokens: int = 0
    ) -> None:
        if self.finished:
            return
        self.finished = True
        self.status = status
        if status >= 400 and not self.was_admitted:
            # Refused before every choice was admitted (one prompt of several too long, a full
            # queue, a client gone while waiting): jobs some choices had started were cancelled
            # and the client got no output and no usage, so its key is charged nothing.
            prompt_tokens = completion_tokens = cached_tokens = 0
        self.prompt_tokens, self.completion_tokens = prompt_tokens, completion_tokens
        metrics, model = self.metrics, self.model
        duration = time.perf_counter() - self.started
        child, code = metrics.child, str(status)
        child(metrics.requests, model, self.endpoint, code).inc()
        child(metrics.key_requests, self.key, model, code).inc()
        child(metrics.duration, model).observe(duration)
        metrics.recent.add(model, status, duration, self.ttft_s)
        if prompt_tokens:
            child(metrics.prompt_tokens, model).inc(prompt_tokens)
            # Counted (as 0 too) wherever prompt tokens are, so cached ÷ prompt is defined per model.
            child(metrics.cached_prompt_tokens, model).inc(cached_tokens)
            child(metrics.key_tokens, self.key, model, "prompt").inc(prompt_tokens)
        if completion_tokens:
            child(metrics.completion_tokens, model).inc(completion_tokens)
            child(metrics.key_tokens, self.key, model, "completion").inc(completion_tokens)
        metrics.add_usage(self.key, prompt_tokens + completion_tokens)


class RecentRequests:
    """Each model's requests of the last RECENT_WINDOW_S: error rate and latency for the status page."""

    def __init__(self) -> None:
        # model -> (finished at, status, duration s, time to first token s or None)
        self._entries: dict[str, deque[tuple[float, int, float, float | None]]] = {}

    def add(self, model: str, status: int, duration_s: float, ttft_s: float | None) -> None:
        entries = self._entries.setdefault(model, deque(maxlen=RECENT_MAX))
        entries.append((time.monotonic(), status, duration_s, ttft_s))

    def summary(self, model: str) -> dict[str, Any]:
        cutoff = time.monotonic() - RECENT_WINDOW_S
        entries = [e for e in self._entries.get(model, ()) if e[0] >= cutoff]
        durations = sorted(e[2] for e in entries)
        ttfts = sorted(e[3] for e in entries if e[3] is not None)
        errors = sum(1 for e in entries if e[1] >= 500)
        client_errors = sum(1 for e in entries if 400 <= e[1] < 500)
        return {
            "window_s": RECENT_WINDOW_S,
            "count": len(entries),
            "server_errors": errors,
            "client_errors": client_errors,
            "error_rate": round(errors / len(entries), 4) if entries else None,
            "duration_p50_ms": _percentile_ms(durations, 0.5),
            "duration_p95_ms": _percentile_ms(durations, 0.95),
            "ttft_p50_ms": _percentile_ms(ttfts, 0.5),
            "ttft_p95_ms": _percentile_ms(ttfts, 0.95),
        }


def _percentile_ms(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return round(ordered[min(int(q * len(ordered)), len(ordered) - 1)] * 1000.0, 1)


def _key_name() -> str:
    key = g.get("api_key")
    return key.name if key is not None else ANONYMOUS


def _endpoint() -> str:
    # The matched rule, not the raw path: label values must stay few whatever clients send.
    return request.url_rule.rule if request.url_rule is not None else "unmatched"


def count_fallback(model: str, fallback: str, reason: str) -> None:
    """The current request goes to `fallback` instead of `model` (both canonical names)."""
    current_app.extensions["metrics"].fallbacks.labels(model, fallback, reason).inc()
    g.fallback_from = (model, reason)


def start_request(model: str) -> RequestRecorder:
    """A recorder for the current request (`model` is the canonical name, never client text)."""
    recorder = RequestRecorder(current_app.extensions["metrics"], model, _endpoint(), _key_name())
    g.request_recorder = recorder
    return recorder


async def _model_label(status: int) -> str:
    """The canonical name of the model the request was about, once its route resolved it; before
    that, for a 400 or a key's 429 (rate limit, budget), the served model it names. "" else: label
    values must stay the few served names, whatever clients send (a 404's name may be anything a
    client typed)."""
    known = log_context().get("model")  # set once the route resolved the model
    if known is not None:
        return known
    if status not in (400, 429):
        return ""
    # Looked up by the key check (gateway.http.auth) before its limits, from the path, the query
    # or the body; without keys there are no such 429s, and a 400's body was read by its validation.
    name = g.get("requested_model")
    if name is None and status == 400 and request.method == "POST":
        try:
            body = await request.get_json(force=True, silent=True)
        except HTTPException:  # a body that cannot be read (too large): no model to name
            return ""
        name = body.get("model") if isinstance(body, dict) else None
    if not isinstance(name, str):
        return ""
    config = current_app.extensions["gateway"].registry.model(name)
    return config.name if config is not None else ""


def _is_api_request() -> bool:
    """/v1 requests, and those on an unprefixed alias of a /v1 route (vLLM's /tokenize beside
    /v1/tokenize): the same API either way, so counted either way."""
    if request.path.startswith("/v1/"):
        return True
    rule = request.url_rule
    if rule is None or rule.endpoint is None:
        return False
    return any(r.rule.startswith("/v1/") for r in current_app.url_map.iter_rules(rule.endpoint))


async def count_response(response: Response) -> Response:
    """after_request: count API requests that ended before a recorder existed (auth, 400, 404, and
    the one-shot routes: tokenize, detokenize, tokenizer_info)."""
    recorder: RequestRecorder | None = g.get("request_recorder")
    if recorder is None:
        if _is_api_request():
            status = str(response.status_code)
            model = await _model_label(response.status_code)
            metrics = current_app.extensions["metrics"]
            metrics.requests.labels(model, _endpoint(), status).inc()
            metrics.key_requests.labels(_key_name(), model, status).inc()
    elif response.mimetype != "text/event-stream":
        recorder.finish(response.status_code)  # a no-op when the route already counted it
    return response
