"""MkDocs hooks for the documentation site (`make docs`); a build tool, not part of either process.

Owns three things the pages must not get wrong by hand:
- field tables generated from the pydantic models of the registry and of each engine's settings, so
  their names, defaults and descriptions cannot drift from the code. A page asks for one with a
  line `<!-- fields: module:Class [prefix] -->`;
- a check that every configuration field a page names in backticks (`server.redis_url`,
  `limits.priority_aging_s`, `engine_settings.cache_mode`, ...) exists; a missing one fails the build;
- repository files a page links to outside docs/ (the benchmark plots, `../bench/results/X.png`):
  the link works where the Markdown is read in the repository, and the build copies the file into
  the site under `repo/` and points the link there.
"""

from __future__ import annotations

import importlib
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

TABLE_MARKER = re.compile(r"^<!-- fields: ([\w.]+):(\w+)(?: ([\w.]+))? -->$", re.M)
# Backticked dotted names under these roots are configuration fields and are checked.
REFERENCE = re.compile(r"`((?:server|limits|defaults|engine_settings|cluster)\.[a-z_][a-z0-9_.]*)`")
# A link from a top-level page to a repository file outside docs/ (not a page: those stay in docs/).
REPO_LINK = re.compile(r"\]\(\.\./([\w./-]+\.(?:png|svg|jpg|json|yaml|csv))\)")
SITE_COPY = "repo/"
ENGINE_SETTINGS = (
    "model_worker.engines.exllamav2.settings:ExLlamaV2Settings",
    "model_worker.engines.exllamav3.settings:ExLlamaV3Settings",
    "model_worker.engines.transformers.settings:TransformersSettings",
)


class DocsError(Exception):
    """A page asks for something that does not exist (MkDocs reports it and the build fails)."""


def load_model(module: str, name: str) -> type[BaseModel]:
    model = getattr(importlib.import_module(module), name)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise DocsError(f"{module}:{name} is not a pydantic model")
    return model


def nested_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (directly or as `X | None`), else None."""
    candidates = [annotation]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        candidates = [a for a in typing.get_args(annotation) if a is not type(None)]
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "").replace("pathlib.", "")
    return re.sub(r"<class '([\w.]+)'>", lambda m: m.group(1).rsplit(".", 1)[-1], text)


def default_text(field: Any) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        return f"`{field.default_factory()!r}`"
    value = field.default
    if value is PydanticUndefined or value is None:
        return "none"
    if isinstance(value, BaseModel):
        return "see below"
    return f"`{value!r}`" if not isinstance(value, str) else f"`{value}`"


def field_rows(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str]]:
    rows = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        inner = nested_model(field.annotation)
        if inner is not None:
            rows.append((path, inner.__name__, default_text(field), (field.description or "").strip()))
            rows += field_rows(inner, f"{path}.")
            continue
        description = (field.description or "").strip().replace("|", "\\|").replace("\n", " ")
        rows.append((path, type_name(field.annotation).replace("|", "\\|"), default_text(field), description))
    return rows


def fields_table(module: str, name: str, prefix: str = "") -> str:
    lines = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for path, kind, default, description in field_rows(
        load_model(module, name), f"{prefix}." if prefix else ""
    ):
        lines.append(f"| `{path}` | {kind} | {default} | {description} |")
    return "\n".join(lines)


def known_fields() -> set[str]:
    """Every configuration path a page may name: server.*, models[] fields and their nests,
    limits.*, defaults.*, engine_settings.* (any engine's) and cluster.*."""
    server = importlib.import_module("gateway.config.server_config")
    models = importlib.import_module("gateway.config.models")
    known = {path for path, *_ in field_rows(server.ServerConfig, "server.")}
    known |= {path for path, *_ in field_rows(models.ModelConfig)}
    for spec in ENGINE_SETTINGS:
        module, name = spec.split(":")
        known |= {path for path, *_ in field_rows(load_model(module, name), "engine_settings.")}
    known |= {path.removeprefix("server.") for path in known if path.startswith("server.cluster.")}
    return known


def repo_links(markdown: str) -> list[str]:
    """Repository paths (relative to its root) that a top-level page links to outside docs/."""
    return REPO_LINK.findall(markdown)


def render(markdown: str, page_name: str) -> str:
    def table(match: re.Match[str]) -> str:
        return fields_table(match.group(1), match.group(2), match.group(3) or "")

    rendered = TABLE_MARKER.sub(table, markdown)
    for path in repo_links(markdown):
        if not (REPO_ROOT / path).is_file():
            raise DocsError(f"{page_name} links to ../{path}, which is not a file of the repository")
    rendered = REPO_LINK.sub(lambda m: f"]({SITE_COPY}{m.group(1)})", rendered)
    known = known_fields()
    missing = sorted({ref for ref in REFERENCE.findall(markdown) if ref.rstrip(".") not in known})
    if missing:
        raise DocsError(f"{page_name} names configuration fields that do not exist: {', '.join(missing)}")
    return rendered


def on_files(files: Any, config: Any) -> Any:
    """Copy into the site the repository files that pages link to outside docs/."""
    from mkdocs.structure.files import File

    docs_dir = Path(config["docs_dir"])
    wanted = {path for page in docs_dir.glob("*.md") for path in repo_links(page.read_text())}
    for path in sorted(wanted):
        if (REPO_ROOT / path).is_file():  # a missing one fails in render, naming the page
            files.append(File.generated(config, SITE_COPY + path, abs_src_path=str(REPO_ROOT / path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    from mkdocs.exceptions import PluginError

    try:
        return render(markdown, page.file.src_path)
    except DocsError as exc:
        raise PluginError(str(exc)) from None
