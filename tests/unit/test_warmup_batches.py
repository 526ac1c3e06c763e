"""The batch warm-up's plan: which batch sizes each exllama engine warms, and the prompts it runs.

Runs in the pytest process; the engines are built, never loaded (no GPU, no library import).
"""

from __future__ import annotations

from pathlib import Path

from model_worker.engines.base import WarmsBatches
from model_worker.engines.registry import create_engine
from model_worker.warmup import batch_prompts


def unloaded(engine: str, tmp_path: Path, **settings: object) -> WarmsBatches:
    built = create_engine(engine, str(tmp_path), 4096, {"max_chunk_size": 2048, **settings})
    assert isinstance(built, WarmsBatches)
    return built


def test_exllamav3_warms_each_graphed_batch_size_then_its_largest_batch(tmp_path: Path) -> None:
    assert unloaded("exllamav3", tmp_path, max_batch_size=64).warmup_batches() == [2, 3, 4, 5, 6, 7, 8, 64]
    assert unloaded("exllamav3", tmp_path, max_batch_size=4).warmup_batches() == [2, 3, 4]
    assert unloaded("exllamav3", tmp_path, max_batch_size=1).warmup_batches() == []
    assert unloaded("exllamav3", tmp_path).prefill_chunk_tokens() == 2048


def test_exllamav2_warms_only_its_largest_batch_once_paged(tmp_path: Path) -> None:
    engine = unloaded("exllamav2", tmp_path, max_batch_size=16)
    assert engine.warmup_batches() == []  # not loaded yet: unpaged until the load says otherwise
    engine.paged = True  # type: ignore[attr-defined]
    assert engine.warmup_batches() == [16]


def test_batch_prompts_differ_and_the_largest_batch_fills_more_than_a_chunk() -> None:
    short = list(range(100, 160))  # 60 tokens
    small = batch_prompts(short, 4, chunk=2048, max_seq_len=4096, fill_chunk=False)
    assert [len(p) for p in small] == [60] * 4
    assert len({tuple(p) for p in small}) == 4
    for size in (8, 64):
        largest = batch_prompts(short, size, chunk=2048, max_seq_len=4096, fill_chunk=True)
        assert len(largest) == size
        assert sum(len(p) for p in largest) > 2048
        assert len({tuple(p[:60]) for p in largest}) == min(size, 60)
    # Never past a quarter of the context per prompt, even when the chunk cannot be filled then.
    capped = batch_prompts(short, 2, chunk=2048, max_seq_len=1024, fill_chunk=True)
    assert [len(p) for p in capped] == [256, 256]
