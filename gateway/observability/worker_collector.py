"""Gauges read at scrape time from the gateway's state: its queues and every worker it knows.

Runs in the gateway process, inside the scrape of /metrics. Owns `WorkerCollector`, which the app
registers in its metrics registry (gateway.observability.metrics): it reads the router and the
supervisor when scraped, so the request path pays nothing for these.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from wire.states import WorkerState

if TYPE_CHECKING:
    from gateway.core import Gateway
    from gateway.link.handle import WorkerHandle


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
        admitting = GaugeMetricFamily(
            "gateway_requests_admitting",
            "Requests begun and not yet sent to a worker (each Generate tells an idle worker of them).",
        )
        admitting.add_metric([], gateway.service.admissions.total)
        yield admitting
        pair = ["model", "replica"]
        up = GaugeMetricFamily("gateway_worker_up", "1 if the worker is ready to serve.", labels=pair)
        state = GaugeMetricFamily(
            "gateway_worker_state", "1 for the worker's state, 0 for the others.", labels=[*pair, "state"]
        )
        restarts = CounterMetricFamily("gateway_worker_restarts", "Worker restarts.", labels=pair)
        in_flight = GaugeMetricFamily(
            "gateway_worker_in_flight", "Gateway slots taken on the worker.", labels=pair
        )
        active = GaugeMetricFamily(
            "gateway_active_jobs", "Jobs the engine is running (heartbeat).", labels=pair
        )
        queued = GaugeMetricFamily("gateway_worker_queued_jobs", "Jobs queued in the engine.", labels=pair)
        load = GaugeMetricFamily(
            "gateway_model_load_duration_seconds",
            "The worker's last start: loading the weights (phase=load), then warming up (phase=warmup).",
            labels=[*pair, "phase"],
        )
        memory = GaugeMetricFamily(
            "gateway_worker_gpu_memory_used_bytes", "GPU memory in use (heartbeat).", labels=[*pair, "device"]
        )
        kv = GaugeMetricFamily("gateway_kv_cache_usage_ratio", "Share of the KV cache in use.", labels=pair)
        per_step = GaugeMetricFamily("gateway_jobs_per_step", "Active jobs per generator step.", labels=pair)
        for worker in _one_per_series(gateway.supervisor.workers.values()):
            labels = [worker.model.name, replica_label(worker)]
            up.add_metric(labels, 1.0 if worker.ready else 0.0)
            for each in WorkerState:
                state.add_metric([*labels, each.value], 1.0 if worker.state is each else 0.0)
            restarts.add_metric(labels, worker.restarts)
            in_flight.add_metric(labels, worker.in_flight)
            stats = worker.stats
            active.add_metric(labels, stats.active_jobs)
            queued.add_metric(labels, stats.queued_jobs)
            if worker.ready_message is not None:
                load.add_metric([*labels, "load"], worker.ready_message.load_s)
                load.add_metric([*labels, "warmup"], worker.ready_message.warmup_s)
            for device, used in stats.gpu_memory_used_bytes.items():
                memory.add_metric([*labels, device], used)
            if worker.info is not None:  # figures of a worker whose engine has loaded
                kv.add_metric(labels, stats.kv_cache_usage_ratio)
                per_step.add_metric(labels, stats.jobs_per_step)
        yield from (up, state, restarts, in_flight, active, queued)
        # Families with no sample (no engine reports them here) are left out rather than empty.
        yield from (family for family in (load, memory, kv, per_step) if family.samples)


def replica_label(worker: WorkerHandle) -> str:
    """Stable across restarts and reloads: the replica's index, or a remote worker's own name."""
    if worker.remote and "@" in worker.id:
        return worker.id.split("@", 1)[1]
    return str(worker.replica)


def _one_per_series(workers: Any) -> list[WorkerHandle]:
    """During a reload a retiring worker and its successor share a series: the successor wins."""
    chosen: dict[tuple[str, str], WorkerHandle] = {}
    for worker in workers:
        key = (worker.model.name, replica_label(worker))
        if key not in chosen or chosen[key].retiring:
            chosen[key] = worker
    return list(chosen.values())
