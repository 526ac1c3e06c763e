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


def demo_entry(name: str, path: Path, **extra: object) -> dict[str, object]:
    entry: dict[str, object] = {
        "name": name,
        "engine": "transformers",
        "path": str(path),
        "max_seq_len": 2048,
        "threads": 1,
        "max_batch_size": 32,
        "limits": {"max_concurrent_jobs": 32, "max_queued_requests": 64},
    }
    entry.update(extra)
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
