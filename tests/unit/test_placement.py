"""Placement checks: missing GPUs and oversized models refuse the start; shared GPUs warn."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config.placement import GIB, Gpu, check_placement, discover_gpus, free_memory_bytes
from gateway.config.registry import parse_registry
from tests.harness import REPO_ROOT


def registry(tmp_path: Path, models: list[dict[str, object]]):  # type: ignore[no-untyped-def]
    return parse_registry({"models": models}, tmp_path / "models.yaml")


def model_folder(tmp_path: Path, name: str, size: int) -> str:
    folder = tmp_path / name
    folder.mkdir()
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(size)  # sparse: the size is what counts
    return str(folder)


H200 = [Gpu(0, "H200", 140 * GIB), Gpu(1, "H200", 140 * GIB)]


def test_fitting_models_pass_and_shared_gpus_warn(tmp_path: Path) -> None:
    small = model_folder(tmp_path, "small", 16 * GIB)
    reg = registry(
        tmp_path, [{"name": "a", "path": small, "gpus": [0]}, {"name": "b", "path": small, "gpus": [0]}]
    )
    errors, warnings = check_placement(reg, H200)
    assert errors == []
    assert warnings == ["GPU 0 is shared by models a, b; they compete for its memory"]


def test_missing_gpu_index_is_refused(tmp_path: Path) -> None:
    reg = registry(tmp_path, [{"name": "a", "path": "x", "gpus": [0, 2]}])
    errors, _ = check_placement(reg, H200)
    assert errors == ["model 'a': gpus [0, 2] but this host has 2 GPU(s) (0, 1); GPU 2 does not exist"]


def test_weights_larger_than_the_gpus_are_refused(tmp_path: Path) -> None:
    big = model_folder(tmp_path, "big", 150 * GIB)
    one_gpu = registry(tmp_path, [{"name": "big", "path": big, "gpus": [0]}])
    errors, _ = check_placement(one_gpu, H200)
    assert len(errors) == 1 and "150.0 GiB" in errors[0] and "140.0 GiB of gpus [0]" in errors[0]
    split = registry(tmp_path, [{"name": "big", "path": big, "gpus": [0, 1]}])
    assert check_placement(split, H200) == ([], [])


def test_serve_refuses_a_gpu_this_host_lacks(tmp_path: Path, demo_model_dir: Path) -> None:
    config = tmp_path / "models.yaml"
    config.write_text(f"models:\n  - {{name: m, engine: transformers, path: {demo_model_dir}, gpus: [7]}}\n")
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", "0"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
    )
    assert result.returncode == 2
    assert "model 'm': gpus [7]" in result.stderr and "GPU 7 does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_without_nvml_the_gpus_are_read_from_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This host has neither NVML nor a GPU: a stand-in `nvidia-smi` on PATH answers the two
    queries the gateway makes, in the CLI's own CSV format."""
    script = tmp_path / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        '  --query-gpu=index,name,memory.total) printf "0, GPU A, 143771\\n1, GPU B, 80\\n" ;;\n'
        '  --query-gpu=index,memory.free) printf "0, 1024\\n1, 2048.0\\n" ;;\n'
        "  *) exit 3 ;;\n"
        "esac\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert discover_gpus() == [
        Gpu(0, "GPU A", 143771 * 1024**2),
        Gpu(1, "GPU B", 80 * 1024**2),
    ]
    assert free_memory_bytes([1]) == {1: 2048 * 1024**2}
    script.write_text("#!/bin/sh\nexit 9\n")  # a failing CLI reads as no information
    assert discover_gpus() == [] and free_memory_bytes([0]) is None
