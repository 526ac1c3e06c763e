"""A model whose folder is not there (a typo in models.yaml, at start or in a reload) is refused
before its worker is spawned: failed at once, with the file, the model and the field in its reason,
instead of a crash loop of workers each failing on it with the engine's own message.

Runs a real gateway with a real CPU worker beside the model that cannot start.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.harness import GatewayProcess, wait_until
from tests.integration.conftest import demo_entry, write_registry


def test_a_model_folder_that_is_not_there_fails_at_once_naming_the_field(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    missing = tmp_path / "not-copied-yet"
    config = write_registry(
        tmp_path / "models.yaml", [demo_entry("good", demo_model_dir), demo_entry("gone", missing)]
    )
    with GatewayProcess(config, wait_ready=False) as gateway:
        gateway.wait_until_live()
        failed = wait_until(
            lambda: next(w for w in gateway.workers() if w["model"] == "gone")["state"] == "failed",
            "the model without a folder to be failed",
            context=gateway.events,
        )
        assert failed
        gone = next(w for w in gateway.workers() if w["model"] == "gone")
        why = f"{config}: model 'gone', field 'path': {missing} is not a folder on this host"
        assert why in gone["detail"] and why in gone["last_error"], gone
        assert gone["restarts"] == 0 and gone["pid"] is None
        assert "spawned worker gone" not in gateway.log()
        reply = httpx.post(gateway.url + "/v1/completions", json={"model": "gone", "prompt": "x"}, timeout=10)
        assert reply.status_code == 503 and why in reply.json()["error"]["message"], reply.text
        # The other model serves as ever.
        wait_until(
            lambda: httpx.get(gateway.url + "/health/ready/good", timeout=5).status_code == 200,
            "the good model to be ready",
            context=gateway.events,
        )
        reply = httpx.post(
            gateway.url + "/v1/completions",
            json={"model": "good", "prompt": "x", "max_tokens": 2},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
