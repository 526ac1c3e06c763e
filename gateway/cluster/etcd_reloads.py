"""Registry reloads that the workers of a cluster must follow, as records in etcd: asked for by any
gateway, carried out by the leading one (gateway.workers.cluster_reloads).

Runs in the gateway process, on its asyncio loop. Owns the keys under `PREFIX/reloads/`:

- `pending/FINGERPRINT`: a reload asked for and not finished. FINGERPRINT names the new worker
  settings of the models that change (gateway.workers.reload_plan), so two gateways asking for
  the same change (the operator reloads each) ask once: the key is created only if absent. Its
  value (JSON) names the models and, per loaded worker, its incarnation (`PID-EPOCH`) when asked:
  the leader restarts a worker that still runs that incarnation, and no other.
- `applied/FINGERPRINT`: the last reload of that change that finished, with each worker's
  incarnation after it; a gateway asking for the same change again leaves those workers be.

No lease: a reload asked for outlives the gateway that asked. The decisions themselves (which
worker to unload, to load) are the leader's claims under `PREFIX/decisions/`, read here too, and
those under `reload/FINGERPRINT/` deleted when the reload finishes.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aetcd.exceptions

from gateway.cluster.etcd_session import UNREACHABLE, EtcdSession
from gateway.cluster.reload_request import ReloadRequest
from gateway.cluster.settings import EtcdSettings

logger = logging.getLogger(__name__)

TROUBLE = (*UNREACHABLE, aetcd.exceptions.ClientError)


class EtcdReloads:
    def __init__(self, settings: EtcdSettings) -> None:
        self._prefix = settings.prefix
        self._session = EtcdSession(settings.endpoints, settings.request_timeout_s)
        self._unreadable: set[str] = set()  # pending keys that are no request, reported once

    def _pending_key(self, fingerprint: str) -> bytes:
        return f"{self._prefix}reloads/pending/{fingerprint}".encode()

    def _applied_key(self, fingerprint: str) -> bytes:
        return f"{self._prefix}reloads/applied/{fingerprint}".encode()

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await self._session.call(method, *args, **kwargs)
        except TROUBLE as exc:
            await self._session.failed(exc)
            raise

    async def ask(self, request: ReloadRequest) -> ReloadRequest:
        """Record `request` unless the same change is pending already; returns the pending one."""
        key = self._pending_key(request.fingerprint)
        tx = self._session.client.transactions
        created, responses = await self._call(
            "transaction",
            compare=[tx.create(key) == 0],
            success=[tx.put(key, request.encode())],
            failure=[tx.get(key)],
        )
        if created:
            return request
        ((value, _kv),) = responses[0]
        return ReloadRequest.decode(request.fingerprint, value)

    async def applied(self, fingerprint: str) -> dict[str, str]:
        """Each worker's incarnation after the last finished reload of this change (none: {})."""
        found = await self._call("get", self._applied_key(fingerprint))
        return dict(json.loads(found.value)["workers"]) if found is not None else {}

    async def pending(self) -> list[ReloadRequest]:
        """Every reload asked for and not finished, the oldest first."""
        prefix = f"{self._prefix}reloads/pending/".encode()
        listing = await self._call("get_prefix", prefix)
        requests = []
        for kv in sorted(listing, key=lambda kv: kv.create_revision):
            key = kv.key.decode(errors="replace")
            try:
                requests.append(ReloadRequest.decode(key[len(prefix) :], kv.value))
            except (ValueError, KeyError, TypeError) as exc:  # not written by a gateway: said once
                if key not in self._unreadable:
                    self._unreadable.add(key)
                    logger.error("etcd key %s is not a reload request (%s): skipped; delete it", key, exc)
        return requests

    async def claimed(self, fingerprint: str) -> set[str]:
        """The decisions taken for this change so far (names as given to `Leader.claim`)."""
        decisions = f"{self._prefix}decisions/"
        listing = await self._call("get_prefix", f"{decisions}reload/{fingerprint}/".encode())
        return {kv.key.decode()[len(decisions) :] for kv in listing}

    async def finish(self, request: ReloadRequest, incarnations: dict[str, str], leader: str) -> None:
        """The reload is done: record each worker's incarnation now, then forget the request and
        the decisions taken for it (each named after an incarnation that has now ended, so none
        can come up again; left in etcd, every reload would add its keys for good)."""
        body = {"workers": incarnations, "models": list(request.models), "by": leader}
        await self._call(
            "put", self._applied_key(request.fingerprint), json.dumps(body, sort_keys=True).encode()
        )
        await self._call("delete", self._pending_key(request.fingerprint))
        await self._call("delete_prefix", f"{self._prefix}decisions/reload/{request.fingerprint}/".encode())

    async def finished(self, fingerprint: str) -> bool:
        """Whether no reload of this change is pending (the last one finished)."""
        return await self._call("get", self._pending_key(fingerprint)) is None

    async def leader(self) -> str | None:
        """The identity of the gateway that leads now, as etcd says (None: no leader)."""
        found = await self._call("get", f"{self._prefix}leader".encode())
        return found.value.decode(errors="replace") if found is not None else None

    async def close(self) -> None:
        await self._session.close()
