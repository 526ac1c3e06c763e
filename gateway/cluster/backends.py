"""Picks the membership and leadership backend that `server.cluster` names.

Runs in the gateway process, at start-up. The gateway calls these two functions and sees only the
`Membership` and `Leader` interfaces; each backend's client library is imported only when that
backend is configured.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import zmq.auth

from gateway.cluster.membership import Leader, Membership, WorkerRecord
from gateway.cluster.settings import ClusterConfig


def identity(config: ClusterConfig) -> str:
    """This gateway's name as a leader: the configured one, else HOSTNAME-PID (a pod's name in Kubernetes)."""
    return config.identity or f"{socket.gethostname()}-{os.getpid()}"


def static_records(config: ClusterConfig) -> list[WorkerRecord]:
    """The records of a static list, each with its public key read from its file (or none: the
    shared worker key)."""
    records = []
    for worker in config.workers:
        key = None
        if worker.public_key_file is not None:
            public, _ = zmq.auth.load_certificate(str(worker.public_key_file))
            key = public.decode("ascii")
        records.append(
            WorkerRecord(
                worker_id=worker.worker_id,
                model=worker.model,
                replica=worker.replica,
                endpoint=worker.endpoint,
                public_key=key,
            )
        )
    return records


def make_membership(config: ClusterConfig) -> Membership:
    if config.backend == "static":
        from gateway.cluster.static_membership import StaticMembership

        return StaticMembership(static_records(config))
    if config.backend == "etcd":
        from gateway.cluster.etcd_membership import EtcdMembership

        assert config.etcd is not None  # ClusterConfig's validator
        return EtcdMembership(config.etcd)
    from gateway.cluster.k8s_membership import KubernetesMembership

    return KubernetesMembership(config.kubernetes_settings())


def make_leader(config: ClusterConfig, on_change: Callable[[bool], None] | None = None) -> Leader:
    if config.backend == "static":
        raise ValueError("backend: static has no leader")
    if config.backend == "etcd":
        from gateway.cluster.etcd_leader import EtcdLeader

        assert config.etcd is not None
        return EtcdLeader(config.etcd, identity(config), on_change)
    from gateway.cluster.k8s_leader import LeaseLeader

    return LeaseLeader(config.kubernetes_settings(), identity(config), on_change)
