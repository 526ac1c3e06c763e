"""A mixed registry on a two-GPU host: an exllamav2 model on GPU 0 and an exllamav3 model on GPU 1.

Runs in the pytest process on a host with two GPUs; one gateway (tests.harness) serves both
models, each from its own worker process pinned to its own GPU. Both serve at once, and neither
slows the other: each keeps at least 75% of its own throughput while the other is busy, median of
three interleaved rounds (two workers that were serialized, or fought over one GPU, would each drop
to about half). The exact
ratio is measured by bench/bench_engines.py's two-GPU scenario.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.gpu.support import SKIP_REASON, record, stream_completion

if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import httpx  # noqa: E402
import torch  # noqa: E402

from tests.gpu.conftest import require_mode  # noqa: E402
from tests.gpu.support import registry_entry as entry  # noqa: E402
from tests.gpu.support import start_gateway as start  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village,"
STREAMS, TOKENS, ROUNDS = 4, 192, 3


def throughput(url: str, model: str) -> float:
    """Total tok/s of STREAMS concurrent greedy streams of TOKENS tokens on one model."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}

    def one(_: int) -> int:
        with httpx.Client(base_url=url) as http:
            result = stream_completion(http, "/v1/completions", body)
        assert result.usage is not None and result.finish_reason == "length"
        return int(result.usage["completion_tokens"])

    started = time.perf_counter()
    with ThreadPoolExecutor(STREAMS) as pool:
        tokens = sum(pool.map(one, range(STREAMS)))
    assert tokens == STREAMS * TOKENS
    return tokens / (time.perf_counter() - started)


def test_exllamav2_and_exllamav3_models_serve_side_by_side(big_model: Path, tmp_path: Path) -> None:
    require_mode("exllamav2-paged")
    require_mode("exllamav3")
    settings = dict(max_seq_len=4096, max_chunk_size=2048)
    models = [entry("v2", big_model, [0], "exllamav2-paged", **settings),
              entry("v3", big_model, [1], "exllamav3", **settings)]  # fmt: skip
    with start(tmp_path, models) as gw:
        workers = {w["model"]: w for w in gw.workers()}
        assert (
            workers["v2"]["info"]["engine"] == "exllamav2" and workers["v3"]["info"]["engine"] == "exllamav3"
        )
        assert [d["visible_as"] for d in workers["v2"]["info"]["devices"]] == ["0"]
        assert [d["visible_as"] for d in workers["v3"]["info"]["devices"]] == ["1"]
        for name in ("v2", "v3"):  # one round each first: nothing one-time in the measurement
            throughput(gw.url, name)
        # Interleaved rounds, medians: on a virtual host one round's speed can move by a third
        # (docs/benchmarks.md), so a single round would judge the host, not the serving.
        alone: dict[str, list[float]] = {"v2": [], "v3": []}
        both: dict[str, list[float]] = {"v2": [], "v3": []}
        for _ in range(ROUNDS):
            for name in ("v2", "v3"):
                alone[name].append(throughput(gw.url, name))
            with ThreadPoolExecutor(2) as pool:
                together = pool.map(lambda n: throughput(gw.url, n), ("v2", "v3"))
                for name, tok_s in zip(("v2", "v3"), together, strict=True):
                    both[name].append(tok_s)
    ratios = {name: statistics.median(both[name]) / statistics.median(alone[name]) for name in alone}
    record("mixed registry 8B, 4 streams each", alone=alone, together=both, ratios=ratios)
    # Serialized workers, or two that fought over one GPU, would each keep about half.
    assert all(ratio >= 0.75 for ratio in ratios.values()), (alone, both)
