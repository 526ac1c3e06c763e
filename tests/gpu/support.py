"""Helpers for the GPU tests: availability check, engine drivers, SSE clients and a results log.

Runs in the pytest process on the GPU machine (and is imported, then skipped, everywhere else).
Owns nothing stateful: functions that drive an `ExLlamaV2Engine` to completion, stream OpenAI
responses over HTTP, write registry files, and append measurements to the JSON-lines file that
`scripts/gpu_run.sh` turns into its closing table.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from wire.params import SamplingParams
from wire.results import JobOutput


def gpu_skip_reason() -> str | None:
    """Why GPU tests cannot run here, or None. Checks CUDA before exllamav2, whose import may build."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device visible"
    if importlib.util.find_spec("exllamav2") is None:
        return "exllamav2 is not installed"
    return None


SKIP_REASON = gpu_skip_reason()


def record(test: str, **values: Any) -> None:
    """Append one measurement for the run's summary table (no-op unless GPU_TEST_RESULTS is set)."""
    path = os.environ.get("GPU_TEST_RESULTS")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps({"test": test, **values}) + "\n")


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=kw.pop("ignore_eos", True), **kw)


@dataclass
class JobRun:
    """Everything one job produced, with the arrival time of each output."""

    outputs: list[JobOutput] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    submitted: float = 0.0

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outputs)

    @property
    def token_ids(self) -> list[int]:
        return [t for o in self.outputs for t in o.token_ids]

    @property
    def final(self) -> JobOutput:
        assert self.outputs and self.outputs[-1].finish_reason is not None, "job did not finish"
        return self.outputs[-1]

    @property
    def seconds(self) -> float:
        return self.times[-1] - self.submitted


def run_jobs(
    engine: Any, jobs: dict[str, tuple[list[int], SamplingParams]], max_steps: int = 100_000
) -> dict[str, JobRun]:
    """Submit every job at once and step the engine until all have finished."""
    runs = {rid: JobRun() for rid in jobs}
    for rid, (prompt_ids, params) in jobs.items():
        runs[rid].submitted = time.perf_counter()
        engine.submit(rid, prompt_ids, params)
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for output in engine.step():
            runs[output.rid].outputs.append(output)
            runs[output.rid].times.append(time.perf_counter())
    assert not engine.has_work(), "engine still busy after max_steps"
    return runs


def run_job(engine: Any, prompt_ids: list[int], params: SamplingParams, rid: str = "job") -> JobRun:
    return run_jobs(engine, {rid: (prompt_ids, params)})[rid]


def write_registry(path: Path, models: list[dict[str, Any]], **server: Any) -> Path:
    """A registry YAML (JSON is valid YAML) for GatewayProcess."""
    body = {"server": {"worker_start_timeout_s": 300, "shutdown_grace_s": 2, **server}, "models": models}
    path.write_text(json.dumps(body, indent=2))
    return path


def gateway_env() -> dict[str, str]:
    """The harness sets PYTHONPATH to the repo; keep the carried wheels and extension beside it."""
    repo = str(Path(__file__).resolve().parents[2])
    extra = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": f"{repo}:{extra}" if extra else repo}


@dataclass
class StreamResult:
    text: str
    chunk_times: list[float]
    started: float
    finish_reason: str | None
    usage: dict[str, Any] | None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.started

    @property
    def seconds(self) -> float:
        return self.chunk_times[-1] - self.started


def stream_completion(
    client: httpx.Client, url: str, body: dict[str, Any], max_chunks: int | None = None
) -> StreamResult:
    """POST with stream=true and read the SSE events; stop early (closing the socket) after max_chunks."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    pieces: list[str] = []
    times: list[float] = []
    finish: str | None = None
    usage: dict[str, Any] | None = None
    with client.stream("POST", url, json=body, timeout=300) as response:
        assert response.status_code == 200, response.read().decode()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            assert "error" not in event, event
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if piece:
                    pieces.append(piece)
                    times.append(time.perf_counter())
                finish = choice.get("finish_reason") or finish
            if max_chunks is not None and len(times) >= max_chunks:
                break
    return StreamResult("".join(pieces), times, started, finish, usage)


def wait_idle(gateway: Any, timeout: float = 10.0) -> list[dict[str, Any]]:
    """Poll /admin/workers until no worker holds an active or queued job; returns the last view."""
    deadline = time.monotonic() + timeout
    workers: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        workers = gateway.workers()
        if all(w["active_jobs"] == 0 and w["queued_jobs"] == 0 for w in workers):
            return workers
        time.sleep(0.1)
    raise AssertionError(f"workers still busy after {timeout}s: {workers}")
