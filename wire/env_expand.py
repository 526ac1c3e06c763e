"""`${VAR}` and `${VAR:-default}` in the registry file (models.yaml), expanded from the environment.

Imported by the gateway (gateway.config.registry, for the whole file) and by a remote worker
(model_worker.remote_spec, for its own entry), so both read one file the same way. Owns only the
expansion: strings anywhere in the parsed YAML are expanded, keys are not; `$$` is a literal `$`.
A variable that is not set and has no default is an error naming where it was used.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_REFERENCE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class UnsetVariable(ValueError):
    """A `${VAR}` with no value and no default; `where` is the path to the string in the file."""

    def __init__(self, name: str, where: tuple[str | int, ...]) -> None:
        super().__init__(f"${{{name}}} is not set in the environment (give a default: ${{{name}:-...}})")
        self.name = name
        self.where = where


def expand_string(text: str, environ: Mapping[str, str], where: tuple[str | int, ...] = ()) -> str:
    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, default = match.group(1), match.group(2)
        value = environ.get(name)
        if value is None or (value == "" and default is not None):
            if default is None:
                raise UnsetVariable(name, where)
            return default
        return value

    return _REFERENCE.sub(replace, text)


def expand_env(raw: Any, environ: Mapping[str, str], where: tuple[str | int, ...] = ()) -> Any:
    """A copy of parsed YAML with every string value expanded."""
    if isinstance(raw, str):
        return expand_string(raw, environ, where)
    if isinstance(raw, list):
        return [expand_env(item, environ, (*where, i)) for i, item in enumerate(raw)]
    if isinstance(raw, dict):
        return {key: expand_env(value, environ, (*where, key)) for key, value in raw.items()}
    return raw
