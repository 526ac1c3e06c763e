"""bench/bench_sse_floor.py: the bare app it measures, served as it serves it (a process of its own,
real HTTP, the benchmark's own client), with the first chunk written at once or at the next step,
by one Hypercorn process or by several on one socket. Runs in the test process, with the server's
processes as children."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.bench_sse_floor import hypercorn_processes, known_server, start_server
from bench.streams import http_round

STEP_MS = 2000.0  # far longer than a request takes to be admitted on any machine


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


@pytest.mark.parametrize(("server", "processes"), [("hypercorn", 1), ("hypercorn:2", 2)])
def test_the_first_chunk_comes_at_once_from_every_process(server: str, processes: int) -> None:
    process, url = start_server(server, STEP_MS, first_at_once=True)
    try:
        if processes > 1:  # the workers beside the parent that holds the socket
            assert len(children(process.pid)) >= processes
        done = http_round(url, "floor", [f"stream {i}" for i in range(4)], 1, None)
        assert [s.tokens for s in done.streams] == [1, 1, 1, 1]
        assert max(s.ttft for s in done.streams) < STEP_MS / 1000 / 2
    finally:
        process.terminate()
        process.wait(10)


def test_without_it_every_token_waits_for_a_step() -> None:
    process, url = start_server("hypercorn", 300.0, first_at_once=False)
    try:
        done = http_round(url, "floor", ["one"], 2, None)
        assert done.streams[0].tokens == 2
        assert done.streams[0].gaps[0] > 0.2  # the second token came a whole step after the first
    finally:
        process.terminate()
        process.wait(10)


def test_server_names() -> None:
    assert hypercorn_processes("hypercorn") == 1 and hypercorn_processes("hypercorn:4") == 4
    assert known_server("uvicorn") and known_server("hypercorn:3")
    for bad in ("hypercorn:0", "hypercorn:x", "uvicorn:2", "nginx"):
        assert not known_server(bad)
