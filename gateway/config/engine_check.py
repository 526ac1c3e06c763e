"""Config-time validation of each model's engine settings, by the engine's own settings model.

Runs in the gateway process whenever a registry is loaded (serve, check-config, reload). The
settings models live with their engines in the worker package, which the gateway never imports,
so this runs `python -m model_worker.settings_check` once per registry (no torch is imported
there; it takes well under a second) and maps its answer back: errors become ConfigError lines
that name the file, the model and the field; valid settings come back normalized (defaults filled
in, paths absolute), with the extra weight folders and VRAM reserve that placement needs. Local
model folders are read there too where an engine needs it (exllamav2 and transformers 5's nested
`rope_parameters`): a folder the engine would misread is refused, and what the engine will do
about it is logged as a note.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

from gateway.config.models import ModelConfig
from gateway.config.registry import ConfigError

logger = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 60.0


def _request(models: list[ModelConfig], base_dir: Path) -> dict[str, Any]:
    return {
        "base_dir": str(base_dir),
        "models": [
            {
                "name": m.name,
                "engine": m.engine,
                "max_seq_len": m.max_seq_len,
                "gpu_counts": [len(m.gpus_of_replica(r)) for r in range(m.replicas)],
                "local": not m.remote,
                "path": str(m.path),
                "engine_settings": m.engine_settings,
            }
            for m in models
        ],
    }


def run_settings_check(request: dict[str, Any], source: Path) -> list[dict[str, Any]]:
    try:
        done = subprocess.run(
            [sys.executable, "-m", "model_worker.settings_check"],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=CHECK_TIMEOUT_S,
            check=False,
        )
        answer = json.loads(done.stdout)
        reports = answer["models"]
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError) as exc:
        detail = f"{type(exc).__name__}: {exc}".strip()
        raise ConfigError(f"{source}: the engine settings could not be checked ({detail})") from None
    if not isinstance(reports, list) or len(reports) != len(request["models"]):
        raise ConfigError(f"{source}: the engine settings check answered with the wrong shape")
    return reports


def apply_engine_checks(models: list[ModelConfig], source: Path) -> list[ModelConfig]:
    """The models with their engine_settings normalized; ConfigError listing every problem."""
    if not models:
        return models
    reports = run_settings_check(_request(models, source.parent), source)
    errors = [
        f"{source}: model {m.name!r}, field {e['field']!r}: {e['message']}"
        for m, report in zip(models, reports, strict=True)
        for e in report.get("errors") or []
    ]
    if errors:
        raise ConfigError("\n".join(errors))
    checked = []
    for model, report in zip(models, reports, strict=True):
        for note in report.get("notes") or []:
            logger.info("%s: model %r: %s", source, model.name, note)
        copy = model.model_copy(update={"engine_settings": report["engine_settings"]})
        copy._weight_dirs = tuple(Path(p) for p in report.get("weight_dirs") or [])
        copy._reserve_vram_gb = float(report.get("reserve_vram_gb") or 0.0)
        checked.append(copy)
    return checked
