"""Lifecycle states as operators see them, crash loops, and graceful shutdown (SIGTERM)."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import httpx

from tests.harness import WAIT_TIMEOUT_S, GatewayProcess, pid_alive, wait_until
from tests.integration.conftest import demo_entry, write_registry

FAULTY = "test:tests.fault_engines.FaultyEngine"
KNOWN_STATES = {"starting", "loading", "warming", "ready", "draining", "restarting", "failed", "stopped"}


def watch_states(gateway: GatewayProcess, until: str, timeout: float = WAIT_TIMEOUT_S) -> list[str]:
    """Poll /admin/workers and /health/ready; return every distinct state seen, in order."""
    seen: list[str] = []

    def record() -> bool:
        workers = httpx.get(gateway.url + "/admin/workers", timeout=2).json()["workers"]
        ready = httpx.get(gateway.url + "/health/ready", timeout=2).json()
        state = workers[0]["state"]
        # /health/ready must expose the same lifecycle (it may have moved on between the two calls).
        assert ready["models"]["m"]["replicas"][0]["state"] in KNOWN_STATES
        if not seen or seen[-1] != state:
            seen.append(state)
        return bool(state == until)

    # Polled often: the states on the way (warming, draining) last well under a second.
    wait_until(
        record, f"the worker to be {until}", timeout, retry_on=(httpx.HTTPError,), poll_s=0.02,
        context=lambda: f"{gateway.events()}\nstates seen: {seen}",
    )  # fmt: skip
    return seen


def test_startup_states_then_draining_on_sigterm(tmp_path: Path, demo_model_dir: Path) -> None:
    config = write_registry(
        tmp_path / "models.yaml", [demo_entry("m", demo_model_dir, engine=FAULTY)], shutdown_grace_s=3
    )
    env = {
        "GATEWAY_ALLOW_TEST_ENGINES": "1",
        "FAULT_LOAD_DELAY_S": "1.5",
        "FAULT_WARMUP_STEP_S": "0.02",
        "FAULT_SLOW_STEP_S": "0.02",
    }
    with GatewayProcess(config, env=env, wait_ready=False) as gateway:
        gateway.wait_until_live()
        assert httpx.get(gateway.url + "/health/ready", timeout=2).status_code == 503
        seen = watch_states(gateway, "ready")
        assert seen[-3:] == ["loading", "warming", "ready"], seen
        assert seen[0] in ("starting", "loading")

        # A stream in flight when SIGTERM arrives may finish within the grace period.
        lines: list[str] = []
        streaming = threading.Event()

        def stream_one() -> None:
            body = {
                "model": "m",
                "prompt": "<<slow>> go",
                "max_tokens": 40,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=30) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        streaming.set()

        streamer = threading.Thread(target=stream_one)
        streamer.start()
        assert streaming.wait(30), "the stream never started"
        gateway.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        states = watch_states(gateway, "draining")
        assert states[-1] == "draining"
        refused = httpx.post(gateway.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=5)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        ready = httpx.get(gateway.url + "/health/ready", timeout=2)
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        streamer.join(30)
        assert not streamer.is_alive(), gateway.log()
        assert lines[-1] == "data: [DONE]"
        finish = json.loads(lines[-2][6:])["choices"][0]["finish_reason"]
        assert finish == "length"
        assert gateway.process.wait(15) == 0  # type: ignore[union-attr]


def test_stream_past_grace_gets_error_event(tmp_path: Path, demo_model_dir: Path) -> None:
    config = write_registry(
        tmp_path / "models.yaml", [demo_entry("m", demo_model_dir, engine=FAULTY)], shutdown_grace_s=1
    )
    env = {"GATEWAY_ALLOW_TEST_ENGINES": "1", "FAULT_SLOW_STEP_S": "0.05"}
    with GatewayProcess(config, env=env) as gateway:
        pid = gateway.workers()[0]["pid"]
        body = {
            "model": "m",
            "prompt": "<<slow>> long",
            "max_tokens": 1000,
            "ignore_eos": True,
            "stream": True,
        }
        events = []
        with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            next(lines)
            gateway.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            events = [line for line in lines if line.startswith(("event:", "data:"))]
        # Ended by the grace (1 s) running out, not by its 1000 slow tokens (50 s) or a deadline:
        # the error says so (event order, no wall-clock bound).
        assert events[-1] == "data: [DONE]"
        assert events[-3] == "event: error"
        assert json.loads(events[-2][6:])["error"]["code"] == "shutting_down"
        assert gateway.process.wait(15) == 0  # type: ignore[union-attr]
        assert not pid_alive(pid)


def test_crash_loop_ends_in_failed_state_with_reason(tmp_path: Path, demo_model_dir: Path) -> None:
    config = write_registry(
        tmp_path / "models.yaml",
        [demo_entry("m", demo_model_dir, engine=FAULTY)],
        restart_backoff_s=0.2,
        restart_limit=2,
    )
    env = {"GATEWAY_ALLOW_TEST_ENGINES": "1", "FAULT_CRASH_ON_LOAD": "1"}
    with GatewayProcess(config, env=env, wait_ready=False) as gateway:
        gateway.wait_until_live()
        seen = watch_states(gateway, "failed", 90)
        assert "restarting" in seen
        ready = httpx.get(gateway.url + "/health/ready", timeout=2)
        assert ready.status_code == 503
        replica = ready.json()["models"]["m"]["replicas"][0]
        assert replica["state"] == "failed" and "injected load failure" in replica["last_error"]
        worker = gateway.workers()[0]
        assert worker["state"] == "failed" and worker["restarts"] == 1
        assert "2 failed starts" in worker["detail"]
        reply = httpx.post(gateway.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=5)
        assert reply.status_code == 503 and "injected load failure" in reply.json()["error"]["message"]


def test_sigterm_refuses_waiting_requests_at_once_and_exits_when_the_streams_end(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    # One slot: a stream holds it, a second request waits in the gateway for it. Nothing is routed
    # once the drain begins, so without an answer at once the waiting one would wait out the long
    # grace, and hold the exit back as long.
    entry = demo_entry("m", demo_model_dir, engine=FAULTY, limits={"max_concurrent_jobs": 1})
    config = write_registry(tmp_path / "models.yaml", [entry], shutdown_grace_s=120)
    env = {"GATEWAY_ALLOW_TEST_ENGINES": "1", "FAULT_SLOW_STEP_S": "0.05"}
    with GatewayProcess(config, env=env) as gateway:
        body = {"model": "m", "prompt": "<<slow>> go", "max_tokens": 60, "ignore_eos": True, "stream": True}
        waiting_reply: list[httpx.Response] = []
        refused = threading.Event()

        def wait_for_the_slot() -> None:
            waiting_reply.append(httpx.post(gateway.url + "/v1/completions", json=body, timeout=150))
            refused.set()

        with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=150) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            waiter = threading.Thread(target=wait_for_the_slot)
            waiter.start()
            wait_until(lambda: queue_depth(gateway) == 1, "a request waiting for the slot")
            gateway.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            assert refused.wait(30), "the waiting request was not answered"
            rest = [line for line in lines if line.startswith("data: ")]  # the stream goes on
        waiter.join(5)
        reply = waiting_reply[0]
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "shutting_down", reply.text
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert gateway.process.wait(30) == 0  # type: ignore[union-attr]


def queue_depth(gateway: GatewayProcess) -> int:
    return int(httpx.get(gateway.url + "/admin/workers", timeout=5).json()["models"]["m"]["queue_depth"])
