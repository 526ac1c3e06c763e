"""Cluster mode's config model and the membership table every backend feeds.

Runs in the pytest process, no I/O: `ClusterConfig` (what it accepts, what it refuses and where
an error points), the worker record's encoding, and `MemberTable`'s join/leave difference.
"""

from __future__ import annotations

import asyncio

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from gateway.cluster.membership import Capacity, MembershipChange, MemberTable, WorkerRecord
from gateway.cluster.settings import ClusterConfig, KubernetesSettings


class _Server(BaseModel):
    """How the registry's server section will hold it (the lead hooks it in there)."""

    model_config = ConfigDict(extra="forbid")
    cluster: ClusterConfig | None = None


def errors(raw: dict[str, object]) -> list[tuple[str, str]]:
    with pytest.raises(ValidationError) as caught:
        _Server.model_validate(raw)
    return [(".".join(str(p) for p in e["loc"]), e["msg"]) for e in caught.value.errors()]


def test_an_etcd_section_as_written_in_yaml() -> None:
    raw = yaml.safe_load(
        """
        cluster:
          backend: etcd
          identity: gateway-a
          etcd:
            endpoints: ["10.0.0.5:2379", "etcd-1.internal:2379", "[fd00::5]:2379"]
            prefix: /prod/
            worker_ttl_s: 6
        """
    )
    config = _Server.model_validate(raw).cluster
    assert config is not None and config.etcd is not None
    assert config.etcd.endpoints[2] == "[fd00::5]:2379"
    assert (config.etcd.worker_ttl_s, config.etcd.leader_ttl_s, config.etcd.prefix) == (6, 10, "/prod/")
    with pytest.raises(ValidationError, match="frozen"):
        config.etcd.prefix = "/other/"  # type: ignore[misc]


def test_kubernetes_needs_no_section_and_has_working_defaults() -> None:
    config = ClusterConfig.model_validate({"backend": "kubernetes"})
    settings = config.kubernetes_settings()
    assert settings == KubernetesSettings()
    assert settings.retry_period_s < settings.renew_deadline_s < settings.lease_duration_s
    assert settings.worker_selector["app.kubernetes.io/component"] == "worker"


@pytest.mark.parametrize(
    ("raw", "where", "says"),
    [
        ({"backend": "etcd"}, "cluster", "needs an `etcd:` section"),
        ({"backend": "consul"}, "cluster.backend", "'etcd', 'kubernetes' or 'static'"),
        ({"backend": "etcd", "etcd": {"endpoints": []}}, "cluster.etcd.endpoints", "at least 1"),
        (
            {"backend": "etcd", "etcd": {"endpoints": ["http://10.0.0.5:2379"]}},
            "cluster.etcd.endpoints",
            "not host:port",
        ),
        (
            {"backend": "etcd", "etcd": {"endpoints": ["e:2379"], "ttl": 5}},
            "cluster.etcd.ttl",
            "Extra inputs",
        ),
        (
            {"backend": "etcd", "etcd": {"endpoints": ["e:2379"], "prefix": "gw"}},
            "cluster.etcd.prefix",
            "pattern",
        ),
        (
            {"backend": "etcd", "etcd": {"endpoints": ["e:2379"], "worker_ttl_s": 1}},
            "cluster.etcd.worker_ttl_s",
            "greater than or equal to 2",
        ),
        (
            {
                "backend": "etcd",
                "etcd": {"endpoints": ["e:2379"], "leader_ttl_s": 3, "request_timeout_s": 1.5},
            },
            "cluster.etcd",
            "below a third",
        ),
        (
            {"backend": "etcd", "etcd": {"endpoints": ["e:2379"]}, "kubernetes": {}},
            "cluster",
            "only read with backend: kubernetes",
        ),
        (
            {"backend": "kubernetes", "etcd": {"endpoints": ["e:2379"]}},
            "cluster",
            "only read with backend: etcd",
        ),
        (
            {"backend": "kubernetes", "kubernetes": {"worker_selector": {"app": "has space"}}},
            "cluster.kubernetes.worker_selector",
            "not a Kubernetes label value",
        ),
        (
            {"backend": "kubernetes", "kubernetes": {"model_label": "-bad-"}},
            "cluster.kubernetes.model_label",
            "not a Kubernetes label key",
        ),
        (
            {"backend": "kubernetes", "kubernetes": {"lease_duration_s": 10, "renew_deadline_s": 10}},
            "cluster.kubernetes",
            "renew_deadline_s < lease_duration_s",
        ),
        (
            {"backend": "kubernetes", "kubernetes": {"namespace": "Prod"}},
            "cluster.kubernetes.namespace",
            "pattern",
        ),
        # The registry's shared rules (gateway.config.strict_model): pydantic alone reads true as 1.
        (
            {"backend": "etcd", "etcd": {"endpoints": ["e:2379"], "worker_ttl_s": True}},
            "cluster.etcd.worker_ttl_s",
            "true/false is not a number",
        ),
        (
            {"backend": "kubernetes", "kubernetes": {"request_timeout_s": float("nan")}},
            "cluster.kubernetes.request_timeout_s",
            "finite number",
        ),
    ],
)
def test_each_mistake_is_refused_at_its_field(raw: dict[str, object], where: str, says: str) -> None:
    found = errors({"cluster": raw})
    assert any(loc == where and says in msg for loc, msg in found), found


def test_every_field_is_described() -> None:
    from gateway.cluster.settings import EtcdSettings

    for model in (ClusterConfig, EtcdSettings, KubernetesSettings):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


# ---- the record and the table -----------------------------------------------------------------


def worker(replica: int, port: int = 5555) -> WorkerRecord:
    return WorkerRecord(
        worker_id=f"qwen@host-{replica}",
        model="qwen",
        replica=replica,
        endpoint=f"tcp://10.0.0.{replica}:{port}",
        capacity=Capacity(max_jobs=4, max_queue=16),
        protocol_version=3,
    )


def test_a_record_round_trips_and_a_newer_workers_extra_fields_are_ignored() -> None:
    record = worker(1)
    assert WorkerRecord.decode(record.encode()) == record
    newer = record.encode().replace(b"{", b'{"gpu_memory_gb": 80, ', 1)
    assert WorkerRecord.decode(newer) == record
    with pytest.raises(ValidationError, match="endpoint"):
        WorkerRecord.decode(record.encode().replace(b"tcp://", b"ipc://"))


def test_the_table_emits_exactly_the_difference() -> None:
    async def scenario() -> list[MembershipChange]:
        table = MemberTable()
        a, b, c = worker(1), worker(2), worker(3)
        table.replace({a.worker_id: a, b.worker_id: b})
        table.put(a)  # the same record again: nothing
        moved = worker(2, port=6000)  # restarted on another port
        table.replace({a.worker_id: a, moved.worker_id: moved, c.worker_id: c})
        table.remove("nobody")
        table.remove(a.worker_id)
        assert dict(table.members()) == {moved.worker_id: moved, c.worker_id: c}
        table.put(worker(9))  # a marker: nothing else may come before it
        changes = table.changes()
        return [await asyncio.wait_for(anext(changes), 1) for _ in range(7)]

    seen = [(c.kind, c.record.worker_id, c.record.endpoint) for c in asyncio.run(scenario())]
    assert seen == [
        ("join", "qwen@host-1", "tcp://10.0.0.1:5555"),
        ("join", "qwen@host-2", "tcp://10.0.0.2:5555"),
        ("leave", "qwen@host-2", "tcp://10.0.0.2:5555"),
        ("join", "qwen@host-2", "tcp://10.0.0.2:6000"),
        ("join", "qwen@host-3", "tcp://10.0.0.3:5555"),
        ("leave", "qwen@host-1", "tcp://10.0.0.1:5555"),
        ("join", "qwen@host-9", "tcp://10.0.0.9:5555"),
    ]


def test_the_backend_named_in_config_is_the_one_made() -> None:
    from gateway.cluster.backends import identity, make_leader, make_membership
    from gateway.cluster.etcd_leader import EtcdLeader
    from gateway.cluster.etcd_membership import EtcdMembership
    from gateway.cluster.k8s_leader import LeaseLeader
    from gateway.cluster.k8s_membership import KubernetesMembership

    etcd = ClusterConfig.model_validate(
        {"backend": "etcd", "identity": "gw-a", "etcd": {"endpoints": ["e:2379"]}}
    )
    assert isinstance(make_membership(etcd), EtcdMembership)
    leader = make_leader(etcd)
    assert isinstance(leader, EtcdLeader) and leader.identity == "gw-a"
    kubernetes = ClusterConfig.model_validate(
        {"backend": "kubernetes", "kubernetes": {"api_server": "http://127.0.0.1:8001", "namespace": "ns"}}
    )
    assert isinstance(make_membership(kubernetes), KubernetesMembership)
    assert isinstance(make_leader(kubernetes), LeaseLeader)
    assert identity(kubernetes) != identity(
        ClusterConfig.model_validate({"backend": "kubernetes", "identity": "x"})
    )
