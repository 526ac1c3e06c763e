"""What stops a registry's local models from starting on this host: the checks that `gateway
check-config` prints and that a registry reload must pass before it changes anything.

Runs in the gateway process (a reload, off its event loop: these read the disk and may run
nvidia-smi) or a short-lived CLI process (check-config, serve). Owns nothing: pure checks of a
validated Registry against this host's folders, model cache and GPUs.
"""

from __future__ import annotations

import os
from pathlib import Path

from gateway.config.hub import is_downloaded
from gateway.config.hub import offline as hub_offline
from gateway.config.placement import check_placement, discover_gpus
from gateway.config.registry import Registry


def runtime_dir_problem(registry: Registry) -> str | None:
    """Why server.runtime_dir cannot hold the workers' socket on this host, or None."""
    folder = registry.server.runtime_dir
    if folder is None:
        return None
    where = f"server, field 'runtime_dir': {folder}"
    existing = next((p for p in (folder, *folder.absolute().parents) if p.exists()), None)
    if existing == folder and not folder.is_dir():
        return f"{where} exists and is not a folder"
    if existing is not None and existing != folder and not os.access(existing, os.W_OK | os.X_OK):
        return f"{where} cannot be made: {existing} is not writable"
    return None


def host_problems(registry: Registry) -> list[str]:
    """What stops this registry from starting on this host: model folders that are missing, GPU
    indices it does not have, weights larger than their GPUs. Remote models are checked on theirs."""
    problems = []
    for model in registry.models:
        if model.remote:
            continue
        if model.hub is not None:
            if not is_downloaded(model.path) and hub_offline():
                problems.append(
                    f"model {model.name!r}, field 'path': {model.hub} is not in the model cache "
                    f"({model.path}) and this host is offline (HF_HUB_OFFLINE=1)"
                )
        elif not is_folder(model.path):
            problems.append(f"model {model.name!r}, field 'path': {model.path} is not a folder on this host")
    runtime_dir = runtime_dir_problem(registry)
    if runtime_dir is not None:
        problems.append(runtime_dir)
    if any(model.gpus or model.replica_gpus for model in registry.models if not model.remote):
        errors, _ = check_placement(registry, discover_gpus())
        problems += errors
    return [f"{registry.source}: {problem}" for problem in problems]


def is_folder(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a name too long for this file system: no folder either
        return False
