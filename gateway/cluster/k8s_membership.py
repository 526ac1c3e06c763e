"""The gateway's view of the workers from the Kubernetes API: the EndpointSlices of the worker
Services (discovery.k8s.io/v1), listed, then watched from the listing's resourceVersion.

Runs in the gateway process, on its asyncio loop. Owns `KubernetesMembership`, one implementation
of `gateway.cluster.membership.Membership` (its task and table are kept by its base,
`gateway.cluster.backend_base.WatchingMembership`), and `api_client`, which the Lease leader shares.

Client: lightkube (asyncio, httpx2 underneath, typed models of every resource, in-cluster and
kubeconfig authentication), pointed at `api_server` when given (tests use a plain-http fake).

Records: each worker Service is headless, labelled with `worker_selector` and `model_label`; the
EndpointSlice controller copies those labels to its slices. Each endpoint that is ready (an
unset `ready` counts as ready, as the API documents) and not terminating is a worker
`MODEL@POD` at tcp://ADDRESS:PORT (the port named `port_name`). Its key and capacity are not in a
slice: the cluster's shared worker key, and what the worker's hello says.

Failures: a watch whose resourceVersion is too old (410 Gone, as a status or as an ERROR event)
is answered by a fresh listing; so is a watch silent for longer than the server was asked to
keep it open (a dead connection). While the API cannot be reached the view stays as it was, with
one warning, and is compared with a fresh listing when it answers again, with one info line.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import httpx2
from lightkube import AsyncClient, KubeConfig
from lightkube.config.kubeconfig import SERVICE_ACCOUNT
from lightkube.config.models import Cluster, User
from lightkube.core.exceptions import ApiError
from lightkube.core.exceptions import ConfigError as LightkubeConfigError
from lightkube.resources.discovery_v1 import EndpointSlice

from gateway.cluster.backend_base import WatchingMembership
from gateway.cluster.membership import WorkerRecord
from gateway.cluster.settings import KubernetesSettings
from gateway.config.registry import ConfigError

logger = logging.getLogger(__name__)

# The API server closes a watch after this long; a silence longer than that (plus the deadline of a
# call) means the connection is dead, and a relisting follows.
WATCH_SERVER_TIMEOUT_S = 240
# What "the API cannot be reached or failed" looks like; ApiError is an HTTPStatusError.
API_TROUBLE: tuple[type[BaseException], ...] = (httpx2.HTTPError, OSError, TimeoutError)
_ORDINAL = re.compile(r"-(\d+)$")


def api_client(settings: KubernetesSettings) -> AsyncClient:
    _quiet_request_log()
    if settings.api_server is not None:  # e.g. `kubectl proxy`, which adds the credentials itself
        config = KubeConfig.from_one(
            cluster=Cluster(server=settings.api_server), user=User(), namespace=settings.namespace
        )
    else:
        try:
            config = KubeConfig.from_env()  # the pod's service account, else $KUBECONFIG or ~/.kube/config
        except LightkubeConfigError as exc:
            # lightkube names only the last place it looked; say where else, and what to set.
            raise KubernetesCredentialsError(
                "backend kubernetes found no credentials for the API server: not in a pod (no service "
                f"account at {SERVICE_ACCOUNT}) and {exc}; run in a pod with a service account, set "
                "$KUBECONFIG, or set server.cluster.kubernetes.api_server (e.g. kubectl proxy's URL)"
            ) from None
    return AsyncClient(
        config, namespace=settings.namespace, timeout=httpx2.Timeout(settings.request_timeout_s)
    )


class KubernetesCredentialsError(ConfigError):
    """The gateway cannot tell where the API server is or how to authenticate to it."""


def _quiet_request_log() -> None:
    """httpx2 (lightkube's transport) logs every request at INFO: with the Lease read every
    retry_period_s by every gateway, that is a line or two every few seconds for the gateway's
    life. Shown at DEBUG only; its warnings stay."""
    request_log = logging.getLogger("httpx2")
    if request_log.level == logging.NOTSET and not request_log.isEnabledFor(logging.DEBUG):
        request_log.setLevel(logging.WARNING)


def is_gone(exc: BaseException) -> bool:
    """410 Gone: the resourceVersion asked for is older than the API server keeps."""
    return isinstance(exc, ApiError) and exc.status.code == 410


def slice_workers(endpoint_slice: EndpointSlice, settings: KubernetesSettings) -> dict[str, WorkerRecord]:
    """The ready workers of one EndpointSlice, by worker id."""
    name = endpoint_slice.metadata.name if endpoint_slice.metadata else "?"
    labels = (endpoint_slice.metadata.labels if endpoint_slice.metadata else None) or {}
    model = labels.get(settings.model_label)
    if model is None:
        logger.warning(
            "EndpointSlice %s has no %s label: its endpoints are ignored", name, settings.model_label
        )
        return {}
    ports = [p.port for p in endpoint_slice.ports or [] if p.name == settings.port_name and p.port]
    if not ports:
        logger.warning(
            "EndpointSlice %s has no port named %s: its endpoints are ignored", name, settings.port_name
        )
        return {}
    workers = {}
    for endpoint in endpoint_slice.endpoints or []:
        conditions = endpoint.conditions
        if conditions is not None and (conditions.ready is False or conditions.terminating):
            continue
        pod = endpoint.targetRef.name if endpoint.targetRef is not None else endpoint.hostname
        if not pod or not endpoint.addresses:
            continue
        address = endpoint.addresses[0]
        host = f"[{address}]" if endpoint_slice.addressType == "IPv6" else address
        ordinal = _ORDINAL.search(pod)
        record = WorkerRecord(
            worker_id=f"{model}@{pod}",
            model=model,
            replica=int(ordinal.group(1)) if ordinal else 0,
            endpoint=f"tcp://{host}:{ports[0]}",
        )
        workers[record.worker_id] = record
    return workers


class KubernetesMembership(WatchingMembership):
    _task_name = "k8s-membership"

    def __init__(self, settings: KubernetesSettings, client: AsyncClient | None = None) -> None:
        super().__init__()
        self._settings = settings
        # Only Services that name their model (None: the label exists), not e.g. a governing Service.
        self._selector: dict[str, Any] = {**settings.worker_selector, settings.model_label: None}
        self._client = client if client is not None else api_client(settings)
        self._owns_client = client is None
        self._slices: dict[str, dict[str, WorkerRecord]] = {}

    async def _close(self) -> None:
        if self._owns_client:
            await self._client.close()

    # -- listing and watching -----------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                version = await self._list()
                await self._watch(version)
            except API_TROUBLE as exc:
                if is_gone(exc):
                    logger.info("EndpointSlice watch too old (410 Gone): listing anew")
                    continue
                if self._connected:
                    logger.warning(
                        "Kubernetes API unreachable (%s): routing goes on with the last membership "
                        "(%d workers)",
                        _describe(exc),
                        len(self._table.members()),
                    )
                self._connected = False
                await asyncio.sleep(self._settings.retry_period_s)

    async def _list(self) -> str:
        listing = self._client.list(EndpointSlice, namespace=self._settings.namespace, labels=self._selector)
        self._slices = {}
        async for endpoint_slice in listing:
            self._slices[_name(endpoint_slice)] = slice_workers(endpoint_slice, self._settings)
        was_synced, was_connected = self._synced.is_set(), self._connected
        self._update()
        self._connected = True
        self._synced.set()
        if was_synced and not was_connected:
            logger.info("Kubernetes API reachable again: %d workers", len(self._table.members()))
        return listing.resourceVersion

    async def _watch(self, version: str) -> None:
        watch = self._client.watch(
            EndpointSlice,
            namespace=self._settings.namespace,
            labels=self._selector,
            resource_version=version,
            server_timeout=WATCH_SERVER_TIMEOUT_S,
        )
        events: Any = watch.__aiter__()  # an async generator: closed below
        silence_s = WATCH_SERVER_TIMEOUT_S + self._settings.request_timeout_s
        try:
            while True:
                kind, endpoint_slice = await asyncio.wait_for(anext(events), silence_s)
                if kind in ("ADDED", "MODIFIED"):
                    self._slices[_name(endpoint_slice)] = slice_workers(endpoint_slice, self._settings)
                elif kind == "DELETED":
                    self._slices.pop(_name(endpoint_slice), None)
                self._update()
        except TimeoutError:
            logger.info("no EndpointSlice event for %.0f s: listing anew", silence_s)
        finally:
            try:
                await asyncio.wait_for(events.aclose(), self._settings.request_timeout_s)
            except (httpx2.HTTPError, OSError, TimeoutError, RuntimeError):
                pass  # the connection is gone already

    def _update(self) -> None:
        """One worker may move between slices: the view is the union of every slice's workers."""
        workers: dict[str, WorkerRecord] = {}
        for records in self._slices.values():
            workers.update(records)
        self._table.replace(workers)


def _name(endpoint_slice: Any) -> str:
    return str(endpoint_slice.metadata.name)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiError):
        return f"{exc.status.code} {exc.status.reason}"
    return type(exc).__name__
