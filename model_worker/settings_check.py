"""`python -m model_worker.settings_check`: validate models' engine settings for the gateway.

Runs as a short-lived process that the gateway starts at config time (`gateway serve`,
`check-config`, reloads), so that the gateway validates each engine's own settings model without
importing the worker package; remote workers call `check_model` in-process. Imports no torch.

stdin: {"base_dir": str, "models": [{"name", "engine", "max_seq_len", "gpu_counts": [int, ...],
         "local": bool, "path": str (optional), "engine_settings": {...}}]}
stdout: {"models": [{"name", "errors": [{"field", "message"}], "engine_settings": {...},
          "weight_dirs": [str, ...], "reserve_vram_gb": float, "notes": [str, ...]}]}
Field names in errors are relative to the model entry (e.g. "engine_settings.cache_size").
An engine may also read what it needs from a local model folder (FOLDER_CHECKS): a folder it
would misread is an error here, not a quietly wrong model later.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from model_worker.engines import registry
from model_worker.engines.base import EngineSettings
from model_worker.engines.exllamav2 import rope as exllamav2_rope

# engine -> (model folder -> (errors, notes)); pure file reads, no torch.
FOLDER_CHECKS: dict[str, Callable[[Path], tuple[list[dict[str, str]], list[str]]]] = {
    "exllamav2": exllamav2_rope.folder_report,
}


def _errors(exc: ValidationError) -> list[dict[str, str]]:
    out = []
    for error in exc.errors():
        field = ".".join(str(p) for p in ("engine_settings", *error["loc"]))
        out.append({"field": field, "message": error["msg"].removeprefix("Value error, ")})
    return out


def check_model(model: dict[str, Any], base_dir: str | None) -> tuple[EngineSettings | None, dict[str, Any]]:
    """(validated settings or None, the report for the gateway) for one registry entry."""
    report: dict[str, Any] = {"name": model.get("name"), "errors": []}
    try:
        entry = registry.lookup(str(model.get("engine")))
    except registry.UnknownEngine as exc:
        report["errors"].append({"field": "engine", "message": str(exc)})
        return None, report
    except (ImportError, AttributeError) as exc:
        report["errors"].append({"field": "engine", "message": f"cannot load engine: {exc}"})
        return None, report
    gpu_counts = [int(c) for c in model.get("gpu_counts") or []]
    context = {"base_dir": base_dir, "max_seq_len": model.get("max_seq_len"), "gpu_counts": gpu_counts}
    try:
        settings = entry.settings.model_validate(model.get("engine_settings") or {}, context=context)
    except ValidationError as exc:
        report["errors"] = _errors(exc)
        return None, report
    if entry.settings.needs_gpu and model.get("local") and not all(gpu_counts):
        report["errors"].append(
            {"field": "gpus", "message": f"the {entry.name} engine needs at least one GPU"}
        )
        return None, report
    folder_check = FOLDER_CHECKS.get(entry.name)
    if folder_check is not None and model.get("local") and model.get("path"):
        errors, notes = folder_check(Path(str(model["path"])))
        if errors:
            report["errors"] = errors
            return None, report
        report["notes"] = notes
    report["engine_settings"] = settings.model_dump(mode="json")
    report["weight_dirs"] = [str(p) for p in settings.weight_dirs()]
    report["reserve_vram_gb"] = settings.reserved_vram_gb()
    return settings, report


def main() -> int:
    try:
        request = json.load(sys.stdin)
        models = request["models"]
        base_dir = request.get("base_dir")
    except (ValueError, KeyError, TypeError) as exc:
        print(json.dumps({"error": f"bad request: {exc}"}))
        return 2
    reports = [check_model(model, base_dir)[1] for model in models]
    print(json.dumps({"models": reports}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
