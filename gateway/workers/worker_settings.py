"""What a model's workers read from its registry entry, and so what a registry reload does to each model.

Runs in the gateway process (a reload's plan, on every gateway; the cluster leader's reload steps,
gateway.workers.reload_plan); pure: no I/O, no clock. Owns the line between the settings a model's
workers depend on and those only the gateway reads, and the kinds of change a reload reports:

- `added` and `removed`: models only in the new file, or only in the running one;
- `changed`: a setting its workers depend on differs, so its workers are drained and restarted.
  For a spawned worker that is its spec (engine, path, max_seq_len, engine_settings, chat_template,
  env, task, the limits the worker reads: constraint budgets, admission_window_ms, burst_gather_ms),
  the GPUs of each replica (their count included), and how the gateway runs its processes (`remote`,
  `load`, `exclusive_group`); for a remote worker what it reads from its own copy of the file
  (`worker_settings`, its capacity included);
- `retuned`: only what the gateway reads differs (aliases, sampling defaults, queue and admission
  limits, timeouts, idle_unload_s, parsers, fallbacks): applied in place, its workers keep running;
- `unchanged`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from gateway.config.models import ModelConfig
from gateway.config.registry import worker_spec

CHANGE_KINDS = ("added", "removed", "changed", "retuned", "unchanged")
# `load` decides whether the gateway starts the worker at all, and `exclusive_group` which other
# models must be gone before it starts (gateway.workers.loads): changed in place, a running worker
# would break the rule (two models of a group loaded at once) or an unloaded one would never start.
HOW_IT_RUNS = ("remote", "load", "exclusive_group")


def _spec_settings(model: ModelConfig) -> dict[str, Any]:
    settings = asdict(worker_spec(model, 0.0))
    del settings["heartbeat_interval_s"], settings["heartbeat_timeout_s"]  # the server section's
    return settings


def worker_settings(model: ModelConfig) -> dict[str, Any]:
    """What a listening worker reads from the model's entry (model_worker.remote_spec)."""
    settings = _spec_settings(model)
    settings["max_jobs"] = model.limits.max_concurrent_jobs
    settings["max_queue"] = model.limits.worker_queued_jobs
    return settings


def spawned_worker_settings(model: ModelConfig) -> dict[str, Any]:
    """What a worker this gateway spawns reads (its spec, with no capacity of its own: the gateway
    admits for it) and what its process is given: each replica's GPUs (CUDA_VISIBLE_DEVICES)."""
    settings = _spec_settings(model)
    settings["replica_gpus"] = [model.gpus_of_replica(r) for r in range(model.replicas)]
    return settings


def restarts_workers(old: ModelConfig, new: ModelConfig) -> bool:
    """Whether going from `old` to `new` (one model's entries) needs the model's workers restarted."""
    if any(getattr(old, name) != getattr(new, name) for name in HOW_IT_RUNS):
        return True
    read = worker_settings if new.remote else spawned_worker_settings
    return read(old) != read(new)


def reload_changes(old: list[ModelConfig], new: list[ModelConfig]) -> dict[str, list[str]]:
    """Each model name under its kind of change (CHANGE_KINDS), sorted. In cluster mode (every model
    remote) a changed model's listening workers keep serving too: they are not this gateway's to
    restart, and gateway.reloads asks the leader to restart them."""
    before = {m.name: m for m in old}
    after = {m.name: m for m in new}
    both = before.keys() & after.keys()
    differ = {n for n in both if before[n] != after[n]}
    changed = {n for n in differ if restarts_workers(before[n], after[n])}
    return {
        "added": sorted(after.keys() - before.keys()),
        "removed": sorted(before.keys() - after.keys()),
        "changed": sorted(changed),
        "retuned": sorted(differ - changed),
        "unchanged": sorted(both - differ),
    }
