"""A worker's own cap and queue (model_worker.jobs) and how a gateway reads them (WorkerHandle, router).

The worker holds the line whatever its gateways send: at most max_jobs jobs run, max_queue more wait
(answered Accepted when they start), past that worker_full. The gateway gives a shared worker the
slots its cap leaves after the other gateways' jobs.
"""

from __future__ import annotations

from typing import Any

from gateway.config.models import ModelConfig
from gateway.link.handle import WorkerHandle
from model_worker.jobs import JobDesk
from model_worker.prompt_desk import PreparedJob
from wire import messages as wire
from wire.params import SamplingParams, WorkerSpec
from wire.results import FinishReason, JobOutput, RejectCode
from wire.stats import WorkerLoad


class CountingEngine:
    """Just enough engine for the desk: which jobs it was given and which it holds."""

    def __init__(self) -> None:
        self.held: list[str] = []

    def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.held.append(rid)

    def cancel(self, rid: str) -> bool:
        if rid in self.held:
            self.held.remove(rid)
            return True
        return False


def _desk(max_jobs: int, max_queue: int) -> tuple[JobDesk, CountingEngine, list[wire.Message]]:
    sent: list[wire.Message] = []
    engine = CountingEngine()
    spec = WorkerSpec("m", "transformers", "/x", 64, {}, max_jobs=max_jobs, max_queue=max_queue)
    desk = JobDesk(engine, spec, sent.append)  # type: ignore[arg-type]
    return desk, engine, sent


def _job(rid: str) -> PreparedJob:
    return PreparedJob(wire.Generate(rid, "p", None, None, SamplingParams(max_tokens=4)), [1, 2])


def _answers(sent: list[wire.Message]) -> dict[str, Any]:
    return {
        m.rid: type(m).__name__ if isinstance(m, wire.Accepted) else m.code for m in sent if hasattr(m, "rid")
    }


def test_jobs_past_the_cap_wait_and_past_the_queue_are_refused() -> None:
    desk, engine, sent = _desk(max_jobs=2, max_queue=1)
    for rid in "abcd":
        desk.generate(_job(rid))
    assert engine.held == ["a", "b"]  # two run
    assert _answers(sent) == {"a": "Accepted", "b": "Accepted", "d": RejectCode.WORKER_FULL}  # c waits
    assert desk.load() == WorkerLoad(active=2, queued=1, max_jobs=2, max_queue=1, yours=3)
    # A finished job makes room: the waiting one starts (after the step's frame went out).
    desk.outputs([JobOutput("a", "x", [3], FinishReason.LENGTH)])
    engine.held.remove("a")
    assert "c" not in engine.held
    desk.start_waiting()
    assert engine.held == ["b", "c"] and _answers(sent)["c"] == "Accepted"


def test_a_cancelled_job_frees_its_place_running_or_waiting() -> None:
    desk, engine, sent = _desk(max_jobs=1, max_queue=2)
    for rid in "abc":
        desk.generate(_job(rid))
    assert desk.cancel("c")  # waiting: it never reaches the engine
    assert desk.cancel("a")  # running: the next in line starts at once
    assert engine.held == ["b"] and "c" not in _answers(sent)
    assert desk.load().active == 1 and desk.load().queued == 0


def test_a_spawned_worker_has_no_cap_of_its_own() -> None:
    desk, engine, sent = _desk(max_jobs=0, max_queue=0)
    for rid in "abcdefgh":
        desk.generate(_job(rid))
    assert len(engine.held) == 8 and all(v == "Accepted" for v in _answers(sent).values())


def _handle(load: WorkerLoad | None) -> WorkerHandle:
    model = ModelConfig(name="m", engine="transformers", path="/x", remote=True)  # type: ignore[arg-type]
    return WorkerHandle(id="m@a", model=model, remote=True, load=load)


def test_a_gateway_gets_the_cap_less_the_other_gateways_jobs() -> None:
    assert _handle(None).slot_limit(8) == 8  # no report yet: the configured limit
    assert _handle(WorkerLoad(3, 0, 0, 0, 0)).slot_limit(8) == 8  # a spawned worker: no cap of its own
    shared = _handle(WorkerLoad(active=4, queued=1, max_jobs=4, max_queue=2, yours=1))
    assert shared.others_jobs == 4 and shared.slot_limit(8) == 0
    assert _handle(WorkerLoad(active=3, queued=0, max_jobs=4, max_queue=0, yours=2)).slot_limit(8) == 3
