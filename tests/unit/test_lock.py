"""The committed lock agrees with pyproject.toml, and the check that says so catches each kind of drift.

Runs in the pytest process; reads files only (scripts/check_lock.py is what `make test` runs first).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def load_checker():  # noqa: ANN201 (a module object)
    spec = importlib.util.spec_from_file_location("check_lock", REPO_ROOT / "scripts" / "check_lock.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_lock"] = module
    spec.loader.exec_module(module)
    return module


PYPROJECT = """
[project]
name = "x"
dependencies = ["quart>=0.20", "torch>=2.2", "pyzmq>=26"]
[project.optional-dependencies]
test = ["pytest>=8"]
bench = []
"""
LOCK = """quart==0.20.1 \\
    --hash=sha256:aa
    # via x (pyproject.toml)
pyzmq==27.3.0 \\
    --hash=sha256:bb
    # via
    #   x (pyproject.toml)
    #   jupyter
pytest==9.0.0 \\
    --hash=sha256:cc
    # via x (pyproject.toml)
"""


def write(tmp_path: Path, pyproject: str, lock: str) -> tuple[Path, Path]:
    (tmp_path / "pyproject.toml").write_text(pyproject)
    (tmp_path / "requirements.lock").write_text(lock)
    return tmp_path / "pyproject.toml", tmp_path / "requirements.lock"


def test_the_committed_lock_agrees_with_pyproject() -> None:
    checker = load_checker()
    assert checker.disagreements(REPO_ROOT / "pyproject.toml", REPO_ROOT / "requirements.lock") == []


def test_a_lock_in_step_passes_and_torch_is_left_to_the_makefile(tmp_path: Path) -> None:
    checker = load_checker()
    assert checker.disagreements(*write(tmp_path, PYPROJECT, LOCK)) == []


@pytest.mark.parametrize(
    ("pyproject", "lock", "complaint"),
    [
        (PYPROJECT.replace('"pyzmq>=26"', '"pyzmq>=26", "msgspec>=0.19"'), LOCK, "msgspec>=0.19 is in"),
        (PYPROJECT.replace("pyzmq>=26", "pyzmq>=28"), LOCK, "pins pyzmq==27.3.0, outside"),
        (PYPROJECT.replace(', "pyzmq>=26"', ""), LOCK, "still holds pyzmq"),
    ],
    ids=["new dependency", "raised bound", "dropped dependency"],
)
def test_each_kind_of_drift_is_named(tmp_path: Path, pyproject: str, lock: str, complaint: str) -> None:
    checker = load_checker()
    problems = checker.disagreements(*write(tmp_path, pyproject, lock))
    assert len(problems) == 1 and complaint in problems[0], problems


def test_the_command_fails_with_the_remedy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checker = load_checker()
    pyproject, lock = write(tmp_path, PYPROJECT.replace("pyzmq>=26", "pyzmq>=28"), LOCK)
    assert checker.main(["--pyproject", str(pyproject), "--lock", str(lock)]) == 1
    assert "run `make lock`" in capsys.readouterr().err
    assert checker.main(["--pyproject", str(pyproject), "--lock", str(tmp_path / "missing.lock")]) == 1
