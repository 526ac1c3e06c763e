"""The engine registry: which engines exist, one line each.

Imported in the worker process and by `model_worker.settings_check`. Each line names an engine's
folder (a package). The package's `__init__` exposes `Settings` (its pydantic settings model; no
torch import) and `engine_class()`, which imports the engine itself only when a worker runs it:
the exllamav2 module needs CUDA, the transformers one does not.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

from model_worker.engines.base import EngineSettings

ENGINES = {
    "transformers": "model_worker.engines.transformers",
    "exllamav2": "model_worker.engines.exllamav2",
    "exllamav3": "model_worker.engines.exllamav3",
}

# Fault-injection engines (`test:module.Class`, a class with a `Settings` attribute) exist only in
# the test suite, which opts in through this variable; they are not part of the product.
TEST_ENGINES_VARIABLE = "GATEWAY_ALLOW_TEST_ENGINES"


class UnknownEngine(ValueError):
    pass


@dataclass(frozen=True)
class EngineEntry:
    name: str
    settings: type[EngineSettings]
    package: Any  # the engine's package, or a test engine's class

    def engine_class(self) -> type:
        if isinstance(self.package, type):
            return self.package
        return self.package.engine_class()  # type: ignore[no-any-return]


def lookup(name: str) -> EngineEntry:
    if name.startswith("test:") and os.environ.get(TEST_ENGINES_VARIABLE) == "1":
        module_name, _, class_name = name.removeprefix("test:").rpartition(".")
        engine_class = getattr(importlib.import_module(module_name), class_name)
        return EngineEntry(name, engine_class.Settings, engine_class)
    module = ENGINES.get(name)
    if module is None:
        raise UnknownEngine(f"unknown engine {name!r}; expected one of {', '.join(ENGINES)}")
    package = importlib.import_module(module)
    return EngineEntry(name, package.Settings, package)


def create_engine(name: str, path: str, max_seq_len: int, settings: dict[str, Any] | None = None) -> Any:
    """An engine, unloaded, with its settings validated by its own settings model (ValidationError
    if they are invalid). For the serve loop, benchmarks and tests alike."""
    entry = lookup(name)
    validated = entry.settings.model_validate(settings or {}, context={"max_seq_len": max_seq_len})
    return entry.engine_class()(path, max_seq_len, validated)
