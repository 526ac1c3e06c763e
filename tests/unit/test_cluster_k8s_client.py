"""The Kubernetes backend's API client: where it finds the API server, what it says when it finds
none, and what it logs.

Runs in the pytest process; builds `gateway.cluster.k8s_membership.api_client` clients without
calling the API.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from lightkube.config.kubeconfig import SERVICE_ACCOUNT

from gateway.cluster.k8s_membership import KubernetesCredentialsError, api_client
from gateway.cluster.settings import KubernetesSettings
from tests.fake_kube_api import kubeconfig


@pytest.fixture
def request_log() -> Iterator[logging.Logger]:
    """httpx2's logger, its level put back afterwards (api_client sets it, process-wide)."""
    log = logging.getLogger("httpx2")
    level = log.level
    log.setLevel(logging.NOTSET)
    try:
        yield log
    finally:
        log.setLevel(level)


def test_no_credentials_anywhere_names_every_place_and_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if Path(SERVICE_ACCOUNT).exists():
        pytest.skip("running in a pod: its service account is found first")
    missing = tmp_path / "no-such-kubeconfig"
    monkeypatch.setenv("KUBECONFIG", str(missing))
    with pytest.raises(KubernetesCredentialsError) as raised:
        api_client(KubernetesSettings())
    message = str(raised.value)
    for part in (SERVICE_ACCOUNT, str(missing), "$KUBECONFIG", "server.cluster.kubernetes.api_server"):
        assert part in message, message


def test_a_kubeconfig_is_read_for_server_and_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if Path(SERVICE_ACCOUNT).exists():
        pytest.skip("running in a pod: its service account is found first")
    (tmp_path / "token").write_text("t0ken\n")
    path = kubeconfig(
        tmp_path / "config", "https://10.0.0.1:6443", "team-a", token_file=tmp_path / "token", ca_file=None
    )
    monkeypatch.setenv("KUBECONFIG", str(path))
    client = api_client(KubernetesSettings())
    try:
        assert client.namespace == "team-a"
    finally:
        asyncio.run(client.close())


@pytest.mark.parametrize(
    ("gateway_level", "request_lines_shown"), [(logging.INFO, False), (logging.DEBUG, True)]
)
def test_api_calls_are_logged_one_line_each_only_at_debug(
    request_log: logging.Logger, gateway_level: int, request_lines_shown: bool
) -> None:
    root = logging.getLogger()
    level = root.level
    root.setLevel(gateway_level)
    try:
        client = api_client(KubernetesSettings(api_server="http://127.0.0.1:8001"))
        asyncio.run(client.close())
        assert request_log.isEnabledFor(logging.INFO) is request_lines_shown
        assert request_log.isEnabledFor(logging.WARNING)
    finally:
        root.setLevel(level)
