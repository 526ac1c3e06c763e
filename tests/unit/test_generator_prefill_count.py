"""model_worker/engines/dynamic_generator.py: the prompt tokens the exllama engines count as
prefilled, from their libraries' "prefill" results (each a job's running progress over its prompt),
as the per-step trace reads them. Runs in the test process with a stand-in generator that returns
result dictionaries shaped as both libraries document them; no GPU, no library."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from model_worker.engines.base import CountsPrefill
from model_worker.engines.dynamic_generator import DynamicGeneratorEngine, GeneratorJob


class ScriptedGenerator:
    """Returns the next scripted list of results at each iterate()."""

    def __init__(self, steps: list[list[dict[str, Any]]]) -> None:
        self.steps = steps
        self.active_jobs: list[Any] = []

    def iterate(self) -> list[dict[str, Any]]:
        return self.steps.pop(0)


def _prefill(rid: str, progress: int, total: int) -> dict[str, Any]:
    return {"stage": "prefill", "identifier": rid, "eos": False, "curr_progress": progress,
            "max_progress": total}  # fmt: skip


def test_prefill_progress_reports_add_up_to_the_prompt_tokens_each_step_read() -> None:
    engine = DynamicGeneratorEngine("unused", 4096, SimpleNamespace(max_chunk_size=2048))
    assert isinstance(engine, CountsPrefill)
    engine._jobs = {rid: GeneratorJob(object(), 3000, None) for rid in ("a", "b")}
    engine.generator = ScriptedGenerator([
        [_prefill("a", 2048, 2999)],
        [_prefill("a", 2999, 2999), _prefill("b", 1000, 2999)],  # a finishes, b starts, one step
        [_prefill("b", 2999, 2999), _prefill("gone", 512, 512)],  # a job no longer ours: not counted
    ])  # fmt: skip
    counts = []
    for _ in range(3):
        before = engine.prefill_tokens()
        assert engine.step() == []
        counts.append(engine.prefill_tokens() - before)
    assert counts == [2048, 951 + 1000, 1999]
    assert engine.prefill_tokens() == 2 * 2999


class PagedEngine(DynamicGeneratorEngine):
    def _page_size(self) -> int:
        return 256


def _token(rid: str, token: int) -> dict[str, Any]:
    import torch

    return {"stage": "streaming", "identifier": rid, "eos": False, "token_ids": torch.tensor([[token]]),
            "text": "x"}  # fmt: skip


def test_prompt_tokens_found_in_the_cache_count_once_when_each_jobs_first_token_comes() -> None:
    """a reused two whole pages and 30 tokens of a third (both libraries count them so on the
    job); b found nothing. Each is counted in the step of its first token, and never again."""
    engine = PagedEngine("unused", 4096, SimpleNamespace(max_chunk_size=2048))
    found = {"a": SimpleNamespace(cached_pages=2, cached_tokens=30),
             "b": SimpleNamespace(cached_pages=0, cached_tokens=0)}  # fmt: skip
    engine._jobs = {rid: GeneratorJob(job, 600, None) for rid, job in found.items()}
    engine.generator = ScriptedGenerator([
        [_prefill("a", 600, 600), _token("a", 5)],
        [_token("a", 6), _prefill("b", 600, 600), _token("b", 7)],
        [_token("a", 8), _token("b", 9)],
    ])  # fmt: skip
    counts = []
    for _ in range(3):
        before = engine.cached_prompt_tokens()
        assert len(engine.step()) >= 1
        counts.append(engine.cached_prompt_tokens() - before)
    assert counts == [2 * 256 + 30, 0, 0]
