"""Cluster mode's settings: which system holds membership and leadership, and its timings.

Runs in the gateway process, at config load. Owns `ClusterConfig`, the registry's
`server.cluster` section (absent: the single-host default, which needs neither etcd nor
Kubernetes), with the keys the gateway connects to listening workers with, and `StaticWorker`, one
entry of a fixed list of workers (backend `static`: no discovery system at all). Like every config
model here it is a StrictModel (gateway.config.strict_model): frozen, no unknown keys, no true/false
for a number, finite numbers; the registry's loader turns a validation error into a line that names
the file and the field.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from gateway.config.strict_model import StrictModel

# host:port, where host is a name, an IPv4 address or a bracketed IPv6 address.
_ENDPOINT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})$")
# A Kubernetes label key (optional DNS prefix, then a name) and label value.
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_DNS_NAME = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"


class EtcdSettings(StrictModel):
    """etcd v3 (gRPC): worker records under `prefix`, each on its worker's lease; the leader's key."""

    endpoints: list[str] = Field(
        min_length=1,
        description="etcd client endpoints as host:port (no scheme); tried in turn when one fails.",
    )
    prefix: str = Field(
        "/llm-gateway/",
        pattern=r"^/.*/$",
        description="Key prefix of this deployment: workers register under PREFIX/workers/, the leader "
        "under PREFIX/leader, decisions under PREFIX/decisions/. Deployments sharing an etcd need "
        "different prefixes.",
    )
    worker_ttl_s: int = Field(
        10,
        ge=2,
        le=300,
        description="TTL of a worker's registration lease: a worker that stops refreshing it (killed, cut "
        "off) drops out of every gateway's membership within this many seconds. Refreshed every third.",
    )
    leader_ttl_s: int = Field(
        10,
        ge=2,
        le=300,
        description="TTL of the leader's lease: when the leader dies, another gateway takes over within "
        "about this many seconds. A leader that cannot refresh it steps down before it expires.",
    )
    request_timeout_s: float = Field(
        1.0, gt=0, le=60, description="Deadline of each call to etcd; past it the endpoint counts as down."
    )
    retry_interval_s: float = Field(
        1.0,
        gt=0,
        le=60,
        description="Pause before trying etcd again after a failure (listing, watching or registering).",
    )

    @field_validator("endpoints")
    @classmethod
    def _endpoints_are_host_port(cls, endpoints: list[str]) -> list[str]:
        for endpoint in endpoints:
            match = _ENDPOINT.match(endpoint)
            if match is None or not 0 < int(match.group(2)) < 65536:
                raise ValueError(f"{endpoint!r} is not host:port (e.g. 10.0.0.5:2379, without http://)")
        return endpoints

    @model_validator(mode="after")
    def _refresh_before_expiry(self) -> EtcdSettings:
        # A refresh every third of the TTL must fit a call's deadline, or a slow etcd expires the lease.
        if self.request_timeout_s >= min(self.worker_ttl_s, self.leader_ttl_s) / 3:
            raise ValueError("request_timeout_s must be below a third of worker_ttl_s and of leader_ttl_s")
        return self


class KubernetesSettings(StrictModel):
    """The Kubernetes API: workers from the EndpointSlices of their headless Services, the leader
    from a coordination.k8s.io/v1 Lease."""

    api_server: str | None = Field(
        None,
        pattern=r"^https?://",
        description="API server URL reached without credentials, e.g. `kubectl proxy`'s "
        "(http://127.0.0.1:8001). Unset: the pod's service account (in-cluster), else $KUBECONFIG or "
        "~/.kube/config.",
    )
    namespace: str | None = Field(
        None,
        pattern=_DNS_NAME,
        description="Namespace of the worker Services and of the Lease. Unset: the pod's own namespace.",
    )
    worker_selector: dict[str, str] = Field(
        default_factory=lambda: {
            "app.kubernetes.io/part-of": "llm-gateway",
            "app.kubernetes.io/component": "worker",
        },
        min_length=1,
        description="Labels of the worker Services; their EndpointSlices carry them (the EndpointSlice "
        "controller copies a Service's labels), and only slices with all of them are watched.",
    )
    model_label: str = Field(
        "llm-gateway.io/model",
        description="Label of each worker Service (copied to its EndpointSlices) that names the model its "
        "pods serve.",
    )
    port_name: str = Field(
        "worker", pattern=_DNS_NAME, description="Name of the Service port the workers listen on."
    )
    lease_name: str = Field(
        "llm-gateway-leader", pattern=_DNS_NAME, description="Name of the Lease the gateways compete for."
    )
    lease_duration_s: int = Field(
        15,
        ge=2,
        le=300,
        description="leaseDurationSeconds: a Lease not renewed for this long (as seen by the other "
        "gateways, on their own clocks) may be taken over.",
    )
    renew_deadline_s: float = Field(
        10.0,
        gt=0,
        description="The leader steps down when it has not renewed the Lease for this long; below "
        "lease_duration_s, so it stops before anyone may take over.",
    )
    retry_period_s: float = Field(
        2.0, gt=0, description="How often the leader renews, and the others check, the Lease."
    )
    request_timeout_s: float = Field(5.0, gt=0, le=60, description="Deadline of each API call (not watches).")

    @field_validator("worker_selector")
    @classmethod
    def _selector_is_labels(cls, selector: dict[str, str]) -> dict[str, str]:
        for key, value in selector.items():
            if not _LABEL_KEY.match(key):
                raise ValueError(f"{key!r} is not a Kubernetes label key")
            if not _LABEL_VALUE.match(value):
                raise ValueError(f"{value!r} (label {key}) is not a Kubernetes label value")
        return selector

    @field_validator("model_label")
    @classmethod
    def _model_label_is_a_key(cls, key: str) -> str:
        if not _LABEL_KEY.match(key):
            raise ValueError(f"{key!r} is not a Kubernetes label key")
        return key

    @model_validator(mode="after")
    def _timings_nest(self) -> KubernetesSettings:
        # client-go's rule: retry < renew deadline < lease duration, or two leaders can overlap.
        if not self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError("need retry_period_s < renew_deadline_s < lease_duration_s")
        return self


class StaticWorker(StrictModel):
    """One listening worker of a fixed list (backend: static)."""

    worker_id: str = Field(
        min_length=1,
        pattern=r"^[^@]+@.+$",
        description="Its --worker-id, MODEL@NAME; the gateway refuses a worker that says another.",
    )
    model: str = Field(min_length=1, description="The registry name of the model it serves (`remote: true`).")
    endpoint: str = Field(pattern=r"^tcp://", description="Its --listen address as gateways reach it.")
    replica: int = Field(0, ge=0, description="Its replica index within the model.")
    public_key_file: Path | None = Field(
        None,
        description="Its CURVE public key (`gateway keys`), relative to the registry file. Unset: "
        "`worker_public_key_file`.",
    )


class ClusterConfig(StrictModel):
    """Cluster mode: workers are services of their own, found through `backend`; gateways are
    active-active and one of them leads the decisions that must be made once."""

    backend: Literal["etcd", "kubernetes", "static"] = Field(
        description="Where membership and leadership live: etcd (any host), the Kubernetes API, or "
        "static: the fixed list `workers` (no leader; every gateway decides for itself)."
    )
    identity: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        description="This gateway's name as leader (logs, the Lease's holderIdentity, the etcd leader key). "
        "Unset: the host name and process id; every gateway's must differ.",
    )
    etcd: EtcdSettings | None = Field(None, description="Required with backend: etcd.")
    kubernetes: KubernetesSettings | None = Field(
        None, description="With backend: kubernetes; every field has a default."
    )
    workers: list[StaticWorker] = Field(
        default_factory=list, description="With backend: static, the listening workers to connect to."
    )
    secret_key_file: Path | None = Field(
        None,
        description="This gateway's CURVE secret key (`gateway keys`), relative to the registry file: it "
        "connects to every listening worker with it, and each worker admits only the gateway keys it "
        "was given. Required in the registry.",
    )
    worker_public_key_file: Path | None = Field(
        None,
        description="The workers' shared CURVE public key, for workers whose record names none (always "
        "so on Kubernetes; on etcd, when they registered without one).",
    )

    @model_validator(mode="after")
    def _backend_has_its_section(self) -> ClusterConfig:
        if self.backend == "etcd":
            if self.etcd is None:
                raise ValueError("backend: etcd needs an `etcd:` section (at least `endpoints`)")
            if self.kubernetes is not None:
                raise ValueError("a `kubernetes:` section is only read with backend: kubernetes")
        elif self.etcd is not None:
            raise ValueError("an `etcd:` section is only read with backend: etcd")
        if self.backend == "static":
            if not self.workers:
                raise ValueError("backend: static needs a `workers:` list")
            if self.kubernetes is not None:
                raise ValueError("a `kubernetes:` section is only read with backend: kubernetes")
            keyless = [w.worker_id for w in self.workers if w.public_key_file is None]
            if keyless and self.worker_public_key_file is None:
                raise ValueError(
                    f"workers {keyless} name no public_key_file, and worker_public_key_file is unset"
                )
        elif self.workers:
            raise ValueError("a `workers:` list is only read with backend: static")
        return self

    def kubernetes_settings(self) -> KubernetesSettings:
        """The Kubernetes section, its defaults when the file gave none."""
        return self.kubernetes if self.kubernetes is not None else KubernetesSettings()
