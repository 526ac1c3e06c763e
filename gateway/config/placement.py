"""Placement checks before any worker starts: do the configured GPUs exist, and can the models fit?

Runs in the gateway process (`gateway serve`, before binding). Owns GPU discovery for the gateway,
which never imports torch: NVML through nvidia-ml-py when installed, else `nvidia-smi`, else none.
Problems that make a model impossible to start (a GPU index that does not exist, weights larger
than the memory of the GPUs given) refuse the start; models sharing a GPU only warn.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from gateway.config.models import ModelConfig
from gateway.config.registry import Registry

logger = logging.getLogger(__name__)
GIB = 1024**3


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_total_bytes: int


def discover_gpus() -> list[Gpu]:
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            gpus = []
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                name = pynvml.nvmlDeviceGetName(handle)
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                gpus.append(Gpu(index, name.decode() if isinstance(name, bytes) else name, int(memory.total)))
            return gpus
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library, no driver, or no package: try the CLI, then assume none
        logger.debug("NVML unavailable", exc_info=True)
    rows = nvidia_smi_rows("index,name,memory.total")
    return [Gpu(int(index), name, int(float(mib)) * 1024**2) for index, name, mib in rows or []]


def free_memory_bytes(indices: list[int]) -> dict[int, int] | None:
    """Free memory of these GPUs now, by index; None when it cannot be read (no NVML, no nvidia-smi)."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            free = {}
            for index in indices:
                memory = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
                free[index] = int(memory.free)
            return free
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        logger.debug("NVML unavailable", exc_info=True)
    rows = nvidia_smi_rows("index,memory.free")
    if rows is None:
        return None
    return {int(index): int(float(mib)) * 1024**2 for index, mib in rows if int(index) in indices}


def nvidia_smi_rows(fields: str) -> list[list[str]] | None:
    """`nvidia-smi --query-gpu=FIELDS` as rows of stripped values, one per GPU; None when the CLI is
    missing or fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return [[part.strip() for part in line.split(",")] for line in out.strip().splitlines()]


def memory_shortfall(model: ModelConfig, gpus: list[int], free: dict[int, int]) -> str | None:
    """Why the model's weights do not fit in the free memory of `gpus` now, or None if they do."""
    available = sum(free.get(g, 0) for g in gpus) - int(model.reserve_vram_gb * GIB) * len(gpus)
    needed = weights_bytes(model)
    if needed <= available:
        return None
    listed = ", ".join(f"GPU {g}: {free.get(g, 0) / GIB:.1f} GiB free" for g in gpus)
    return (
        f"not enough free GPU memory to load model {model.name!r}: its weights take {needed / GIB:.1f} GiB "
        f"({listed}); unload another model or put it in an exclusive_group with the models it displaces"
    )


def weights_bytes(model: ModelConfig) -> int:
    """On-disk size of the weights; quantized and FP16 weights load at about their file size."""
    total = 0
    for folder in model.weight_dirs:
        try:
            total += sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
        except OSError:  # no such folder here (or a name too long to be one): the path check says so
            continue
    return total


def _check_replica(
    model: ModelConfig,
    replica_gpus: list[int],
    gpus: list[Gpu],
    by_index: dict[int, Gpu],
    users: dict[int, list[str]],
) -> list[str]:
    missing = [g for g in replica_gpus if g not in by_index]
    if missing:
        listed = f" ({', '.join(str(g.index) for g in gpus)})" if gpus else ""
        return [
            f"model {model.name!r}: gpus {replica_gpus} but this host has {len(gpus)} GPU(s){listed}; "
            f"GPU {missing[0]} does not exist"
        ]
    for index in replica_gpus:
        users.setdefault(index, []).append(model.name)
    if not replica_gpus:
        return []
    available = sum(by_index[g].memory_total_bytes for g in replica_gpus) - model.reserve_vram_gb * GIB * len(
        replica_gpus
    )
    needed = weights_bytes(model)
    if needed > available:
        return [
            f"model {model.name!r}: its weights alone take {needed / GIB:.1f} GiB, more than the "
            f"{available / GIB:.1f} GiB of gpus {replica_gpus}; add GPUs or use a smaller quantization"
        ]
    return []


def check_placement(registry: Registry, gpus: list[Gpu]) -> tuple[list[str], list[str]]:
    """(errors, warnings) for the registry on these GPUs."""
    errors: list[str] = []
    warnings: list[str] = []
    by_index = {gpu.index: gpu for gpu in gpus}
    users: dict[int, list[str]] = {}
    for model in registry.models:
        if model.remote:
            continue  # its GPUs are on the hosts its workers run on
        for replica in range(model.replicas):
            errors += _check_replica(model, model.gpus_of_replica(replica), gpus, by_index, users)
    for index, names in sorted(users.items()):
        if len(names) > 1:
            warnings.append(
                f"GPU {index} is shared by models {', '.join(names)}; they compete for its memory"
            )
    return errors, warnings
