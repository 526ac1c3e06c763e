"""bench/bench_first_bursts.py: the whole benchmark on the CPU engine with the demo model (a process
of its own, the worker's warm-up, two sweeps of bursts), its shape parsing, and how it reads what
Triton compiled from a cache directory. Runs in the test process, the benchmark as a child."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.bench_first_bursts import burst_shapes, compiled_kernels

REPO = Path(__file__).resolve().parents[2]


def test_each_shape_runs_twice_after_the_workers_warm_up(demo_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "first_bursts.json"
    subprocess.run(
        [sys.executable, "bench/bench_first_bursts.py", "--engine", "transformers", "--model",
         str(demo_model_dir), "--shapes", "1x20,3x700", "--out", str(out)],
        cwd=REPO, check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert report["warm_up"] == "worker" and report["warm_up_s"] > 0
    assert report["fresh_triton_cache"] is True
    assert [row["shape"] for row in report["shapes"]] == ["1x20", "3x700"]
    for row in report["shapes"]:
        for sweep in ("first", "second"):
            burst = row[sweep]
            assert (
                burst["prompt_tokens"] == [int(row["shape"].split("x")[1])] * 2
            )  # every prompt as long as asked
            assert burst["steps"] == 4  # one step per new token: every job of a burst ran together
            assert 0 < burst["first_step_ms"] <= burst["burst_ms"]
            assert burst["compiled"] == []  # no Triton on a CPU
        assert row["ratio"] == pytest.approx(row["first"]["burst_ms"] / row["second"]["burst_ms"], abs=1e-3)


def test_a_kept_cache_directory_counts_what_an_earlier_run_left_and_lists_only_new_kernels(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """--triton-cache: a second run with the directory of a first (a worker restarted on the same
    host) finds that run's kernels there; they are counted at start, not listed as compiled."""
    cache = tmp_path / "triton"
    (cache / "HASH1").mkdir(parents=True)
    (cache / "HASH1" / "split.json").write_text(json.dumps({"name": "split", "num_warps": 4}))
    out = tmp_path / "first_bursts.json"
    subprocess.run(
        [sys.executable, "bench/bench_first_bursts.py", "--engine", "transformers", "--model",
         str(demo_model_dir), "--shapes", "1x20", "--triton-cache", str(cache), "--out", str(out)],
        cwd=REPO, check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert report["fresh_triton_cache"] is False and report["kernels_in_cache_at_start"] == 1
    assert report["compiled_before_bursts"] == []
    assert all(row[sweep]["compiled"] == [] for row in report["shapes"] for sweep in ("first", "second"))
    assert (cache / "HASH1" / "split.json").exists()  # kept, not emptied


def test_shapes_are_jobs_by_prompt_tokens() -> None:
    assert burst_shapes("25x151, 64x33") == [(25, 151), (64, 33)]
    for bad in ("25", "25x", "0x151", "4x1", "ax151", "4x151,"):
        with pytest.raises(argparse.ArgumentTypeError):
            burst_shapes(bad)


def test_a_shape_past_the_batch_size_is_refused(demo_model_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "bench/bench_first_bursts.py", "--engine", "transformers", "--model",
         str(demo_model_dir), "--shapes", "65x20"],
        cwd=REPO, timeout=120, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2
    assert "more jobs than --max-batch-size" in done.stderr


def test_compiled_kernels_are_the_new_metadata_files_of_the_cache(tmp_path: Path) -> None:
    seen: set[Path] = set()
    kernel = tmp_path / "HASH1"
    kernel.mkdir()
    metadata = {"name": "split", "num_warps": 4, "num_stages": 2, "shared": 512}
    (kernel / "split.json").write_text(json.dumps(metadata))
    (kernel / "__grp__split.json").write_text("{}")  # Triton's index of a kernel's files, not a kernel
    assert compiled_kernels(str(tmp_path), seen) == ["split (4, 2, 512)"]
    assert compiled_kernels(str(tmp_path), seen) == []  # only what is new since the last look
    other = tmp_path / "HASH2"
    other.mkdir()
    (other / "combine.json").write_text(json.dumps({"name": "combine", "num_warps": 4, "num_stages": 1}))
    assert compiled_kernels(str(tmp_path), seen) == ["combine (4, 1, None)"]
