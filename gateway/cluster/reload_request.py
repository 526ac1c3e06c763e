"""A registry reload asked of the cluster's leader: which models, which workers, who asked.

Imported by the gateway process (gateway.cluster.etcd_reloads stores it in etcd;
gateway.workers.reload_plan and cluster_reloads plan and ask with it). Owns no state, and imports
no etcd client, so the single-host gateway can import the reload plan without one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReloadRequest:
    fingerprint: str
    models: tuple[str, ...]
    workers: dict[str, str]  # worker id -> its incarnation (PID-EPOCH) when the reload was asked for
    by: str  # the gateway that asked

    def encode(self) -> bytes:
        body = {"models": list(self.models), "workers": self.workers, "by": self.by}
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def decode(cls, fingerprint: str, value: bytes) -> ReloadRequest:
        body: dict[str, Any] = json.loads(value)
        return cls(fingerprint, tuple(body["models"]), dict(body["workers"]), str(body["by"]))
