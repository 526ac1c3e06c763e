"""The deploy files against what the gateway does: the systemd unit's reload is the gateway's SIGHUP
reload, and it still verifies with it.

Runs in the pytest process; `systemd-analyze` runs when installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.harness import REPO_ROOT

UNIT = REPO_ROOT / "deploy" / "systemd" / "llm-gateway.service"


def test_systemctl_reload_sends_the_gateway_sighup(tmp_path: Path) -> None:
    # gateway/server.py reloads the registry on SIGHUP; without ExecReload, `systemctl reload` fails.
    reload = re.findall(r"^ExecReload=(.*)$", UNIT.read_text(), re.M)
    assert reload == ["/bin/kill -HUP $MAINPID"]
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    unit = tmp_path / "llm-gateway.service"
    unit.write_text(
        UNIT.read_text().replace("/opt/llm-gateway/.venv/bin/gateway", shutil.which("true") or "/bin/true")
    )
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
