"""The documentation site builds strictly, its field tables come from the code, and a page that names
a configuration field that does not exist fails the build.

Runs in the pytest process (MkDocs in a subprocess, into a temporary folder).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import unicodedata
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
    from gateway.config.models import ModelConfig
    from gateway.config.server_config import ServerConfig

    for name in ServerConfig.model_fields:
        assert f"server.{name}</code>" in page, name
    for name in ModelConfig.model_fields:
        assert f"<code>{name}</code>" in page, name
    assert (
        "<code>limits.priority_aging_s</code>" in page and "<code>engine_settings.cache_mode</code>" in page
    )


def test_every_field_has_a_description() -> None:
    docs = hooks()
    from gateway.config.models import ModelConfig
    from gateway.config.server_config import ServerConfig

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


# --- Links and names in README.md and docs/: every one must resolve in this checkout. ---

PAGES = [
    REPO_ROOT / "README.md",
    REPO_ROOT / "deploy" / "README.md",
    *sorted((REPO_ROOT / "docs").glob("*.md")),
]
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE = re.compile(r"`([^`\n]+)`")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$", re.M)
# Backticked repository paths: a top-level folder of this repository, then a path.
REPO_PATH = re.compile(r"^(?:bench|config|deploy|docs|gateway|model_worker|scripts|tests|wire)/[\w./*-]*$")
# Backticked dotted names under a package of ours: modules (and a name they define).
MODULE_NAME = re.compile(r"^(?:gateway|model_worker|wire)(?:\.\w+)+(?<!\.yaml)(?<!\.py)(?<!\.md)$")
NOT_MODULES = {"gateway.access"}  # the access log's logger name
EXAMPLES = ("myengine",)  # the engine the "Adding an engine" steps create


def prose(path: Path) -> str:
    """A page without its fenced code blocks (links and names there are examples, not references)."""
    return FENCE.sub("", path.read_text())


def slug(heading: str) -> str:
    """Python-Markdown's toc anchor for a heading, as MkDocs builds it (and close to GitHub's)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def anchors(path: Path) -> set[str]:
    return {slug(heading) for heading in HEADING.findall(prose(path))}


def test_every_code_block_is_closed() -> None:
    # An unclosed fence swallows the rest of the page (and would hide its links from the checks below).
    unclosed = [
        str(page.relative_to(REPO_ROOT))
        for page in PAGES
        if len(re.findall(r"^```", page.read_text(), re.M)) % 2
    ]
    assert not unclosed, f"pages with an unclosed code block: {unclosed}"


def test_every_relative_link_points_to_a_file_and_heading_that_exist() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(CODE.sub("", prose(page))):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (page.parent / file_part).resolve() if file_part else page
            if not resolved.exists() or not resolved.is_relative_to(REPO_ROOT):
                broken.append(f"{page.relative_to(REPO_ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(REPO_ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_repository_path_and_module_named_exists() -> None:
    missing = []
    for page in PAGES:
        for name in CODE.findall(prose(page)):
            if any(example in name for example in EXAMPLES):
                continue
            if REPO_PATH.match(name) and not list(REPO_ROOT.glob(name.rstrip("/"))):
                missing.append(f"{page.relative_to(REPO_ROOT)}: {name}")
            elif MODULE_NAME.match(name) and name not in NOT_MODULES and not module_exists(name):
                missing.append(f"{page.relative_to(REPO_ROOT)}: {name}")
    assert not missing, "pages name paths or modules that do not exist:\n" + "\n".join(missing)


def module_exists(dotted: str) -> bool:
    """`a.b.c` is a module or package of this checkout, or a name one defines (`wire.results.JobOutput`)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = REPO_ROOT.joinpath(*parts[:cut])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if source.is_file():
            rest = parts[cut:]
            return not rest or bool(
                re.search(rf"^\s*(?:class|def|async def)?\s*{rest[0]}\b", source.read_text(), re.M)
            )
    return False


def test_the_readme_names_only_configuration_fields_that_exist() -> None:
    docs = hooks()
    for page in PAGES:
        docs.render(page.read_text(), str(page.relative_to(REPO_ROOT)))  # raises DocsError naming the field


def test_the_link_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    assert slug("Several gateways: limits in Redis") == "several-gateways-limits-in-redis"
    assert slug("`engine_settings`") == "engine_settings"
    assert module_exists("gateway.serving.request_owner") and module_exists("wire.results.JobOutput")
    assert not module_exists("gateway.serving.request_owners")
    assert not module_exists("wire.results.NoSuchThing")
    docs = hooks()
    with pytest.raises(docs.DocsError, match="not a file of the repository"):
        docs.render("![plot](../bench/results/missing.png)", "bad.md")
    assert "](repo/bench/results/" in docs.render(
        "![plot](../bench/results/soak_2026-11-22T194856Z.png)", "ok.md"
    )
