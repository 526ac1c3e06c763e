"""bench/bench_engines.py's helpers: `--compare-env` (the second worker's variables as parsed from
the command line, a malformed item refused with what was given) and the gateway-side time to first
token read back from the access log by the client's request ids (bench/access_log.py). Runs in the
test process."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.access_log import add_gateway_ttft, ttft_by_round
from bench.bench_engines import env_assignments


def test_items_become_variables() -> None:
    parsed = env_assignments("MKL_NUM_THREADS=2, OMP_NUM_THREADS=4")
    assert parsed == {"MKL_NUM_THREADS": "2", "OMP_NUM_THREADS": "4"}
    assert env_assignments("EMPTY=") == {"EMPTY": ""}


@pytest.mark.parametrize("text", ["", "NOVALUE", "=5", "A=1,B"])
def test_a_malformed_item_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=VALUE"):
        env_assignments(text)


LOG = """\
2026-11-26 22:46:45,248 INFO gateway.access: POST /v1/completions 200 2310.1ms tokens=151+128 ttft=24.5ms \
finish=length client=127.0.0.1 [request_id=bench-m-1s-3-0 model=m worker=m#0]
2026-11-26 22:46:47,248 INFO gateway.access: POST /v1/completions 200 2310.1ms tokens=151+128 ttft=20.5ms \
finish=length client=127.0.0.1 [request_id=bench-m-env-1s-4-0 model=m-env worker=m-env#0]
2026-11-26 22:46:49,248 INFO gateway.access: POST /v1/completions 200 2310.1ms tokens=151+128 ttft=30.0ms \
finish=length client=127.0.0.1 [request_id=bench-m-2s-5-0 model=m worker=m#0]
2026-11-26 22:46:49,249 INFO gateway.access: POST /v1/completions 200 2310.1ms tokens=151+128 ttft=34.0ms \
finish=length client=127.0.0.1 [request_id=bench-m-2s-5-1 model=m worker=m#0]
2026-11-26 22:46:49,250 INFO gateway.access: POST /v1/completions 200 1.1ms tokens=3+0 \
finish=length client=127.0.0.1 [request_id=other model=m worker=m#0]
"""


def test_the_access_log_gives_each_rounds_ttft(tmp_path: Path) -> None:
    assert ttft_by_round(LOG) == {
        "bench-m-1s-3": [24.5],
        "bench-m-env-1s-4": [20.5],
        "bench-m-2s-5": [30.0, 34.0],
    }
    log = tmp_path / "gateway.log"
    log.write_text(LOG)
    rows = [
        {"round_ids": ["bench-m-1s-3"]},
        {"round_ids": ["bench-m-2s-5"]},
        {"round_ids": ["bench-x-1s-9"]},
        {},
    ]
    add_gateway_ttft(rows, log)
    assert [row.get("gateway_ttft_ms_p50") for row in rows] == [24.5, 32.0, None, None]
