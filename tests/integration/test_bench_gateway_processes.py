"""bench/gateway_processes.py: groups of gateways, each group on one port, in front of one listening
worker, as bench/bench_engines.py `--gateway-processes 1,2` runs them on a GPU host; here with the
CPU demo model.

Runs in the pytest process; the worker and the gateways are real processes with real sockets, and
the benchmark's own client (bench/streams.py) drives them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.gateway_processes import GatewayProcesses
from bench.streams import http_round
from tests.harness import REPO_ROOT
from tests.integration.conftest import demo_entry

STREAMS = 16  # connections all on one of two gateways: a chance of 2 in 2**16


def _served(log: Path) -> int:
    return log.read_text().count("POST /v1/completions 200")


def test_each_group_serves_its_port_from_the_one_worker(tmp_path: Path, demo_model_dir: Path) -> None:
    limits = {"max_concurrent_jobs": STREAMS, "max_queued_requests": 64}
    entry = demo_entry("procs", demo_model_dir, limits=limits)
    # An earlier run's keys in the folder (a second run on the same host) are replaced.
    subprocess.run([sys.executable, "-m", "gateway", "keys", str(tmp_path / "keys"), "--name", "gateway"],
                   check=True, cwd=REPO_ROOT, capture_output=True)  # fmt: skip
    with GatewayProcesses(entry, [1, 2], tmp_path, ready_timeout_s=120) as processes:
        assert len(processes.pids(1)) == 1 and len(set(processes.pids(2))) == 2
        assert processes.url(1) != processes.url(2)
        prompts = [f"stream {i}" for i in range(STREAMS)]
        for size in (1, 2):
            done = http_round(processes.url(size), "procs", prompts, 4, None)
            assert [s.tokens for s in done.streams] == [4] * STREAMS
        # The lone gateway served its round; the pair shared theirs.
        assert _served(tmp_path / "gateway-processes-1-0.log") == STREAMS
        pair = [_served(tmp_path / f"gateway-processes-2-{i}.log") for i in range(2)]
        assert sum(pair) == STREAMS and min(pair) >= 1, pair
        gateways = [g.process for g in processes.gateways]
        worker = processes.worker
    assert worker is not None and worker.poll() is not None
    assert len(gateways) == 3 and all(p is not None and p.poll() is not None for p in gateways)
