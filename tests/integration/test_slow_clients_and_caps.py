"""A client that stops reading is dropped and its jobs cancelled; explicit caps give 400s."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.harness import GatewayProcess, wait_until
from tests.integration.conftest import demo_entry, write_registry


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[GatewayProcess]:
    config = write_registry(
        tmp_path_factory.mktemp("slow") / "models.yaml",
        [demo_entry("m", demo_model_dir)],
        write_stall_timeout_s=1.0,
    )
    with GatewayProcess(config) as gw:
        yield gw


def jobs_left(gateway: GatewayProcess) -> int:
    return sum(w["active_jobs"] + w["queued_jobs"] + w["in_flight"] for w in gateway.workers())


def test_stalled_reader_is_dropped_and_its_jobs_cancelled(gateway: GatewayProcess) -> None:
    body = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "never read"}],
            "max_tokens": 2000,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 20,  # ~2.5 kB per chunk: megabytes that nobody reads
            "stream": True,
        }
    ).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills fast
    client.connect(("127.0.0.1", gateway.port))
    try:
        client.sendall(request)
        wait_until(lambda: jobs_left(gateway) > 0, "the request to start", context=gateway.events)
        # Read nothing. Once the socket buffers are full (or the job is done and its last chunks
        # are stuck), the watchdog must drop us within write_stall_timeout_s (+ a tick).
        wait_until(
            lambda: jobs_left(gateway) == 0 and "client stopped reading" in gateway.log(),
            "the watchdog to drop the client and its job",
            20,
            context=gateway.events,
        )
        client.settimeout(5)
        received = b""
        while chunk := client.recv(65536):  # the gateway closed the connection: recv ends
            received += chunk
        assert received.startswith(b"HTTP/1.1 200")
    finally:
        client.close()
    # Other clients are served as usual.
    reply = httpx.post(gateway.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3})
    assert reply.status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": 10**6}, "max_tokens"),
        ({"prompt": "x", "n": 9}, "n"),
        ({"prompt": "x", "stop": ["s"] * 17}, "stop"),
        ({"prompt": "x", "stop": ["s" * 300]}, "stop"),
        ({"prompt": "x", "logprobs": 6}, "logprobs"),
        ({"prompt": [-1]}, None),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ],
)
def test_completion_caps(gateway: GatewayProcess, body: dict[str, object], param: str | None) -> None:
    reply = httpx.post(gateway.url + "/v1/completions", json={"model": "m", **body}, timeout=10)
    assert reply.status_code == 400, reply.text
    if param:
        assert reply.json()["error"]["param"].startswith(param)


def test_chat_caps(gateway: GatewayProcess) -> None:
    too_many = [{"role": "user", "content": "x"}] * 4097
    reply = httpx.post(
        gateway.url + "/v1/chat/completions", json={"model": "m", "messages": too_many}, timeout=10
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"
    reply = httpx.post(
        gateway.url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**6},
        timeout=10,
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_completion_tokens"
