"""Malformed, oversized and pickled frames are dropped and logged; worker and gateway keep serving."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import msgpack
import zmq

from tests.harness import REPO_ROOT, GatewayProcess, wait_until
from tests.integration.conftest import demo_entry, write_registry
from wire import messages as wire
from wire.codec import MAX_FRAME_BYTES
from wire.params import SamplingParams
from wire.results import JobOutput

BAD_FRAMES = [
    b"",
    b"\xc1\xc1not msgpack",
    pickle.dumps(wire.Cancel("x")),
    pickle.dumps(os.system),  # would run code if anyone unpickled it
    msgpack.packb(["gen", ["rid-only"]]),
    msgpack.packb(["gen", ["r", None, None, None, {"max_tokens": "many"}]]),
    msgpack.packb(["step", [[]]]),  # a worker-bound socket never accepts worker messages
    msgpack.packb({"type": "generate"}),
]


def recv(sock: zmq.Socket, timeout_s: float = 60) -> tuple[bytes, wire.Message]:
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError("no frame from the worker")
    identity, frame = sock.recv_multipart()
    return identity, wire.decode(frame)


def test_worker_drops_bad_frames_and_keeps_serving(tmp_path: Path, demo_model_dir: Path) -> None:
    endpoint = f"ipc://{tmp_path}/w.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    spec = {
        "name": "m",
        "engine": "transformers",
        "path": str(demo_model_dir),
        "max_seq_len": 512,
        "engine_settings": {"threads": 1},
        "heartbeat_interval_s": 0.2,
    }
    cmd = [
        sys.executable,
        "-m",
        "model_worker",
        "--connect",
        endpoint,
        "--worker-id",
        "w1",
        "--spec",
        json.dumps(spec),
    ]
    log = open(tmp_path / "worker.log", "wb")
    worker = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            identity, message = recv(router)
            if isinstance(message, wire.Ready):
                break
        for frame in [*BAD_FRAMES, b"\x00" * (MAX_FRAME_BYTES + 10)]:
            router.send_multipart([identity, frame])
        # The oversized frame is under the socket's own limit (MAX_SOCKET_MESSAGE_BYTES), so the
        # connection stays and the codec drops it. Frames of one connection arrive in order: the
        # worker reads the good Generate after every bad frame, with no pause needed.
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        router.send_multipart([identity, wire.encode(wire.Generate("good", "hello", None, None, params))])
        finish = None
        while finish is None:
            _, message = recv(router, 10)
            if isinstance(message, wire.Step):
                finish = next((o.finish_reason for o in message.outputs if o.rid == "good"), None)
        assert finish == "length"
        assert worker.poll() is None
        log.flush()
        text = (tmp_path / "worker.log").read_text()
        assert text.count("dropped") >= len(BAD_FRAMES) - 1
    finally:
        worker.terminate()
        worker.wait(10)
        router.close(0)
        ctx.term()
        log.close()


def test_gateway_drops_bad_frames_from_rogue_peers(tmp_path: Path, demo_model_dir: Path) -> None:
    runtime = tmp_path / "rt"
    config = write_registry(
        tmp_path / "models.yaml", [demo_entry("m", demo_model_dir)], runtime_dir=str(runtime)
    )
    with GatewayProcess(config) as gateway:
        assert oct(runtime.stat().st_mode & 0o777) == "0o700"
        ctx = zmq.Context()
        rogue = ctx.socket(zmq.DEALER)
        # (A peer claiming the real worker's identity is ignored by ZeroMQ's ROUTER outright.)
        rogue.setsockopt(zmq.IDENTITY, b"rogue")
        rogue.connect(f"ipc://{runtime}/workers.sock")
        frames = [
            *BAD_FRAMES,
            wire.encode(wire.Hello(99, "m#0", 1)),
            wire.encode(wire.Step([JobOutput("nobody", "x", [1])])),
        ]
        for frame in frames:
            rogue.send(frame)
        rogue.close(100)
        ctx.term()
        refused = "frame from unknown local worker 'rogue' dropped"
        wait_until(
            lambda: refused in gateway.log(), "the rogue's frames to be refused", context=gateway.events
        )
        import httpx

        reply = httpx.post(
            gateway.url + "/v1/completions",
            json={"model": "m", "prompt": "still fine", "max_tokens": 3},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
        log = gateway.log()
        # An id the supervisor did not spawn is refused before its frames are even decoded, and the
        # refusal is logged once per interval, not once per frame.
        assert log.count(refused) == 1
