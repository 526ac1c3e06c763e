"""Which kind of change a registry reload makes to each model (gateway.workers.worker_settings):
`changed` where its workers read or depend on what differs (they are restarted), `retuned` where
only the gateway reads it (applied in place). Every field of a model's entry is in one of the two
tables below, so a new field cannot land on either side without a decision."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.config.models import ModelConfig, ModelLimits
from gateway.workers.worker_settings import CHANGE_KINDS, reload_changes

BASE: dict[str, Any] = {"name": "m", "engine": "transformers", "path": Path("/models/m"), "max_seq_len": 2048}

# Field -> a different value, and the kind of change it makes to a local (spawned) model.
FIELDS: dict[str, tuple[Any, str]] = {
    "engine": ("exllamav2", "changed"),
    "path": (Path("/models/other"), "changed"),
    "gpus": ([1], "changed"),
    "max_seq_len": (1024, "changed"),
    "replicas": (2, "changed"),
    "replica_gpus": ([[0]], "changed"),
    "aliases": (["other-name"], "retuned"),
    "defaults": ({"temperature": 0.5}, "retuned"),
    "chat_template": ("{{ messages }}", "changed"),
    "remote": (True, "changed"),
    "load": ("on_demand", "changed"),
    "idle_unload_s": (30.0, "retuned"),
    "engine_settings": ({"max_batch_size": 4}, "changed"),
    "env": ({"OMP_NUM_THREADS": "1"}, "changed"),
    "exclusive_group": ("g", "changed"),
    "task": ("embed", "changed"),
    "tool_call_parser": ("hermes", "retuned"),
    "reasoning_parser": ("qwen3", "retuned"),
    "fallbacks": (["b"], "retuned"),
}
# limits.<field> -> a different value, and the kind for a local model and for a remote one (a
# remote worker reads its capacity from its own copy of the file; a spawned one has none: the
# gateway admits for it).
LIMITS: dict[str, tuple[Any, str, str]] = {
    "max_concurrent_jobs": (2, "retuned", "changed"),
    "max_queued_requests": (3, "retuned", "retuned"),
    "worker_queued_jobs": (4, "retuned", "changed"),
    "max_queued_prompt_tokens": (10, "retuned", "retuned"),
    "admission_window_ms": (5.0, "changed", "changed"),
    "burst_gather_ms": (123.0, "changed", "changed"),
    "request_timeout_s": (5.0, "retuned", "retuned"),
    "full_queue_status": (503, "retuned", "retuned"),
    "priority_aging_s": (1.0, "retuned", "retuned"),
    "max_constraint_states": (100, "changed", "changed"),
    "max_constraint_compile_s": (1.0, "changed", "changed"),
    "wedge_timeout_s": (30.0, "retuned", "retuned"),
}


def _model(**fields: Any) -> ModelConfig:
    return ModelConfig.model_validate({**BASE, **fields})


def _kind(old: ModelConfig, new: ModelConfig) -> str:
    changes = reload_changes([old], [new])
    kinds = [kind for kind, names in changes.items() if old.name in names]
    assert len(kinds) == 1, changes
    return kinds[0]


def test_every_field_of_a_model_entry_has_a_kind() -> None:
    assert set(FIELDS) == set(ModelConfig.model_fields) - {"name", "limits"}
    assert set(LIMITS) == set(ModelLimits.model_fields)


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_a_local_models_field_restarts_its_workers_only_if_they_read_it(field: str) -> None:
    value, kind = FIELDS[field]
    assert _kind(_model(), _model(**{field: value})) == kind


@pytest.mark.parametrize("field", sorted(LIMITS))
def test_a_limit_restarts_the_workers_that_read_it(field: str) -> None:
    value, local, remote = LIMITS[field]
    assert _kind(_model(), _model(limits={field: value})) == local
    assert _kind(_model(remote=True), _model(remote=True, limits={field: value})) == remote


def test_gateway_only_changes_together_are_still_retuned_and_one_worker_setting_makes_them_changed() -> None:
    gateway_only = {"aliases": ["a"], "limits": {"max_queued_requests": 1, "request_timeout_s": 9.0}}
    assert _kind(_model(), _model(**gateway_only)) == "retuned"
    assert _kind(_model(), _model(**gateway_only, max_seq_len=1024)) == "changed"


def test_the_same_gpus_spelled_per_replica_are_no_change_for_the_workers() -> None:
    assert _kind(_model(gpus=[0]), _model(replica_gpus=[[0]])) == "retuned"


def test_a_remote_model_is_changed_only_where_its_listening_workers_read_it() -> None:
    # Its capacity is the worker's own to enforce (several gateways share it), so it is read there.
    remote = _model(remote=True)
    assert _kind(remote, _model(remote=True, aliases=["a"])) == "retuned"
    assert _kind(remote, _model(remote=True, max_seq_len=1024)) == "changed"
    assert _kind(remote, _model(remote=True, limits={"max_concurrent_jobs": 3})) == "changed"


def test_models_are_sorted_under_every_kind() -> None:
    old = [_model(name="keep"), _model(name="gone"), _model(name="tune"), _model(name="swap")]
    new = [
        _model(name="keep"),
        _model(name="tune", aliases=["t"]),
        _model(name="swap", max_seq_len=1024),
        _model(name="new"),
    ]
    changes = reload_changes(old, new)
    assert tuple(changes) == CHANGE_KINDS
    assert changes == {
        "added": ["new"],
        "removed": ["gone"],
        "changed": ["swap"],
        "retuned": ["tune"],
        "unchanged": ["keep"],
    }
