"""The soak's injected faults: worker SIGKILLs and registry reloads, one at a time.

Runs in the soak process (bench/soak.py), on its asyncio loop, beside the load. Owns the registry
file the soak's gateway started from. A kill SIGKILLs the ready worker of a model (alternating
models) and times its recovery, until a ready worker with a new pid. A reload rewrites the file to
the next step of a cycle (one served model's limits changed, an extra model added, the other
served model changed, the extra model removed), POSTs /admin/reload (202) and follows
/admin/reload/{id} until it is applied and every model it started serves. A lock keeps faults
apart, so each recovery is measured alone; a fault due while another recovers waits its turn.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.integration.conftest import write_registry

RECOVERY_TIMEOUT_S = 120.0
EXTRA_MODEL = "soak-extra"


@dataclass
class Chaos:
    url: str
    registry_path: Path
    models: list[dict[str, Any]]  # the served models' registry entries, as the gateway started
    extra: dict[str, Any]  # a model that reloads add and remove (no client uses it)
    started: float
    stop_at: float
    kills: list[dict[str, Any]] = field(default_factory=list)
    reloads: list[dict[str, Any]] = field(default_factory=list)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def names(self) -> list[str]:
        return [str(m["name"]) for m in self.models]

    async def kill_every(self, every_s: float) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as admin:
            index = 0
            while (due := self.started + (index + 1) * every_s) < self.stop_at:
                await asyncio.sleep(due - time.monotonic())
                model = self.names[index % len(self.names)]
                index += 1
                async with self._lock:
                    await self._kill(admin, model)

    async def reload_every(self, every_s: float, offset_s: float) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as admin:
            index = 0
            while (due := self.started + offset_s + index * every_s) < self.stop_at:
                await asyncio.sleep(due - time.monotonic())
                async with self._lock:
                    await self._reload(admin, index)
                index += 1

    # ---- kills -----------------------------------------------------------------------------------

    async def _kill(self, admin: httpx.AsyncClient, model: str) -> None:
        old = await _ready_worker(admin, model)
        if old is None:
            return  # still recovering from something else: skip this kill rather than stack two
        os.kill(old["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        record: dict[str, Any] = {"model": model, "at_s": round(killed_at - self.started, 1),
                                  "old_pid": old["pid"], "recovery_s": None}  # fmt: skip
        self.kills.append(record)
        while time.monotonic() - killed_at < RECOVERY_TIMEOUT_S:
            now = await _ready_worker(admin, model)
            if now is not None and now["pid"] != old["pid"]:
                record.update(recovery_s=round(time.monotonic() - killed_at, 2), new_pid=now["pid"])
                return
            await asyncio.sleep(0.05)

    # ---- reloads ---------------------------------------------------------------------------------

    def _next_registry(self, index: int) -> str:
        """Write the registry of reload `index`; return what it changes."""
        step, cycle = index % 4, index // 4
        models = [dict(m) for m in self.models]
        extra = [self.extra] if step in (1, 2) else []
        if step in (0, 2):
            changed = models[0 if step == 0 else 1]
            # Any difference restarts the model's workers; the clients never notice the value.
            changed["limits"] = {**changed["limits"], "request_timeout_s": 600 - (cycle % 2 + 1) * 10 - step}
        write_registry(self.registry_path, models + extra)
        return {0: f"change {self.names[0]}", 1: f"add {EXTRA_MODEL}", 2: f"change {self.names[1]}",
                3: f"remove {EXTRA_MODEL}"}[step]  # fmt: skip

    async def _reload(self, admin: httpx.AsyncClient, index: int) -> None:
        what = self._next_registry(index)
        started = time.monotonic()
        record: dict[str, Any] = {"what": what, "at_s": round(started - self.started, 1), "status": None,
                                  "requests_ended": None, "applied_s": None, "ready_s": None}  # fmt: skip
        self.reloads.append(record)
        reply = await admin.post("/admin/reload")
        if reply.status_code != 202:
            record["status"] = f"http_{reply.status_code}"
            return
        progress = reply.json()["progress"]
        while time.monotonic() - started < RECOVERY_TIMEOUT_S:
            view = (await admin.get(progress)).json()
            record.update(status=view["status"], requests_ended=view["requests_ended"])
            if view["status"] != "applying" and record["applied_s"] is None:
                record["applied_s"] = round(time.monotonic() - started, 2)
            if view["status"] == "failed":
                return
            if view["models_ready"] and all([await _ready_worker(admin, m) for m in self.names]):
                record["ready_s"] = round(time.monotonic() - started, 2)
                return
            await asyncio.sleep(0.1)


async def _ready_worker(admin: httpx.AsyncClient, model: str) -> dict[str, Any] | None:
    """The model's ready worker (a reload may briefly show a draining one beside it), if any."""
    workers = (await admin.get("/admin/workers")).json()["workers"]
    ready = [w for w in workers if w["model"] == model and w["state"] == "ready" and w["pid"]]
    return ready[0] if ready else None
