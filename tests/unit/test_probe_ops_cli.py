"""What an operator types and reads: `gateway serve` flags that cannot work together are refused
with one clear line (never a traceback after the workers were spawned), and the example the
configuration page shows is what `gateway check-config` prints.

Runs `python -m gateway` in a child process, as an operator would.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.harness import REPO_ROOT, free_port


def gateway(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True, text=True, cwd=cwd, timeout=120, check=False,
    )  # fmt: skip


def test_own_port_equal_to_the_serving_port_is_refused_before_anything_starts(tmp_path: Path) -> None:
    config = tmp_path / "models.yaml"
    config.write_text(f"models:\n  - {{name: m, engine: transformers, path: {tmp_path}}}\n")
    port = str(free_port())
    result = gateway("serve", "--config", str(config), "--port", port, "--own-port", port)
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result.stderr
    assert f"config error: --own-port {port} is the serving port too" in result.stderr
    assert "spawned worker" not in result.stderr  # refused before any worker or socket


def test_the_configuration_page_example_is_what_check_config_prints(tmp_path: Path) -> None:
    page = (REPO_ROOT / "docs" / "configuration.md").read_text()
    example = re.search(r"\$ cat bad\.yaml\n(.*?)\$ gateway check-config bad\.yaml\n(.*?)\n```", page, re.S)
    assert example is not None, "the example is gone from docs/configuration.md"
    (tmp_path / "bad.yaml").write_text(example.group(1))
    (tmp_path / "demo-models" / "demo-small").mkdir(parents=True)  # a folder is all it checks first
    result = gateway("check-config", "bad.yaml", cwd=tmp_path)
    assert result.returncode == 2, result
    assert result.stderr.strip() == example.group(2).strip()
