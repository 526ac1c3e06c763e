"""The GPUs this process sees: name, UUID, memory, and the host index it was pinned to.

Runs in a worker process (after CUDA_VISIBLE_DEVICES is set). Shared by the engines for their
ready message and /admin/workers; torch is imported on call.
"""

from __future__ import annotations

import os

from wire.stats import DeviceInfo


def cuda_devices() -> list[DeviceInfo]:
    """Name, UUID and device-wide memory of each GPU this process sees (CUDA_VISIBLE_DEVICES applies)."""
    import torch

    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        uuid = str(getattr(props, "uuid", ""))
        free, total = torch.cuda.mem_get_info(index)
        devices.append(
            DeviceInfo(
                index=index,
                # The host's GPU index, as the gateway pinned it through CUDA_VISIBLE_DEVICES.
                visible_as=visible[index] if index < len(visible) else str(index),
                name=props.name,
                uuid=uuid if not uuid or uuid.startswith("GPU-") else f"GPU-{uuid}",
                memory_used_mib=round((total - free) / 2**20),
                memory_total_mib=round(total / 2**20),
            )
        )
    return devices


def gpu_memory_used_bytes() -> dict[str, int]:
    """Device-wide memory in use per visible GPU, keyed by the host's GPU index (for heartbeats)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    used = {}
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        used[visible[index] if index < len(visible) else str(index)] = int(total - free)
    return used
