"""Helpers for the GPU tests: availability checks, engine drivers, SSE clients and a results log.

Runs in the pytest process on the GPU machine (and is imported, then skipped, everywhere else).
Owns nothing stateful: functions that drive an engine (exllamav2 or exllamav3) to completion,
compare batched runs with solo runs, stream OpenAI responses over HTTP, write registry files, and
append measurements to the JSON-lines file that `scripts/gpu_run.sh` turns into its closing table.
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

from tests.harness import wait_until
from wire.params import SamplingParams
from wire.results import JobOutput, TokenLogprob

TINY_SETTINGS: dict[str, Any] = dict(max_seq_len=2048, max_batch_size=8, max_chunk_size=512)
BIG_SETTINGS: dict[str, Any] = dict(max_seq_len=4096, max_batch_size=8, max_chunk_size=2048)
# mode -> (engine, engine_settings that select the mode)
ENGINE_MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "exllamav2-paged": ("exllamav2", {"paged": True}),
    "exllamav2-unpaged": ("exllamav2", {"paged": False}),
    "exllamav3": ("exllamav3", {}),
}
PAGED_MODES = ["exllamav2-paged", "exllamav3"]

# Batched and solo runs multiply matrices of different shapes, so fp16 rounding differs a little:
# greedy decoding may then pick the other of two tokens whose logprobs are this close.
NEAR_TIE = 0.05


def gpu_skip_reason() -> str | None:
    """Why GPU tests cannot run here, or None. Checks CUDA before any engine, whose import may build."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device visible"
    return None


SKIP_REASON = gpu_skip_reason()


def mode_unavailable(mode: str) -> str | None:
    """Why an engine mode (see conftest.ENGINE_MODES) cannot run here, or None."""
    engine = mode.split("-")[0]
    if importlib.util.find_spec(engine) is None:
        return f"{engine} is not installed"
    if mode == "exllamav2-paged":
        import exllamav2.attn

        if not exllamav2.attn.has_flash_attn_with_paged:
            return "flash-attn >= 2.5.7 is not installed, so exllamav2 cannot page"
    return None


def record(test: str, **values: Any) -> None:
    """Append one measurement for the run's summary table (no-op unless GPU_TEST_RESULTS is set)."""
    path = os.environ.get("GPU_TEST_RESULTS")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps({"test": test, **values}) + "\n")


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    """Greedy, ignoring EOS unless told otherwise."""
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
    def logprobs(self) -> list[TokenLogprob]:
        return [entry for o in self.outputs for entry in o.logprobs or []]

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


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_tokens(
    solo: list[int], solo_logprobs: list[TokenLogprob], other: list[int], what: str
) -> int:
    """`other` (a batched or drafting run) must give `solo`'s tokens; where it first differs, the
    solo run's top two tokens must have been a near-tie (fp16 rounding of another batch shape may
    then pick either; anything else, such as another job's tokens, fails). Returns how many tokens
    matched before any such tie."""
    at = first_difference(solo, other)
    if at is None:
        return len(solo)
    assert at < len(solo) and at < len(other), f"{what}: lengths differ ({len(other)} vs {len(solo)} solo)"
    top = solo_logprobs[at].top
    assert len(top) >= 2, "solo runs need logprobs >= 2 to judge ties"
    gap = top[0].logprob - top[1].logprob
    assert other[at] in (top[0].token_id, top[1].token_id) and gap < NEAR_TIE, (
        f"{what}: token {at} is {other[at]}, solo gave {solo[at]} with a top-2 gap of {gap:.3f} "
        f"(not a near-tie): {other[: at + 1]} vs {solo[: at + 1]}"
    )
    return at


def write_registry(path: Path, models: list[dict[str, Any]], **server: Any) -> Path:
    """A registry YAML (JSON is valid YAML) for GatewayProcess."""
    body = {"server": {"worker_start_timeout_s": 300, "shutdown_grace_s": 2, **server}, "models": models}
    path.parent.mkdir(parents=True, exist_ok=True)  # a test may give each gateway a folder of its own
    path.write_text(json.dumps(body, indent=2))
    return path


def registry_entry(
    name: str, path: Path, gpus: list[int], mode: str = "exllamav2-paged", **settings: Any
) -> dict[str, Any]:
    """A models.yaml entry serving `path` in an engine mode (settings: max_seq_len, engine_settings)."""
    engine, mode_settings = ENGINE_MODES[mode]
    max_seq_len = settings.pop("max_seq_len", TINY_SETTINGS["max_seq_len"])
    engine_settings = {"max_batch_size": 8, "max_chunk_size": 512, **mode_settings, **settings}
    return {"name": name, "engine": engine, "path": str(path), "gpus": gpus, "max_seq_len": max_seq_len,
            "engine_settings": engine_settings, "limits": {"max_concurrent_jobs": 32}}  # fmt: skip


def start_gateway(tmp_path: Path, models: list[dict[str, Any]]) -> Any:
    """A GatewayProcess (not yet entered) over a registry of `models` written to tmp_path."""
    from tests.harness import GatewayProcess

    config = write_registry(tmp_path / "models.yaml", models)
    return GatewayProcess(config, env=gateway_env(), ready_timeout=600, log_path=tmp_path / "gateway.log")


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
    """Poll /admin/workers until no worker holds an active or queued job; returns that view."""

    def idle() -> list[dict[str, Any]] | None:
        workers: list[dict[str, Any]] = gateway.workers()
        return workers if all(w["active_jobs"] == 0 and w["queued_jobs"] == 0 for w in workers) else None

    return wait_until(idle, "every worker to be idle", timeout)


def steps_by_request(trace_path: Path) -> list[dict[str, Any]]:
    """A worker's step trace (GATEWAY_STEP_TRACE) cut at each step that gave a job its first token,
    for requests sent one after another: per request, its steps, the medians of their wall, GPU
    and outside-the-step times (say whether a slow request was slow on the GPU, in the step's CPU
    work, or in the loop around it), and its longest step (where a one-time cost would sit)."""
    if not trace_path.exists():
        return []
    requests: list[list[dict[str, Any]]] = []
    for line in trace_path.read_text().splitlines():
        row = json.loads(line)
        if row.get("first") or not requests:
            requests.append([])
        requests[-1].append(row)

    def median(rows: list[dict[str, Any]], key: str) -> float | None:
        values = sorted(float(r[key]) for r in rows if r.get(key) is not None)
        return values[len(values) // 2] if values else None

    return [
        {
            "steps": len(rows),
            "step_ms": median(rows, "step_ms"),
            "gpu_ms": median(rows, "gpu_ms"),
            "outside_ms": median(rows, "outside_ms"),
            "longest_ms": max(
                (float(r["step_ms"]) for r in rows if r.get("step_ms") is not None), default=None
            ),
        }  # fmt: skip
        for rows in requests
    ]
