"""The `gateway` command's helpers (keys, make-demo-model, fetch-demo-model) given what an operator
mistypes: a clear one-line error and a non-zero exit, never a traceback, a key written outside its
folder, or a minute of work before a path that could never take the result is refused."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO_ROOT

UMASK = os.umask(0)
os.umask(UMASK)


def gateway(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, check=False,
    )  # fmt: skip


def refused(result: subprocess.CompletedProcess[str], says: str) -> None:
    assert result.returncode in (1, 2), result
    assert "Traceback" not in result.stderr, result.stderr
    assert says in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("name", "models"),
    [("../outside", None), ("", None), (".hidden", None), ("a/b", None), ("worker", "")],
)
def test_keys_refuses_a_name_that_is_not_a_file_name_or_no_models(
    tmp_path: Path, name: str, models: str | None
) -> None:
    folder = tmp_path / "keys"
    result = gateway(
        "keys", str(folder), "--name", name, *(["--models", models] if models is not None else [])
    )
    refused(result, "--models" if models is not None else "--name")
    assert list(tmp_path.iterdir()) == []  # checked before anything is written: no folder, no key


def test_keys_into_a_path_that_cannot_be_a_folder(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    refused(gateway("keys", str(blocker / "keys"), "--name", "gw"), f"{blocker} is not a folder")


def test_keys_secret_is_private_and_public_is_readable(tmp_path: Path) -> None:
    result = gateway("keys", str(tmp_path), "--name", "worker-a.1", "--models", "m1")
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE((tmp_path / "worker-a.1.key_secret").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "worker-a.1.key").stat().st_mode) == 0o666 & ~UMASK
    refused(gateway("keys", str(tmp_path), "--name", "worker-a.1"), "refusing to overwrite a key")


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--preset", "nonsense"], "unknown preset 'nonsense'"),
        (["--device", "nonsense"], "--device 'nonsense' is not a device"),
    ],
)
def test_make_demo_model_refuses_what_it_cannot_make(tmp_path: Path, extra: list[str], says: str) -> None:
    refused(gateway("make-demo-model", str(tmp_path / "m"), *extra), says)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("command", ["make-demo-model", "fetch-demo-model"])
def test_a_model_folder_that_is_a_file_is_refused_first(tmp_path: Path, command: str) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    refused(gateway(command, str(blocker)), f"{blocker} exists and is not a folder")
    refused(gateway(command, str(blocker / "m")), f"{blocker} is not a folder")
