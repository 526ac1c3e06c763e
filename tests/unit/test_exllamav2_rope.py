"""transformers 5's nested `rope_parameters`, read for exllamav2 0.3.2 (which reads only the old keys).

Runs in the pytest process without exllamav2 or a GPU: the reader works on config.json as JSON and
names ExLlamaV2Config attributes; `gateway check-config` runs the same reader at config time, in
its settings-check process, on a real registry file and model folder.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from model_worker.engines.exllamav2.rope import RopeConfigError, apply_rope_parameters, rope_overrides
from tests.harness import REPO_ROOT

# As transformers 5 saves them (SmolLM2-135M and Llama 3.1 8B).
SMOLLM2 = {"model_type": "llama", "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
LLAMA31 = {
    "model_type": "llama",
    "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    },
}  # fmt: skip


def test_nested_theta_is_used_where_exllamav2_would_fall_back_to_10000() -> None:
    assert rope_overrides(SMOLLM2) == {"rotary_embedding_base": 100000.0}


def test_files_exllamav2_reads_itself_need_nothing() -> None:
    assert rope_overrides({"rope_theta": 500000.0}) == {}  # transformers 4 layout
    agreeing = {"rope_theta": 1e5, "rope_parameters": {"rope_theta": 100000, "rope_type": "default"}}
    assert rope_overrides(agreeing) == {}
    # The old rope_scaling is there: exllamav2 applies it; only the theta it would miss is set.
    both = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}, **LLAMA31}
    assert rope_overrides(both) == {"rotary_embedding_base": 500000.0}


def test_llama3_scaling_is_carried_over() -> None:
    assert rope_overrides(LLAMA31) == {
        "rotary_embedding_base": 500000.0,
        "alt_rope_method": "llama3",
        "l3_rope_factor": 8.0,
        "l3_rope_low_freq_factor": 1.0,
        "l3_rope_high_freq_factor": 4.0,
        "l3_rope_original_max_position_embeddings": 8192,
    }


def test_yarn_linear_longrope_and_text_config() -> None:
    yarn = {"original_max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4}}  # fmt: skip
    assert rope_overrides(yarn) == {"rotary_embedding_base": 1e6, "alt_rope_method": "yarn",
                                    "yarn_rope_factor": 4.0,
                                    "yarn_rope_original_max_position_embeddings": 4096}  # fmt: skip
    linear = {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}
    assert rope_overrides(linear) == {"scale_pos_emb": 2.0}
    longrope = {"rope_type": "longrope", "long_factor": [1.0, 2.0], "short_factor": [1.0, 1.0],
                "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.5}  # fmt: skip
    assert rope_overrides({"rope_parameters": longrope}) == {
        "partial_rotary_factor": 0.5, "alt_rope_method": "su", "scale_long_factor": [1.0, 2.0],
        "scale_short_factor": [1.0, 1.0], "original_max_seq_len": 4096,
    }  # fmt: skip
    nested = {"model_type": "gemma3", "text_config": {"rope_parameters": {"rope_theta": 1e6}}}
    assert rope_overrides(nested) == {"rotary_embedding_base": 1e6}


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"rope_theta": 10000.0, "rope_parameters": {"rope_theta": 500000.0}}, "rope_parameters.rope_theta"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters.rope_type"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_parameters.low_freq_factor"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
         "rope_parameters.original_max_position_embeddings"),
        ({"rope_parameters": {"rope_theta": "big"}}, "rope_parameters.rope_theta"),
        ({"rope_parameters": [1, 2]}, "rope_parameters"),
        ({"text_config": {"rope_parameters": {"rope_type": "dynamic"}}},
         "text_config.rope_parameters.rope_type"),
    ],
)  # fmt: skip
def test_what_exllamav2_cannot_honour_is_refused_by_name(config: dict[str, Any], field: str) -> None:
    with pytest.raises(RopeConfigError) as info:
        rope_overrides(config)
    assert info.value.field == field and field in str(info.value)


def test_apply_sets_the_config_attributes(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA31))
    # exllamav2's prepare() left the defaults it falls back to; the reader replaces them.
    config = SimpleNamespace(model_dir=str(tmp_path), rotary_embedding_base=10000.0, alt_rope_method=None)
    applied = apply_rope_parameters(config)
    assert config.rotary_embedding_base == 500000.0 and config.alt_rope_method == "llama3"
    assert config.l3_rope_factor == 8.0 and applied["l3_rope_original_max_position_embeddings"] == 8192


def _registry(tmp_path: Path, model_config: dict[str, Any]) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(model_config))
    registry = tmp_path / "models.yaml"
    registry.write_text("models:\n  - {name: real, engine: exllamav2, path: model, gpus: [0]}\n")
    return registry


def _check_config(registry: Path) -> subprocess.CompletedProcess[str]:
    # --allow-missing: this host has no GPU 0; the folder is read all the same.
    command = [sys.executable, "-m", "gateway", "check-config", str(registry), "--allow-missing"]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)


def test_check_config_says_which_rope_theta_exllamav2_gets(tmp_path: Path) -> None:
    done = _check_config(_registry(tmp_path, SMOLLM2))
    assert done.returncode == 0, done.stderr
    assert "ok: real [exllamav2" in done.stdout
    assert "model 'real'" in done.stderr and "rotary_embedding_base = 100000.0" in done.stderr


def test_check_config_refuses_a_rope_exllamav2_would_misread(tmp_path: Path) -> None:
    registry = _registry(tmp_path, {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    done = _check_config(registry)
    assert done.returncode == 2
    assert str(registry) in done.stderr and "model 'real'" in done.stderr and "field 'path'" in done.stderr
    assert "rope_parameters.rope_type" in done.stderr and "Traceback" not in done.stderr
