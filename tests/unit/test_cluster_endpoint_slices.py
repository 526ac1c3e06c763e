"""Which endpoints of an EndpointSlice become workers, from slices in the API's own JSON shape.

Runs in the pytest process, no I/O: `slice_workers` on slices decoded by lightkube, as the
Kubernetes membership receives them.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import pytest
from lightkube.resources.discovery_v1 import EndpointSlice

from gateway.cluster.k8s_membership import slice_workers
from gateway.cluster.settings import KubernetesSettings
from tests.fake_kube_api import endpoint_slice

SETTINGS = KubernetesSettings()


def workers(raw: dict[str, Any]) -> dict[str, str]:
    records = slice_workers(cast(EndpointSlice, EndpointSlice.from_dict(raw)), SETTINGS)
    return {worker_id: f"{r.model} {r.replica} {r.endpoint}" for worker_id, r in records.items()}


def test_ready_endpoints_become_workers_named_model_at_pod() -> None:
    raw = endpoint_slice(
        "s", "qwen2.5-7b", {"w-0": "10.0.0.1", "w-11": "10.0.0.2", "w-2": "10.0.0.3", "w-3": "10.0.0.4"},
        not_ready=("w-2",), terminating=("w-3",), port=7001,
    )  # fmt: skip
    assert workers(raw) == {
        "qwen2.5-7b@w-0": "qwen2.5-7b 0 tcp://10.0.0.1:7001",
        "qwen2.5-7b@w-11": "qwen2.5-7b 11 tcp://10.0.0.2:7001",
    }


def test_an_unset_ready_condition_counts_as_ready_and_ipv6_is_bracketed() -> None:
    raw = endpoint_slice("s", "llama", {"w-0": "fd00::5"})
    raw["addressType"] = "IPv6"
    raw["endpoints"][0]["conditions"] = {}
    assert workers(raw) == {"llama@w-0": "llama 0 tcp://[fd00::5]:5555"}


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (
            endpoint_slice("s", "m", {"w-0": "10.0.0.1"}, labels={"app.kubernetes.io/component": "worker"}),
            "has no llm-gateway.io/model label",
        ),
        (endpoint_slice("s", "m", {"w-0": "10.0.0.1"}, port_name="http"), "no port named worker"),
    ],
)
def test_a_slice_without_model_label_or_worker_port_is_ignored_with_a_warning(
    raw: dict[str, Any], says: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway.cluster"):
        assert workers(raw) == {}
    assert says in caplog.text
