"""The documentation site builds strictly, its field tables come from the code, and a page that names
a configuration field that does not exist fails the build.

Runs in the pytest process (MkDocs in a subprocess, into a temporary folder).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO_ROOT / "docs" / "hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_strictly_with_every_field_documented(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    page = (tmp_path / "site" / "configuration" / "index.html").read_text()
    from gateway.config.registry import ModelConfig, ServerConfig

    for name in ServerConfig.model_fields:
        assert f"server.{name}</code>" in page, name
    for name in ModelConfig.model_fields:
        assert f"<code>{name}</code>" in page, name
    assert (
        "<code>limits.priority_aging_s</code>" in page and "<code>engine_settings.cache_mode</code>" in page
    )


def test_every_field_has_a_description() -> None:
    docs = hooks()
    from gateway.config.registry import ModelConfig, ServerConfig

    rows = docs.field_rows(ServerConfig, "server.") + docs.field_rows(ModelConfig)
    for spec in docs.ENGINE_SETTINGS:
        module, name = spec.split(":")
        rows += docs.field_rows(docs.load_model(module, name), "engine_settings.")
    undocumented = [path for path, _kind, _default, description in rows if not description]
    assert not undocumented, f"fields without a description (Field(description=...)): {undocumented}"


def test_a_page_naming_a_missing_field_fails_and_a_real_one_passes() -> None:
    docs = hooks()
    assert "`server.redis_url`" in docs.render(
        "Set `server.redis_url` and `limits.max_concurrent_jobs`.", "ok.md"
    )
    with pytest.raises(docs.DocsError, match=r"bad\.md names .*server\.redis_host"):
        docs.render("Set `server.redis_host`.", "bad.md")
    with pytest.raises(docs.DocsError, match="engine_settings.cache_modes"):
        docs.render("`engine_settings.cache_modes`", "bad.md")
