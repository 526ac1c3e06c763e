"""transformers 5's `rope_parameters` in config.json, read for exllamav2 0.3.2, which does not.

Runs in a worker process (`apply_rope_parameters` on each ExLlamaV2Config that loading makes) and
in `model_worker.settings_check` at config time (`folder_report`). Imports neither torch nor
exllamav2: it reads config.json as JSON and names ExLlamaV2Config attributes.

transformers 5 saves a model's rope settings as `rope_parameters: {rope_type, rope_theta, factor,
...}` instead of the top-level `rope_theta` and `rope_scaling` that older versions wrote.
exllamav2 0.3.2 reads only the old keys: without a top-level `rope_theta` it uses 10000 without a
word (SmolLM2 needs 100000, Llama 3 500000), and Llama 3.1's `llama3` scaling is lost as well.
The model then loads, runs, and writes worse text. So the nested values are set on the config
after exllamav2 has read it, the way its own `prepare()` would have set them from the old keys;
what it has no counterpart for, or a file that says two different things, is refused, naming the
field.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# exllamav2's attributes for each rope_type (the mapping its prepare() applies to `rope_scaling`).
_LLAMA3_KEYS = {
    "l3_rope_factor": "factor",
    "l3_rope_low_freq_factor": "low_freq_factor",
    "l3_rope_high_freq_factor": "high_freq_factor",
    "l3_rope_original_max_position_embeddings": "original_max_position_embeddings",
}
_YARN_KEYS = {
    "yarn_rope_factor": "factor",
    "yarn_rope_original_max_position_embeddings": "original_max_position_embeddings",
}
_SCALING_KEYS = {"llama3": _LLAMA3_KEYS, "yarn": _YARN_KEYS}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "su")


class RopeConfigError(ValueError):
    """config.json's rope settings cannot be given to exllamav2 as they are; `field` names the key."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"config.json field {field!r}: {message}")
        self.field = field


def _section(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The part of config.json that holds the language model's keys (multimodal configs nest it
    under text_config, where exllamav2 also looks), and its name as a field prefix."""
    text = config.get("text_config")
    if "rope_parameters" not in config and isinstance(text, dict) and "rope_parameters" in text:
        return text, "text_config."
    return config, ""


def _legacy_theta(config: dict[str, Any]) -> Any:
    """The rope_theta exllamav2 reads itself (its keys, in its order)."""
    for holder in (config, config.get("attn_config"), config.get("text_config")):
        if isinstance(holder, dict) and holder.get("rope_theta") is not None:
            return holder["rope_theta"]
    return None


def _legacy_scaling(config: dict[str, Any]) -> Any:
    text = config.get("text_config")
    return config.get("rope_scaling") or (text.get("rope_scaling") if isinstance(text, dict) else None)


def _number(params: dict[str, Any], key: str, field: str) -> float:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RopeConfigError(f"{field}.{key}", f"must be a number for this rope_type, not {value!r}")
    return float(value)


def rope_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """ExLlamaV2Config attributes to set, from `rope_parameters`, where exllamav2 0.3.2 would
    otherwise miss them; {} when the file has no such values. RopeConfigError for what cannot be
    given to exllamav2 faithfully."""
    section, prefix = _section(config)
    params = section.get("rope_parameters")
    field = prefix + "rope_parameters"
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise RopeConfigError(field, f"must be a mapping, not {type(params).__name__}")
    overrides: dict[str, Any] = {}

    if params.get("rope_theta") is not None:
        nested = _number(params, "rope_theta", field)
        legacy = _legacy_theta(config)
        if legacy is None:
            overrides["rotary_embedding_base"] = nested
        elif float(legacy) != nested:
            raise RopeConfigError(
                f"{field}.rope_theta",
                f"{nested:g} disagrees with rope_theta {legacy} (exllamav2 would use {legacy}); keep one",
            )

    if "partial_rotary_factor" in params and "partial_rotary_factor" not in section:
        overrides["partial_rotary_factor"] = _number(params, "partial_rotary_factor", field)

    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default" or _legacy_scaling(config):
        return overrides  # no scaling, or exllamav2 reads the old rope_scaling itself
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise RopeConfigError(
            f"{field}.rope_type",
            f"{rope_type!r} is not a rope scaling exllamav2 0.3.2 implements "
            f"({', '.join(SUPPORTED_ROPE_TYPES)}); serve this model with another engine",
        )

    def original_max(key: str = "original_max_position_embeddings") -> int:
        value = params.get(key, section.get(key))
        if not isinstance(value, int) or isinstance(value, bool):
            raise RopeConfigError(f"{field}.{key}", f"rope_type {rope_type!r} needs it as an integer")
        return value

    if rope_type == "linear":
        overrides["scale_pos_emb"] = _number(params, "factor", field)
    elif rope_type in _SCALING_KEYS:
        overrides["alt_rope_method"] = rope_type
        for attribute, key in _SCALING_KEYS[rope_type].items():
            is_length = key == "original_max_position_embeddings"
            overrides[attribute] = original_max(key) if is_length else _number(params, key, field)
    else:  # longrope ("su" in exllamav2)
        long_factor, short_factor = params.get("long_factor"), params.get("short_factor")
        if not isinstance(long_factor, list) or not isinstance(short_factor, list):
            raise RopeConfigError(field, f"rope_type {rope_type!r} needs long_factor and short_factor lists")
        overrides.update(alt_rope_method="su", scale_long_factor=long_factor, scale_short_factor=short_factor,
                         original_max_seq_len=original_max())  # fmt: skip
    return overrides


def read_config(model_dir: Path) -> dict[str, Any]:
    data = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError("config.json is not a JSON object")
    return data


def apply_rope_parameters(config: Any) -> dict[str, Any]:
    """Set the nested rope values on an ExLlamaV2Config that prepare() has read; returns them."""
    overrides = rope_overrides(read_config(Path(config.model_dir)))
    for attribute, value in overrides.items():
        setattr(config, attribute, value)
    if overrides:
        logger.info(
            "%s: rope settings from rope_parameters, which exllamav2 0.3.2 does not read: %s",
            Path(config.model_dir).name,
            ", ".join(f"{k}={v}" for k, v in overrides.items() if not isinstance(v, list)),
        )
    return overrides


def folder_report(model_dir: Path) -> tuple[list[dict[str, str]], list[str]]:
    """(errors as settings_check reports them, notes) for a model folder on this host; a folder
    that is not here (yet) is somebody else's check."""
    if not (Path(model_dir) / "config.json").is_file():
        return [], []
    try:
        overrides = rope_overrides(read_config(model_dir))
    except RopeConfigError as exc:
        return [{"field": "path", "message": f"{model_dir}: {exc}"}], []
    except (OSError, ValueError) as exc:
        return [{"field": "path", "message": f"{model_dir}/config.json cannot be read: {exc}"}], []
    notes = [
        f"exllamav2 0.3.2 reads no rope_parameters; the engine sets {k} = {v} from them"
        for k, v in overrides.items()
        if not isinstance(v, list)
    ]
    return [], notes
