"""Shared pytest fixtures: offline demo models built once per test session.

Runs in the pytest process. Owns the session-scoped demo model folders (random-weight Llama models
with a freshly trained tokenizer, written by `gateway.demo.model`), so no test needs the network.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# Until the package is installed editable, the repo root must win over anything else on the path.
if str(REPO_ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(REPO_ROOT))
# Tests never reach a model hub; failing fast beats waiting on a network timeout.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gateway.demo.model import make_demo_model  # noqa: E402


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_model(tmp_path_factory.mktemp("models") / "demo-small", preset="small", seed=0)


@pytest.fixture(scope="session")
def demo_model_dir_medium(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_model(tmp_path_factory.mktemp("models") / "demo-medium", preset="medium", seed=1)
