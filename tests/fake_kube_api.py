"""A fake Kubernetes API server that keeps the API's contract for what the cluster backends use.

Runs in the pytest process: a Quart app on Hypercorn, on the test's own event loop, plain http on
a free loopback port. It serves, with the JSON shapes a real API server sends:
- EndpointSlices (discovery.k8s.io/v1): list with a label selector and the list's resourceVersion;
  watch from a resourceVersion (newline-delimited events ADDED / MODIFIED / DELETED, each object
  carrying its own resourceVersion; closed after timeoutSeconds); a resourceVersion older than
  the history kept gets an ERROR event with a 410 Expired Status, as the real server does.
- Leases (coordination.k8s.io/v1): get (404 NotFound), create (409 AlreadyExists), replace with
  optimistic concurrency (409 Conflict when metadata.resourceVersion is not the current one), and
  delete.
The test changes the world through `apply_slice` / `delete_slice`, drops watch connections,
forgets history (`compact`) or makes every request fail with 503 (`down`); `requests` records
what was asked, with the status answered.

Like a real API server it may ask for credentials and speak TLS: given a `token`, a request without
`Authorization: Bearer TOKEN` is answered 401 Unauthorized; given a certificate and its key
(`self_signed_certificate` makes them with the openssl command), it serves https. Then a client
finds it the way a pod's does: a kubeconfig (`kubeconfig`) naming the server, the CA and a token
file. `FakeKubeApiThread` runs it on an event loop of its own, for tests whose gateways are
separate processes and which wait synchronously (tests.harness.wait_until).
"""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
import socket
import subprocess
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from hypercorn.asyncio import serve
from hypercorn.config import Config
from quart import Quart, Response, request

from tests.harness import free_port, wait_until

T = TypeVar("T")
SLICES = "/apis/discovery.k8s.io/v1/namespaces/<namespace>/endpointslices"
LEASES = "/apis/coordination.k8s.io/v1/namespaces/<namespace>/leases"


@dataclass(frozen=True)
class Event:
    version: int
    kind: str  # ADDED, MODIFIED, DELETED
    obj: dict[str, Any]


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code,
    }  # fmt: skip


def endpoint_slice(
    name: str,
    model: str,
    pods: dict[str, str],
    *,
    port: int = 5555,
    not_ready: tuple[str, ...] = (),
    terminating: tuple[str, ...] = (),
    labels: dict[str, str] | None = None,
    port_name: str = "worker",
) -> dict[str, Any]:
    """An EndpointSlice as the EndpointSlice controller writes it for a headless worker Service
    (pods: pod name -> IP)."""
    service = f"llm-workers-{model.replace('.', '-')}"
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {
            "name": name,
            "generateName": f"{service}-",
            "namespace": "llm-gateway",
            "labels": labels if labels is not None else {
                "app.kubernetes.io/component": "worker",
                "app.kubernetes.io/part-of": "llm-gateway",
                "llm-gateway.io/model": model,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                "kubernetes.io/service-name": service,
                "service.kubernetes.io/headless": "",
            },
            "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": service,
                                 "uid": str(uuid.uuid5(uuid.NAMESPACE_DNS, service)),
                                 "controller": True, "blockOwnerDeletion": True}],
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [ip],
                "conditions": {"ready": pod not in not_ready and pod not in terminating,
                               "serving": pod not in not_ready, "terminating": pod in terminating},
                "hostname": pod,
                "targetRef": {"kind": "Pod", "namespace": "llm-gateway", "name": pod,
                              "uid": str(uuid.uuid5(uuid.NAMESPACE_DNS, pod))},
                "nodeName": "gpu-node-1",
            }
            for pod, ip in pods.items()
        ],
        "ports": [{"name": port_name, "protocol": "TCP", "port": port}],
    }  # fmt: skip


class FakeKubeApi:
    def __init__(self, *, token: str | None = None, tls: tuple[Path, Path] | None = None) -> None:
        """`token`: the bearer token every request must carry; `tls`: (certificate, key) to serve
        https with."""
        self.port = free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.token = token
        self.tls = tls
        self.version = 1000
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}  # (kind, name) -> object
        self.history: list[Event] = []
        self.oldest_kept = 0  # a watch from below this version gets 410
        self.down = False
        self.requests: list[tuple[str, str, int]] = []  # method, path?query, status answered
        self._watches: set[asyncio.Queue[Event | None]] = set()
        self._stop = asyncio.Event()
        self._server: asyncio.Task[None] | None = None
        self.app = self._make_app()

    # -- what a test does -------------------------------------------------------------------------

    async def start(self) -> None:
        config = Config()
        config.bind = [f"127.0.0.1:{self.port}"]
        config.graceful_timeout = 0.5
        config.accesslog = None
        config.errorlog = None
        if self.tls is not None:
            config.certfile, config.keyfile = (str(path) for path in self.tls)
        self._server = asyncio.create_task(serve(self.app, config, shutdown_trigger=self._stop.wait))

    async def close(self) -> None:
        self.drop_watches()
        self._stop.set()
        if self._server is not None:
            await self._server

    def apply_slice(self, obj: dict[str, Any]) -> None:
        self._write("EndpointSlice", copy.deepcopy(obj))

    def delete_slice(self, name: str) -> None:
        obj = self.objects.pop(("EndpointSlice", name))
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self._publish(Event(self.version, "DELETED", obj))

    def drop_watches(self) -> None:
        """End every watch response (as an API server restart or a load balancer would)."""
        for queue in self._watches:
            queue.put_nowait(None)

    def compact(self) -> None:
        """Forget the history: a watch from any version before now gets 410 Gone."""
        self.history.clear()
        self.oldest_kept = self.version

    def lease(self, name: str) -> dict[str, Any] | None:
        return self.objects.get(("Lease", name))

    def count(self, method: str, path_part: str, code: int | None = None) -> int:
        return sum(1 for m, p, c in self.requests if m == method and path_part in p and code in (None, c))

    # -- the store ----------------------------------------------------------------------------------

    def _write(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        name = obj["metadata"]["name"]
        existed = (kind, name) in self.objects
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        obj["metadata"].setdefault("uid", str(uuid.uuid4()))
        obj["metadata"].setdefault("creationTimestamp", "2026-11-24T10:00:00Z")
        self.objects[(kind, name)] = obj
        self._publish(Event(self.version, "MODIFIED" if existed else "ADDED", obj))
        return obj

    def _publish(self, event: Event) -> None:
        self.history.append(event)
        for queue in self._watches:
            queue.put_nowait(event)

    # -- the HTTP side ------------------------------------------------------------------------------

    def _make_app(self) -> Quart:
        app = Quart(__name__)
        app.config["RESPONSE_TIMEOUT"] = None  # watches stream for as long as they are asked to

        @app.before_request
        async def refuse_while_down() -> Any:
            if self.down:
                return status(503, "ServiceUnavailable", "the API server is down"), 503
            if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
                return status(401, "Unauthorized", "Unauthorized"), 401
            return None

        @app.after_request
        async def record(response: Response) -> Response:
            query = request.query_string.decode()
            self.requests.append(
                (request.method, request.path + ("?" + query if query else ""), response.status_code)
            )
            return response

        @app.get(SLICES)
        async def slices(namespace: str) -> Any:
            selector = _selector(request.args.get("labelSelector", ""))
            if request.args.get("watch") == "true":
                return await self._watch(selector, request.args)
            items = [
                o for (kind, _), o in sorted(self.objects.items())
                if kind == "EndpointSlice" and _selects(selector, o)
            ]  # fmt: skip
            return {
                "kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": str(self.version)}, "items": items,
            }  # fmt: skip

        @app.get(LEASES + "/<name>")
        async def get_lease(namespace: str, name: str) -> Any:
            obj = self.lease(name)
            if obj is None:
                return _not_found(name), 404
            return obj

        @app.post(LEASES)
        async def create_lease(namespace: str) -> Any:
            body = await request.get_json()
            name = body["metadata"]["name"]
            if self.lease(name) is not None:
                message = f'leases.coordination.k8s.io "{name}" already exists'
                return status(409, "AlreadyExists", message), 409
            body["metadata"]["namespace"] = namespace
            return self._write("Lease", body), 201

        @app.put(LEASES + "/<name>")
        async def replace_lease(namespace: str, name: str) -> Any:
            body = await request.get_json()
            current = self.lease(name)
            if current is None:
                return _not_found(name), 404
            if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                message = (
                    f'Operation cannot be fulfilled on leases.coordination.k8s.io "{name}": the object has '
                    "been modified; please apply your changes to the latest version and try again"
                )
                return status(409, "Conflict", message), 409
            body["metadata"]["uid"] = current["metadata"]["uid"]
            return self._write("Lease", body)

        @app.delete(LEASES + "/<name>")
        async def delete_lease(namespace: str, name: str) -> Any:
            if self.objects.pop(("Lease", name), None) is None:
                return _not_found(name), 404
            return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}

        return app

    async def _watch(self, selector: dict[str, str | None], args: Any) -> Any:
        since = int(args.get("resourceVersion") or self.version)
        timeout_s = float(args.get("timeoutSeconds") or 1800)
        queue: asyncio.Queue[Event | None] = asyncio.Queue()
        self._watches.add(queue)
        backlog = [e for e in self.history if e.version > since]

        async def stream() -> AsyncIterator[bytes]:
            try:
                if since < self.oldest_kept:
                    message = f"too old resource version: {since} ({self.oldest_kept})"
                    yield _line("ERROR", status(410, "Expired", message))
                    return
                sent = since
                for event in backlog:
                    sent = event.version
                    if event.obj["kind"] == "EndpointSlice" and _selects(selector, event.obj):
                        yield _line(event.kind, event.obj)
                deadline = asyncio.get_running_loop().time() + timeout_s
                while True:
                    remaining = deadline - asyncio.get_running_loop().time()
                    try:
                        arrived = await asyncio.wait_for(queue.get(), max(remaining, 0))
                    except TimeoutError:
                        return
                    if arrived is None or self.down:
                        return
                    event = arrived
                    if (
                        event.version > sent
                        and event.obj["kind"] == "EndpointSlice"
                        and _selects(selector, event.obj)
                    ):
                        yield _line(event.kind, event.obj)
            finally:
                self._watches.discard(queue)

        return Response(stream(), 200, {"Content-Type": "application/json"})


def _line(kind: str, obj: dict[str, Any]) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


def _not_found(name: str) -> dict[str, Any]:
    return status(404, "NotFound", f'leases.coordination.k8s.io "{name}" not found')


def _selector(text: str) -> dict[str, str | None]:
    """`key=value` (equality) and `key` (existence) terms, comma-separated."""
    selector: dict[str, str | None] = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        selector[key] = value if "=" in part else None
    return selector


def _selects(selector: dict[str, str | None], obj: dict[str, Any]) -> bool:
    labels = obj["metadata"].get("labels") or {}
    return all(
        key in labels if value is None else labels.get(key) == value for key, value in selector.items()
    )


class FakeKubeApiThread:
    """A FakeKubeApi on an event loop of its own thread. Everything the test does to it goes
    through `call`, which runs on that loop: the store and the watch queues are not thread-safe."""

    def __init__(self, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-kube-api", daemon=True)
        self._thread.start()
        self.api = self.call(lambda: FakeKubeApi(**options))
        self.url = self.api.url
        asyncio.run_coroutine_threadsafe(self.api.start(), self._loop).result(10)
        wait_until(self._accepts, "the fake API server to listen", 10)

    def _accepts(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.api.port), timeout=1).close()
        except OSError:
            return False
        return True

    def call(self, function: Callable[[], T]) -> T:
        async def run() -> T:
            return function()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def close(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.api.close(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()


def self_signed_certificate(folder: Path) -> tuple[Path, Path] | None:
    """A certificate for 127.0.0.1 that is its own CA, and its key; None without the openssl
    command (then the fake serves plain http)."""
    if shutil.which("openssl") is None:
        return None
    certificate, key = folder / "api-server.crt", folder / "api-server.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", str(key), "-out", str(certificate), "-days", "2", "-subj", "/CN=fake-kube-api",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return certificate, key


def kubeconfig(path: Path, server: str, namespace: str, *, token_file: Path, ca_file: Path | None) -> Path:
    """A kubeconfig as a pod's service account amounts to: the server, its CA, a token file."""
    import yaml

    cluster: dict[str, Any] = {"server": server}
    if ca_file is not None:
        cluster["certificate-authority"] = str(ca_file)
    path.write_text(
        yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": cluster}],
            "users": [{"name": "gateway", "user": {"tokenFile": str(token_file)}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "gateway",
                                                       "namespace": namespace}}],
        })
    )  # fmt: skip
    return path
