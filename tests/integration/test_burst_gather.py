"""An idle worker told that more requests are coming (Generate.following) waits for them before its
first step, so that a burst is prefilled in one step (limits.burst_gather_ms); without it, or with it
set to 0, the first job steps alone.

Runs in the pytest process, playing the gateway over a real socket in front of one real worker
process with the transformers demo model; the worker's step trace says what each step held.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import zmq

from tests.harness import REPO_ROOT, GatewayProcess, wait_until
from tests.integration.conftest import demo_entry, write_registry
from wire import messages as wire
from wire.params import SamplingParams

JSON = {"Content-Type": "application/json"}
PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _next(sock: zmq.Socket, kind: type[wire.Message]) -> tuple[bytes, wire.Message]:
    while True:
        if not sock.poll(60_000):
            raise TimeoutError(f"no {kind.__name__} from the worker")
        identity, frame = sock.recv_multipart()
        message = wire.decode(frame)
        if isinstance(message, kind):
            return identity, message


@pytest.mark.parametrize(
    ("gather_s", "rids", "first_step", "gather_end"),
    [(30.0, ("a", "b"), 2, "told"), (0.2, ("a",), 1, "quiet"), (0.0, ("a", "b"), 1, None)],
    ids=["gathers", "none-came", "off"],
)
def test_an_idle_worker_waits_for_the_requests_its_gateway_said_were_coming(
    tmp_path: Path,
    demo_model_dir: Path,
    gather_s: float,
    rids: tuple[str, ...],
    first_step: int,
    gather_end: str | None,
) -> None:
    trace = tmp_path / "trace.jsonl"
    spec = {"name": "m", "engine": "transformers", "path": str(demo_model_dir), "max_seq_len": 512,
            "engine_settings": {"threads": 1}, "heartbeat_interval_s": 0.5, "burst_gather_s": gather_s,
            "env": {"GATEWAY_STEP_TRACE": str(trace)}}  # fmt: skip
    endpoint = f"ipc://{tmp_path}/w.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    cmd = [sys.executable, "-m", "model_worker", "--connect", endpoint, "--worker-id", "w1",
           "--spec", json.dumps(spec)]  # fmt: skip
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        identity, _ = _next(router, wire.Ready)
        router.send_multipart(
            [identity, wire.encode(wire.Generate("a", "hello", None, None, PARAMS, following=1))]
        )
        # The worker has the first job; the second is sent only now. Without the wait the first
        # step has begun already: the worker read no frame between accepting it and stepping.
        _next(router, wire.Accepted)
        for rid in rids[1:]:
            router.send_multipart([identity, wire.encode(wire.Generate(rid, "hello", None, None, PARAMS))])
        finished: set[str] = set()
        while finished != set(rids):
            _, step = _next(router, wire.Step)
            assert isinstance(step, wire.Step)
            finished |= {o.rid for o in step.outputs if o.finish_reason is not None}
        router.send_multipart([identity, wire.encode(wire.Shutdown(5.0))])  # the trace is written on exit
        assert worker.wait(30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
        router.close(0)
        ctx.term()
    steps = [json.loads(line) for line in wait_until(lambda: trace.read_text().splitlines(), "the trace")]
    assert (steps[0]["jobs"], steps[0]["first"]) == (first_step, first_step), steps
    assert sum(step["first"] for step in steps) == len(rids)
    # The trace says how long the first step waited for the burst, and why it stopped waiting.
    assert steps[0].get("gather_end") == gather_end, steps[0]
    if gather_end == "quiet":  # it waited a quarter of burst_gather_ms for the job that never came
        assert steps[0]["gather_ms"] >= gather_s / 4 * 1000
    assert all("gather_ms" not in step for step in steps[1:])


def _admitting(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    (value,) = re.findall(r"^gateway_requests_admitting (\S+)$", text, re.M)
    return float(value)


def test_every_request_the_gateway_began_stops_counting_however_it_ends(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """Each Generate says how many requests are still being admitted: one that never stopped counting
    would make every idle worker wait for nothing. Sent, refused, failed, not a generation, or its
    client gone midway: each ends its admission."""
    config = write_registry(tmp_path / "models.yaml", [demo_entry("m", demo_model_dir)])
    with GatewayProcess(config) as gw:
        completion = {"model": "m", "prompt": "hello", "max_tokens": 2}
        with httpx.Client(base_url=gw.url, timeout=60) as client:
            assert client.post("/v1/completions", json=completion).status_code == 200
            assert client.post("/v1/completions", json={**completion, "n": 0}).status_code == 400
            assert client.post("/v1/completions", json={**completion, "model": "nope"}).status_code == 404
            assert client.post("/v1/completions", content=b"{not json", headers=JSON).status_code == 400
            assert client.post("/tokenize", json={"model": "m", "prompt": "hello"}).status_code == 200
            with client.stream(
                "POST",
                "/v1/completions",
                json={**completion, "stream": True, "max_tokens": 200, "ignore_eos": True},
            ) as stream:
                next(stream.iter_lines())  # then leaves with the stream running
        with socket.create_connection(("127.0.0.1", gw.port)) as half_sent:  # leaves before its body is in
            head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            half_sent.sendall(head + b'Content-Length: 400\r\n\r\n{"model": ')
            wait_until(lambda: _admitting(gw.url) == 1, "the half-sent request to be counted")
        wait_until(lambda: _admitting(gw.url) == 0, "every admission to end", timeout=30)
