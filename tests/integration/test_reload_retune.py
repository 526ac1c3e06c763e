"""A reload that changes only what the gateway reads of a model (aliases, limits) applies in place:
the worker keeps running and a stream in flight finishes; one that changes what the worker reads
still restarts it. Real gateway, real CPU workers, real HTTP."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx

from tests.harness import GatewayProcess, pid_alive, wait_until
from tests.integration.conftest import demo_entry, write_registry

# 0.05 s a step on the marked prompt, however fast the machine: 400 tokens run for 20 s at least,
# well past the reload and its shutdown_grace_s (1 s), which would end the stream were the worker
# retired.
SLOW_ENGINE = "test:tests.fault_engines.FaultyEngine"
SLOW_PROMPT = "<<slow>> go"
STREAM_TOKENS = 400
TEST_ENGINES = {"GATEWAY_ALLOW_TEST_ENGINES": "1"}


def the_worker(gateway: GatewayProcess) -> dict[str, Any]:
    (worker,) = gateway.workers()
    return worker


def reload_applied(gateway: GatewayProcess) -> dict[str, Any]:
    reply = httpx.post(gateway.url + "/admin/reload", params={"wait": 60}, timeout=90)
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    assert body["status"] == "applied", body
    return body


def complete(gateway: GatewayProcess, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "hello", "max_tokens": 4}
    return httpx.post(gateway.url + "/v1/completions", json=body, timeout=60)


class SlowStream(threading.Thread):
    """One long streamed completion, read on its own thread (so the gateway never waits on us)."""

    def __init__(self, gateway: GatewayProcess, model: str) -> None:
        super().__init__(daemon=True)
        self.url = gateway.url + "/v1/completions"
        self.body = {"model": model, "prompt": SLOW_PROMPT, "max_tokens": STREAM_TOKENS, "ignore_eos": True,
                     "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        self.status: int | None = None
        self.lines: list[str] = []

    def run(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, timeout=120) as response:
            self.status = response.status_code
            self.lines.extend(line for line in response.iter_lines() if line.startswith(("data:", "event:")))

    def completion_tokens(self) -> int:
        usage = [json.loads(line[6:])["usage"] for line in self.lines if line.startswith("data: {")]
        return int([u for u in usage if u][-1]["completion_tokens"])


def test_a_reload_of_aliases_and_limits_keeps_the_worker_and_its_stream(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    config = tmp_path / "models.yaml"
    entry = demo_entry("m", demo_model_dir, engine=SLOW_ENGINE, aliases=["old-name"])
    write_registry(config, [entry], shutdown_grace_s=1)
    with GatewayProcess(config, env=TEST_ENGINES) as gateway:
        pid = int(the_worker(gateway)["pid"])
        stream = SlowStream(gateway, "old-name")
        stream.start()
        wait_until(lambda: stream.lines, "the stream's first event", context=gateway.events)

        # One slot and no queue: the stream holds the slot, so a new request is refused at once.
        limits = {"max_concurrent_jobs": 1, "max_queued_requests": 0}
        retuned = demo_entry("m", demo_model_dir, engine=SLOW_ENGINE, aliases=["new-name"], limits=limits)
        write_registry(config, [retuned], shutdown_grace_s=1)
        body = reload_applied(gateway)
        assert body["retuned"] == ["m"] and body["changed"] == [], body
        assert body["requests_ended"] == 0 and body["models"] == {} and body["models_ready"], body
        worker = the_worker(gateway)
        # The same process, still running the stream that began before the reload.
        assert worker["pid"] == pid and worker["state"] == "ready" and worker["in_flight"] == 1, worker

        refused = complete(gateway, "new-name")  # the new alias names the model, with its new limits
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full", refused.text
        gone = complete(gateway, "old-name")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found", gone.text
        cards = httpx.get(gateway.url + "/v1/models", timeout=5).json()["data"]
        assert [card["aliases"] for card in cards if card["id"] == "m"] == [["new-name"]]

        stream.join(120)
        assert not stream.is_alive(), gateway.events()
        assert stream.status == 200 and stream.lines[-1] == "data: [DONE]", stream.lines[-3:]
        assert not any(line.startswith("event: error") for line in stream.lines), stream.lines[-3:]
        assert stream.completion_tokens() == STREAM_TOKENS
        assert complete(gateway, "new-name").status_code == 200
        assert the_worker(gateway)["pid"] == pid and pid_alive(pid)


def test_a_reload_of_what_the_worker_reads_still_restarts_it(tmp_path: Path, demo_model_dir: Path) -> None:
    config = write_registry(tmp_path / "models.yaml", [demo_entry("m", demo_model_dir)])
    with GatewayProcess(config) as gateway:
        pid = int(the_worker(gateway)["pid"])
        # An engine setting and an alias: the worker reads the first, so the model is changed.
        write_registry(config, [demo_entry("m", demo_model_dir, max_batch_size=8, aliases=["a"])])
        body = reload_applied(gateway)
        assert body["changed"] == ["m"] and body["retuned"] == [], body

        def restarted() -> dict[str, Any] | None:
            worker = the_worker(gateway)
            return worker if worker["state"] == "ready" and worker["pid"] != pid else None

        wait_until(restarted, "a new worker for m to be ready", context=gateway.events)
        assert not pid_alive(pid)
        assert complete(gateway, "a").status_code == 200
