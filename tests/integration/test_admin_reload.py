"""Operators change the running set: reload models.yaml (HTTP and SIGHUP), load/unload, on-demand.
A reload that `gateway check-config` would reject on this host, or one during the SIGTERM drain,
changes nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import REPO_ROOT, WAIT_TIMEOUT_S, GatewayProcess, pid_alive, wait_until
from tests.integration.conftest import demo_entry, write_registry

# Streams that must still be running when a drain's grace ends: 0.05 s a step, however fast the
# machine, so 2000 tokens cannot finish first.
SLOW_ON_CUE = "test:tests.fault_engines.FaultyEngine"
SLOW_PROMPT = "<<slow>> go"
TEST_ENGINES = {"GATEWAY_ALLOW_TEST_ENGINES": "1"}


def workers_of(gateway: GatewayProcess, model: str) -> list[dict[str, Any]]:
    return [w for w in gateway.workers() if w["model"] == model]


def wait_state(
    gateway: GatewayProcess, model: str, state: str, timeout: float = WAIT_TIMEOUT_S
) -> dict[str, Any]:
    def in_state() -> dict[str, Any] | None:
        found = workers_of(gateway, model)
        return found[0] if found and found[0]["state"] == state else None

    return wait_until(in_state, f"{model} to be {state}", timeout, context=gateway.events)


def wait_in_flight(gateway: GatewayProcess, model: str) -> None:
    wait_until(lambda: workers_of(gateway, model)[0]["in_flight"], f"a request in flight on {model}")


def complete(gateway: GatewayProcess, model: str, **extra: object) -> httpx.Response:
    body = {"model": model, "prompt": "hello", "max_tokens": 4, **extra}
    return httpx.post(gateway.url + "/v1/completions", json=body, timeout=60)


@pytest.fixture()
def setup(tmp_path: Path, demo_model_dir: Path) -> Iterator[tuple[GatewayProcess, Path, Path]]:
    config = tmp_path / "models.yaml"
    change = demo_entry("change", demo_model_dir, aliases=["changing"])
    write_registry(config, [demo_entry("keep", demo_model_dir), change], shutdown_grace_s=5)
    with GatewayProcess(config) as gateway:
        yield gateway, config, demo_model_dir


def test_reload_applies_the_difference_without_dropping_requests(
    setup: tuple[GatewayProcess, Path, Path],
) -> None:
    gateway, config, model_dir = setup
    keep_pid = workers_of(gateway, "keep")[0]["pid"]
    change_pid = workers_of(gateway, "change")[0]["pid"]
    # A long request on the unchanged model runs across the reload.
    result: dict[str, Any] = {}

    def long_request() -> None:
        result["reply"] = complete(gateway, "keep", max_tokens=300, ignore_eos=True, temperature=0)

    runner = threading.Thread(target=long_request)
    runner.start()
    write_registry(
        config,
        [
            demo_entry("keep", model_dir),
            demo_entry("change", model_dir, max_seq_len=1024),
            demo_entry("added", model_dir, aliases=["new"]),
        ],
        shutdown_grace_s=5,
    )
    reply = httpx.post(gateway.url + "/admin/reload", timeout=60)
    # At once: 202 and where to follow it. Its status says it came while the reload was still
    # being applied (event order; the new models take seconds to load), not after.
    assert reply.status_code == 202, reply.text
    body = reply.json()
    assert body["added"] == ["added"] and body["changed"] == ["change"] and body["unchanged"] == ["keep"]
    assert body["status"] == "applying" and reply.headers["Location"] == body["progress"]
    progress = body["progress"]

    def models_ready() -> dict[str, Any] | None:
        view: dict[str, Any] = httpx.get(gateway.url + progress, timeout=5).json()
        return view if view["models_ready"] else None

    view = wait_until(models_ready, "the reload's models to be ready", context=gateway.events)
    assert view["status"] == "applied" and view["models"] == {"added": "ready", "change": "ready"}
    assert httpx.get(gateway.url + "/admin/reload", timeout=5).json()["id"] == body["id"]
    wait_state(gateway, "added", "ready")
    changed = wait_state(gateway, "change", "ready")
    assert changed["pid"] != change_pid and changed["info"]["max_seq_len"] == 1024
    assert not pid_alive(int(change_pid))
    runner.join(60)
    assert result["reply"].status_code == 200
    assert result["reply"].json()["usage"]["completion_tokens"] == 300
    assert workers_of(gateway, "keep")[0]["pid"] == keep_pid  # untouched
    assert complete(gateway, "new").status_code == 200

    # Removing a model drains and stops it; SIGHUP does the same as the HTTP call.
    write_registry(config, [demo_entry("keep", model_dir)], shutdown_grace_s=5)
    added_pid = workers_of(gateway, "added")[0]["pid"]
    gateway.process.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    wait_until(
        lambda: not workers_of(gateway, "added"), "the removed model's worker to go", context=gateway.events
    )
    assert not pid_alive(int(added_pid))
    assert complete(gateway, "added").status_code == 404
    assert workers_of(gateway, "keep")[0]["pid"] == keep_pid


def test_invalid_reload_changes_nothing(setup: tuple[GatewayProcess, Path, Path]) -> None:
    gateway, config, _ = setup
    before = {w["model"]: w["pid"] for w in gateway.workers()}
    config.write_text(
        "models:\n  - {name: broken, engine: transformers, path: x, engine_settings: {max_batch_size: 0}}\n"
    )
    reply = httpx.post(gateway.url + "/admin/reload", timeout=30)
    assert reply.status_code == 400  # refused at once, before anything is applied
    error = reply.json()["error"]
    assert error["code"] == "invalid_config" and "model 'broken'" in error["message"]
    assert {w["model"]: w["pid"] for w in gateway.workers()} == before
    assert complete(gateway, "keep").status_code == 200


def test_unload_then_load(setup: tuple[GatewayProcess, Path, Path]) -> None:
    gateway, _, _ = setup
    pid = workers_of(gateway, "change")[0]["pid"]
    reply = httpx.post(gateway.url + "/admin/models/change/unload", timeout=30)
    assert reply.status_code == 200 and reply.json()["workers"][0]["state"] == "unloaded"
    assert not pid_alive(int(pid))
    refused = complete(gateway, "change")
    assert refused.status_code == 503 and "/admin/models/change/load" in refused.json()["error"]["message"]
    # Unloaded on purpose: the gateway stays ready; the model itself is not.
    ready = httpx.get(gateway.url + "/health/ready", timeout=5)
    assert ready.status_code == 200 and ready.json()["models"]["change"]["state"] == "unloaded"
    assert httpx.get(gateway.url + "/health/ready/change", timeout=5).status_code == 503
    assert httpx.get(gateway.url + "/health/ready/keep", timeout=5).json() == {
        "model": "keep",
        "ready": True,
        "state": "ready",
    }
    assert httpx.post(gateway.url + "/admin/models/change/load", timeout=30).status_code == 202
    wait_state(gateway, "change", "ready")
    assert complete(gateway, "change").status_code == 200


def test_reload_refused_when_check_config_rejects_a_model_it_starts(
    setup: tuple[GatewayProcess, Path, Path],
) -> None:
    """A changed or added local model whose folder is not on this host: `gateway check-config`
    rejects the file, and so does a reload (HTTP and SIGHUP), before it retires anything."""
    gateway, config, model_dir = setup
    before = {w["model"]: w["pid"] for w in gateway.workers()}
    missing = config.parent / "not-on-this-host"
    entries = [demo_entry("keep", model_dir), demo_entry("change", missing), demo_entry("added", missing)]
    write_registry(config, entries, shutdown_grace_s=5)
    checked = subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", str(config)],
        capture_output=True, text=True, cwd=REPO_ROOT, env=gateway.env, timeout=120,
    )  # fmt: skip
    problems = [line.removeprefix("config error: ") for line in checked.stderr.splitlines()
                if "is not a folder on this host" in line]  # fmt: skip
    assert checked.returncode == 2 and len(problems) == 2, checked.stderr
    reply = httpx.post(gateway.url + "/admin/reload", timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "invalid_config" and error["type"] == "invalid_request_error"
    for name in ("change", "added"):  # the file, the model and the field, as check-config says them
        problem = f"{config}: model '{name}', field 'path': {missing} is not a folder on this host"
        assert problem in problems and problem in error["message"], error["message"]
    assert httpx.get(gateway.url + "/admin/reload", timeout=5).json()["status"] == "none"
    assert {w["model"]: w["pid"] for w in gateway.workers()} == before
    assert complete(gateway, "change").status_code == 200

    gateway.process.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    refusal = wait_until(
        lambda: [line for line in gateway.events().splitlines() if "SIGHUP reload refused" in line],
        "the SIGHUP reload to be refused",
        context=gateway.events,
    )
    assert "model 'change', field 'path'" in refusal[0], refusal
    assert httpx.get(gateway.url + "/admin/reload", timeout=5).json()["status"] == "none"
    assert {w["model"]: w["pid"] for w in gateway.workers()} == before
    assert all(w["state"] == "ready" for w in gateway.workers())


def test_reload_during_the_shutdown_drain_is_refused(tmp_path: Path, demo_model_dir: Path) -> None:
    """Once SIGTERM's drain has begun a reload changes nothing: 503 `shutting_down` over HTTP, SIGHUP
    logged and ignored; the worker is not retired and no reload is recorded."""
    config = tmp_path / "models.yaml"
    # A grace the test never waits out: the drain ends when the client drops its stream.
    write_registry(config, [demo_entry("m", demo_model_dir, engine=SLOW_ON_CUE)], shutdown_grace_s=60)
    with GatewayProcess(config, env=TEST_ENGINES) as gateway:
        pid = int(workers_of(gateway, "m")[0]["pid"])
        changed = demo_entry("m", demo_model_dir, engine=SLOW_ON_CUE, max_seq_len=1024)
        write_registry(config, [changed], shutdown_grace_s=60)
        body = {"model": "m", "prompt": SLOW_PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)  # in flight: the drain waits for it
            gateway.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]

            def draining() -> bool:
                ready = httpx.get(gateway.url + "/health/ready", timeout=2)
                return ready.status_code == 503 and ready.json()["status"] == "draining"

            wait_until(draining, "the drain to begin", context=gateway.events)
            reply = httpx.post(gateway.url + "/admin/reload", timeout=30)
            assert reply.status_code == 503, reply.text
            error = reply.json()["error"]
            assert error["code"] == "shutting_down" and error["type"] == "service_unavailable_error"
            gateway.process.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
            wait_until(
                lambda: "SIGHUP ignored: the server is shutting down" in gateway.events(),
                "the SIGHUP to be ignored",
                context=gateway.events,
            )
            assert httpx.get(gateway.url + "/admin/reload", timeout=5).json()["status"] == "none"
            assert [w["pid"] for w in workers_of(gateway, "m")] == [pid] and pid_alive(pid)
            assert "reload 1 started" not in gateway.events()
        # The stream dropped, the drain has nothing left to wait for.
        assert gateway.process.wait(30) == 0  # type: ignore[union-attr]


def test_load_and_unload_by_alias_answer_with_the_models_name(
    setup: tuple[GatewayProcess, Path, Path],
) -> None:
    gateway, _, _ = setup
    unloaded = httpx.post(gateway.url + "/admin/models/changing/unload", timeout=30)
    assert unloaded.status_code == 200 and unloaded.json()["model"] == "change", unloaded.text
    assert workers_of(gateway, "change")[0]["state"] == "unloaded"
    loaded = httpx.post(gateway.url + "/admin/models/changing/load", timeout=30)
    assert loaded.status_code == 202 and loaded.json()["model"] == "change", loaded.text
    wait_state(gateway, "change", "ready")
    assert complete(gateway, "changing").status_code == 200


def documented_when(status: int, code: str) -> str:
    """What docs/api.md's table of errors says of `code` (the `when` of the row that names it)."""
    for line in (REPO_ROOT / "docs" / "api.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] == str(status) and f"`{code}`" in cells[1]:
            return cells[2]
    raise AssertionError(f"docs/api.md's table of errors has no {status} {code}")


def test_unload_ends_its_requests_with_model_unloaded_and_later_ones_get_service_unavailable(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """What the error table in docs/api.md promises: requests that waited for the model or ran on it
    when it was unloaded end with `model_unloaded` (the stream after the drain's grace); a request
    that comes afterwards gets `service_unavailable`, saying how to load the model."""
    limits = {"max_concurrent_jobs": 1, "max_queued_requests": 8}
    config = write_registry(
        tmp_path / "models.yaml", [demo_entry("m", demo_model_dir, engine=SLOW_ON_CUE, limits=limits)],
        shutdown_grace_s=1,
    )  # fmt: skip
    with GatewayProcess(config, env=TEST_ENGINES) as gateway:
        events: list[str] = []

        def stream() -> None:
            body = {"model": "m", "prompt": SLOW_PROMPT, "max_tokens": 2000, "ignore_eos": True,
                    "stream": True}  # fmt: skip
            with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=60) as response:
                events.extend(line for line in response.iter_lines() if line.startswith(("data:", "event:")))

        def queue_depth() -> int:
            view = httpx.get(gateway.url + "/admin/workers", timeout=5).json()
            return int(view["models"]["m"]["queue_depth"])

        runner = threading.Thread(target=stream)
        runner.start()
        wait_in_flight(gateway, "m")
        queued: dict[str, Any] = {}
        waiter = threading.Thread(target=lambda: queued.update(reply=complete(gateway, "m")))
        waiter.start()
        wait_until(lambda: queue_depth() == 1, "the second request to wait for the only slot")
        assert httpx.post(gateway.url + "/admin/models/m/unload", timeout=30).status_code == 200
        waiter.join(60)
        runner.join(60)
        assert "reply" in queued and not runner.is_alive(), gateway.log()[-6000:]
        waited = queued["reply"]
        assert waited.status_code == 503 and waited.json()["error"]["code"] == "model_unloaded"
        assert events[-1] == "data: [DONE]" and events[-3] == "event: error"
        assert json.loads(events[-2][6:])["error"]["code"] == "model_unloaded"
        assert "waiting for the model or running on it when it was unloaded by hand" in documented_when(
            503, "model_unloaded"
        )
        later = complete(gateway, "m")
        error = later.json()["error"]
        assert later.status_code == 503 and "POST /admin/models/m/load" in error["message"], later.text
        assert error["code"] == "service_unavailable" and error["type"] == "service_unavailable_error"
        assert "a new request for a model that no worker can serve now: one unloaded" in documented_when(
            503, error["code"]
        )


def test_on_demand_model_loads_at_first_request_and_unloads_when_idle(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    config = write_registry(
        tmp_path / "models.yaml",
        [demo_entry("lazy", demo_model_dir, load="on_demand", idle_unload_s=2)],
    )
    with GatewayProcess(config) as gateway:  # ready at once: an on-demand model need not be loaded
        assert workers_of(gateway, "lazy")[0]["state"] == "unloaded"
        assert workers_of(gateway, "lazy")[0]["pid"] is None
        states: list[str] = []

        def record_state() -> bool:
            state = str(workers_of(gateway, "lazy")[0]["state"])
            if not states or states[-1] != state:
                states.append(state)
            return state == "ready"

        def watch() -> None:  # the states the model goes through while the request waits for it
            wait_until(record_state, "the on-demand model to be ready")

        watcher = threading.Thread(target=watch)
        watcher.start()
        reply = complete(gateway, "lazy")  # waits while the model loads
        watcher.join()
        assert reply.status_code == 200
        assert "loading" in states and states[-1] == "ready", states
        pid = int(workers_of(gateway, "lazy")[0]["pid"])
        wait_state(gateway, "lazy", "unloaded", timeout=15)  # idle for 2 s
        assert not pid_alive(pid)
        assert complete(gateway, "lazy").status_code == 200  # and back again


def test_reload_ends_requests_of_a_removed_model_with_their_reason(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """Queued requests for a removed model end at once; a running stream gets the drain's grace,
    then an SSE error saying why (not a generic shutdown, and never a wait for the deadline)."""
    config = tmp_path / "models.yaml"
    limits = {"max_concurrent_jobs": 1, "max_queued_requests": 8}
    slow = demo_entry("going", demo_model_dir, engine=SLOW_ON_CUE, limits=limits)
    write_registry(config, [demo_entry("keep", demo_model_dir), slow], shutdown_grace_s=1)
    with GatewayProcess(config, env=TEST_ENGINES) as gateway:
        events: list[str] = []

        def stream() -> None:
            body = {"model": "going", "prompt": SLOW_PROMPT, "max_tokens": 2000, "ignore_eos": True,
                    "stream": True}  # fmt: skip
            with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=60) as response:
                events.extend(line for line in response.iter_lines() if line.startswith(("data:", "event:")))

        runner = threading.Thread(target=stream)
        runner.start()
        wait_in_flight(gateway, "going")
        queued: dict[str, Any] = {}
        waiter = threading.Thread(target=lambda: queued.update(reply=complete(gateway, "going")))
        waiter.start()

        def queue_depth() -> int:
            return int(
                httpx.get(gateway.url + "/admin/workers", timeout=5).json()["models"]["going"]["queue_depth"]
            )

        wait_until(lambda: queue_depth() == 1, "the second request to wait for the only slot")
        write_registry(config, [demo_entry("keep", demo_model_dir)], shutdown_grace_s=1)
        # A bounded wait: 200 once applied.
        reply = httpx.post(gateway.url + "/admin/reload?wait=20", timeout=30)
        assert reply.status_code == 200 and reply.json()["removed"] == ["going"], reply.text
        assert reply.json()["status"] == "applied" and reply.json()["requests_ended"] == 2
        waiter.join(60)
        assert "reply" in queued, gateway.log()[-6000:]
        refused = queued["reply"]
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_removed"
        runner.join(60)
        assert not runner.is_alive(), gateway.log()[-6000:]
        # Ended by the drain's grace (its reason, model_removed), not by a deadline (request_timeout)
        # or by running out its 2000 tokens: event order, no wall-clock bound.
        assert events[-1] == "data: [DONE]" and events[-3] == "event: error"
        assert json.loads(events[-2][6:])["error"]["code"] == "model_removed"
        assert complete(gateway, "keep").status_code == 200


def test_reload_ends_a_stream_on_a_changed_model_with_model_reloading(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """A stream still running on a changed model when the drain grace ends gets "model reloading",
    not "the server is shutting down"; a second reload while one applies is refused with 409."""
    config = tmp_path / "models.yaml"
    write_registry(config, [demo_entry("m", demo_model_dir, engine=SLOW_ON_CUE)], shutdown_grace_s=1)
    with GatewayProcess(config, env=TEST_ENGINES) as gateway:
        events: list[str] = []

        def stream() -> None:
            body = {
                "model": "m",
                "prompt": SLOW_PROMPT,
                "max_tokens": 2000,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=60) as response:
                events.extend(line for line in response.iter_lines() if line.startswith(("data:", "event:")))

        runner = threading.Thread(target=stream)
        runner.start()
        wait_in_flight(gateway, "m")
        changed = demo_entry("m", demo_model_dir, engine=SLOW_ON_CUE, max_seq_len=1024)
        write_registry(config, [changed], shutdown_grace_s=1)
        first = httpx.post(gateway.url + "/admin/reload", timeout=30)
        assert first.status_code == 202 and first.json()["changed"] == ["m"]
        second = httpx.post(gateway.url + "/admin/reload", timeout=30)
        assert second.status_code == 409 and second.json()["error"]["code"] == "reload_in_progress"
        runner.join(60)
        assert not runner.is_alive(), gateway.log()[-6000:]
        assert events[-1] == "data: [DONE]" and events[-3] == "event: error", events[-3:]
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == "model_reloading" and "reloading with new settings" in error["message"]
        view = httpx.get(gateway.url + first.json()["progress"], timeout=5).json()
        assert view["requests_ended"] == 1 or view["status"] == "applying"


def test_worker_restarts_counter_only_grows_across_reloads(tmp_path: Path, demo_model_dir: Path) -> None:
    """gateway_worker_restarts_total is a counter: a reload that replaces a model's worker (changed,
    or removed and added again) carries its restarts on, or Prometheus would read a reset."""
    config = tmp_path / "models.yaml"
    spare = demo_entry("spare", demo_model_dir, load="on_demand")  # a registry holds one model at least
    write_registry(config, [demo_entry("m", demo_model_dir), spare], restart_backoff_s=0.2)

    def restarts_total() -> float:
        text = httpx.get(gateway.url + "/metrics", timeout=10).text
        samples = {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        return samples[("gateway_worker_restarts_total", frozenset({("model", "m"), ("replica", "0")}))]

    def reload(entries: list[dict[str, object]]) -> None:
        write_registry(config, [*entries, spare], restart_backoff_s=0.2)
        reply = httpx.post(gateway.url + "/admin/reload?wait=60", timeout=90)
        assert reply.status_code == 200 and reply.json()["status"] == "applied", reply.text

    with GatewayProcess(config, port=8130) as gateway:
        os.kill(int(workers_of(gateway, "m")[0]["pid"]), signal.SIGKILL)
        wait_until(lambda: workers_of(gateway, "m")[0]["restarts"] == 1, "m's worker to be restarted",
                   context=gateway.events)  # fmt: skip
        wait_state(gateway, "m", "ready")
        assert restarts_total() == 1
        reload([demo_entry("m", demo_model_dir, max_seq_len=1024)])  # changed: a new worker
        assert wait_state(gateway, "m", "ready")["restarts"] == 1
        assert restarts_total() == 1
        reload([])  # removed
        assert not workers_of(gateway, "m")
        reload([demo_entry("m", demo_model_dir)])  # and added again
        assert wait_state(gateway, "m", "ready")["restarts"] == 1
        assert restarts_total() == 1
