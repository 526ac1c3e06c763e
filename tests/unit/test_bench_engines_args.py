"""bench/bench_engines.py's `--compare-env`: the second worker's variables as parsed from the
command line, and a malformed item refused with what was given. Runs in the test process."""

from __future__ import annotations

import argparse

import pytest

from bench.bench_engines import env_assignments


def test_items_become_variables() -> None:
    parsed = env_assignments("GATEWAY_WORKER_SWITCH_INTERVAL_MS=5, OMP_NUM_THREADS=4")
    assert parsed == {"GATEWAY_WORKER_SWITCH_INTERVAL_MS": "5", "OMP_NUM_THREADS": "4"}
    assert env_assignments("EMPTY=") == {"EMPTY": ""}


@pytest.mark.parametrize("text", ["", "NOVALUE", "=5", "A=1,B"])
def test_a_malformed_item_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=VALUE"):
        env_assignments(text)
