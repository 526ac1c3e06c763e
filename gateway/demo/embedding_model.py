"""Offline demo embedding model: the demo Llama's body in the sentence-transformers layout.

Runs in the gateway's CLI process (`gateway make-demo-model DIR --embedding`) and in test fixtures;
never in the serving path. Owns turning a demo model folder into what sentence-transformers loads:
a `LlamaModel` (no language-model head), `modules.json` naming the Transformer, Pooling and
Normalize modules, `sentence_bert_config.json` and `1_Pooling/config.json`. Random weights, so the
vectors mean nothing, but the pooling and normalization are the model's own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gateway.demo.model import make_demo_model

POOLING_MODES = ("mean", "cls", "lasttoken", "max")


def make_demo_embedding_model(
    out_dir: Path, *, preset: str = "small", seed: int = 0, pooling: str = "mean", normalize: bool = True
) -> Path:
    if pooling not in POOLING_MODES:
        raise ValueError(f"pooling must be one of {POOLING_MODES}, not {pooling!r}")
    out_dir = make_demo_model(Path(out_dir), preset=preset, seed=seed)
    _strip_head(out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    hidden = int(config["hidden_size"])
    modules: list[dict[str, Any]] = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
        (out_dir / "2_Normalize").mkdir(exist_ok=True)
    _write_json(out_dir / "modules.json", modules)
    _write_json(out_dir / "sentence_bert_config.json", {"max_seq_length": 512, "do_lower_case": False})
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    pooling_config = {
        "word_embedding_dimension": hidden,
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": pooling == "max",
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": pooling == "lasttoken",
        "include_prompt": True,
    }
    _write_json(out_dir / "1_Pooling" / "config.json", pooling_config)
    return out_dir


def _strip_head(out_dir: Path) -> None:
    """A LlamaModel checkpoint: the body's weights without the `model.` prefix, and no lm_head."""
    from safetensors.torch import load_file, save_file

    weights = out_dir / "model.safetensors"
    tensors = load_file(str(weights))
    body = {k.removeprefix("model."): v for k, v in tensors.items() if not k.startswith("lm_head.")}
    save_file(body, str(weights), metadata={"format": "pt"})
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["LlamaModel"]
    _write_json(config_path, config)
    (out_dir / "generation_config.json").unlink(missing_ok=True)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
