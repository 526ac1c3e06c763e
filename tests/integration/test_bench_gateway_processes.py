"""bench/gateway_processes.py: N gateways on one port in front of one listening worker, as
bench/bench_engines.py `--gateway-processes` runs them on a GPU host; here with the CPU demo model.

Runs in the pytest process; the worker and the gateways are real processes with real sockets, and
the benchmark's own client (bench/streams.py) drives them.
"""

from __future__ import annotations

from pathlib import Path

from bench.gateway_processes import GatewayProcesses
from bench.streams import http_round
from tests.integration.conftest import demo_entry

STREAMS = 16  # connections all on one of two gateways: a chance of 2 in 2**16


def test_two_gateways_on_one_port_share_a_burst_of_streams(tmp_path: Path, demo_model_dir: Path) -> None:
    entry = demo_entry(
        "procs", demo_model_dir, limits={"max_concurrent_jobs": STREAMS, "max_queued_requests": 64}
    )
    with GatewayProcesses(entry, 2, tmp_path, ready_timeout_s=120) as processes:
        assert len(set(processes.gateway_pids)) == 2
        done = http_round(processes.url, "procs", [f"stream {i}" for i in range(STREAMS)], 4, None)
        assert [s.tokens for s in done.streams] == [4] * STREAMS
        served = [
            log.read_text().count("POST /v1/completions 200")
            for log in sorted(tmp_path.glob("gateway-processes-[0-9].log"))
        ]
        assert sum(served) == STREAMS and min(served) >= 1, served
        gateways = [g.process for g in processes.gateways]
        worker = processes.worker
    assert worker is not None and worker.poll() is not None
    assert all(p is not None and p.poll() is not None for p in gateways)
