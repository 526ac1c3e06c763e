"""Readiness policies, the checks before a worker process starts, and the `gateway` command line.

Runs the readiness functions on real ModelRoutes and WorkerHandles, and LoadGate with a stand-in
for GPU memory (this host has no GPU); the command line as a real subprocess.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.config.models import ModelConfig
from gateway.config.registry import Registry
from gateway.http.health_routes import gateway_ready
from gateway.link.handle import WorkerHandle
from gateway.serving.router import ModelRoute
from gateway.workers.loads import LoadGate, LoadRefused
from tests.harness import REPO_ROOT, async_wait_until, settle
from wire.states import WorkerState

S = WorkerState
GIB = 1024**3


def route(name: str, *states: WorkerState, load: str = "startup") -> ModelRoute:
    config = ModelConfig(name=name, engine="transformers", path=Path("x"), load=load)  # type: ignore[arg-type]
    handles = []
    for i, state in enumerate(states):
        handle = WorkerHandle(f"{name}#0-r{i}", config, replica=i)
        handle.state = state
        handles.append(handle)
    return ModelRoute(config, handles, lambda _: None)


def test_all_startup_policy() -> None:
    ready, loading = route("a", S.READY), route("b", S.LOADING)
    assert not gateway_ready([ready, loading], "all_startup")
    assert gateway_ready([ready, route("b", S.LOADING, S.READY)], "all_startup")  # one replica is enough
    # Unloaded on purpose (by hand or idle) and on-demand models do not count; failed ones do.
    assert gateway_ready([ready, route("b", S.UNLOADED)], "all_startup")
    assert gateway_ready([ready, route("c", S.UNLOADED, load="on_demand")], "all_startup")
    assert not gateway_ready([ready, route("d", S.FAILED)], "all_startup")
    assert not gateway_ready([ready, route("remote-without-workers")], "all_startup")


def test_any_policy() -> None:
    assert gateway_ready([route("a", S.FAILED), route("b", S.READY)], "any")
    assert not gateway_ready([route("a", S.FAILED), route("b", S.LOADING)], "any")
    # An on-demand model that is not loaded can serve: its first request loads it.
    assert gateway_ready([route("a", S.FAILED), route("c", S.UNLOADED, load="on_demand")], "any")
    assert not gateway_ready([route("b", S.UNLOADED)], "any")  # unloaded by hand: it cannot


class StubSupervisor:
    """What LoadGate uses of the supervisor: the registry, the workers, and state changes."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.workers: dict[str, WorkerHandle] = {}
        self.states: list[tuple[str, WorkerState, str]] = []

    def set_state(self, handle: WorkerHandle, state: WorkerState, detail: str) -> None:
        if handle.move_to(state, detail):
            self.states.append((handle.id, state, detail))


def gpu_model(tmp_path: Path, size_gib: float, load: str = "on_demand") -> ModelConfig:
    folder = tmp_path / "weights"
    folder.mkdir(exist_ok=True)
    with open(folder / "model.safetensors", "wb") as weights:  # sparse: no disk is used
        weights.truncate(int(size_gib * GIB))
    return ModelConfig(name="big", path=folder, gpus=[0, 1], load=load)  # type: ignore[arg-type]


def test_free_vram_check_before_an_on_demand_load(tmp_path: Path) -> None:
    model = gpu_model(tmp_path, 10)
    registry = Registry(models=[model])
    asked: list[list[int]] = []

    def free(indices: list[int]) -> dict[int, int]:
        asked.append(indices)
        return {0: 4 * GIB, 1: 5 * GIB}

    handle = WorkerHandle("big#0", model, gpus=[0, 1], state=S.UNLOADED)
    gate = LoadGate(StubSupervisor(registry), free_memory=free)  # type: ignore[arg-type]
    with pytest.raises(
        LoadRefused, match=r"weights take 10.0 GiB \(GPU 0: 4.0 GiB free, GPU 1: 5.0 GiB free\)"
    ):
        asyncio.run(gate.before_spawn(handle))
    assert asked == [[0, 1]]
    roomy = LoadGate(StubSupervisor(registry), free_memory=lambda _: {0: 6 * GIB, 1: 6 * GIB})  # type: ignore[arg-type]
    asyncio.run(roomy.before_spawn(handle))  # fits: no refusal
    unknown = LoadGate(StubSupervisor(registry), free_memory=lambda _: None)  # type: ignore[arg-type]
    asyncio.run(unknown.before_spawn(handle))  # no NVML and no nvidia-smi: nothing to check against
    # Startup models were placed at start (gateway.config.placement); only on-demand loads are checked.
    startup = WorkerHandle("big#0", gpu_model(tmp_path, 10, load="startup"), gpus=[0, 1])
    asyncio.run(LoadGate(StubSupervisor(registry), free_memory=free).before_spawn(startup))  # type: ignore[arg-type]


def test_load_slots_are_held_until_a_worker_leaves_the_startup_states(tmp_path: Path) -> None:
    models = [ModelConfig(name=n, engine="transformers", path=tmp_path) for n in ("a", "b")]
    registry = Registry.model_validate({"server": {"max_concurrent_loads": 1}, "models": models})

    async def scenario() -> list[str]:
        supervisor = StubSupervisor(registry)
        gate = LoadGate(supervisor)  # type: ignore[arg-type]
        a, b = (WorkerHandle(f"{m.name}#0", m) for m in models)
        order: list[str] = []
        await gate.before_spawn(a)
        order.append("a got its slot")
        waiting = asyncio.create_task(gate.before_spawn(b))
        await async_wait_until(lambda: b.detail == "waiting for a free load slot", "b to wait for a slot")
        assert not waiting.done()
        a.move_to(S.LOADING, "")
        gate.after_state(a)  # still starting up: keeps the slot
        await settle()
        assert not waiting.done()
        a.move_to(S.WARMING, "")
        a.move_to(S.READY, "")
        gate.after_state(a)
        await asyncio.wait_for(waiting, 1)
        order.append("b got its slot")
        return order

    assert asyncio.run(scenario()) == ["a got its slot", "b got its slot"]


def gateway_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60
    )


def test_version_and_log_level_anywhere(tmp_path: Path) -> None:
    from importlib import metadata

    version = gateway_cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"gateway {metadata.version('llm-gateway')}"
    config = tmp_path / "models.yaml"
    config.write_text("models:\n  - {name: m, engine: transformers, path: .}\n")
    for args in (
        ["--log-level", "DEBUG", "check-config", str(config)],
        ["check-config", str(config), "--log-level", "DEBUG"],
    ):
        result = gateway_cli(*args)
        assert result.returncode == 0 and "ok: m [transformers, cpu]" in result.stdout, result.stderr
    wrong: Any = gateway_cli("check-config", str(config), "--log-level", "LOUD")
    assert (
        wrong.returncode == 2
        and "Traceback" not in wrong.stderr
        and "unknown log level 'LOUD'" in wrong.stderr
    )
