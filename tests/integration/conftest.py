"""Integration fixtures: one real gateway with two real CPU workers, shared by a test module.

Runs in the pytest process. The gateway, its workers and the sockets between them are real;
only the model weights are tiny and random (made by the session fixtures in tests/conftest.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import GatewayProcess


def write_registry(path: Path, models: list[dict[str, object]], **server: object) -> Path:
    import yaml

    server_section = {"heartbeat_interval_s": 0.2, "shutdown_grace_s": 5, **server}
    path.write_text(yaml.safe_dump({"server": server_section, "models": models}))
    return path


# Keys of the transformers engine's settings: demo_entry puts them under engine_settings.
ENGINE_KEYS = frozenset({"threads", "max_batch_size", "max_chunk_size", "dtype"})


def demo_entry(name: str, path: Path, **extra: object) -> dict[str, object]:
    """A transformers model entry; engine settings given as keywords go to its engine_settings."""
    engine_settings: dict[str, object] = {"threads": 1, "max_batch_size": 32}
    engine_settings.update({k: v for k, v in extra.items() if k in ENGINE_KEYS})
    entry: dict[str, object] = {
        "name": name,
        "engine": "transformers",
        "path": str(path),
        "max_seq_len": 2048,
        "engine_settings": engine_settings,
        "limits": {"max_concurrent_jobs": 32, "max_queued_requests": 64},
    }
    entry.update({k: v for k, v in extra.items() if k not in ENGINE_KEYS})
    return entry


@pytest.fixture(scope="module")
def two_model_gateway(
    tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path, demo_model_dir_medium: Path
) -> Iterator[GatewayProcess]:
    config = write_registry(
        tmp_path_factory.mktemp("gw") / "models.yaml",
        [
            demo_entry("demo-small", demo_model_dir, aliases=["small"]),
            demo_entry("demo-medium", demo_model_dir_medium, aliases=["medium"]),
        ],
    )
    with GatewayProcess(config) as gateway:
        yield gateway
