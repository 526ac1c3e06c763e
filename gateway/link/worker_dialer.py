"""The gateway's connections out to listening workers (cluster mode): one ROUTER socket, CURVE client.

Runs in the gateway process, on its asyncio loop (the link reads and writes the socket: its frames
in gateway.link.worker_link, its Pings in gateway.link.worker_identities; this module connects and
disconnects it). Owns the socket, the gateway's routing id on it, and which worker each
connection reaches. Each worker is connected with its worker id as
the connection's routing id (ZMQ_CONNECT_ROUTING_ID), so frames to and from it are addressed by
that id exactly as on the listener sockets, and with the worker's own public key as the CURVE
server key, so only that worker can answer on it. The routing id the gateway presents is its
cluster identity plus a random part: a restarted gateway is a new peer to every worker, never
mistaken for the one whose jobs the worker is cancelling.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.auth

from gateway.cluster.membership import WorkerRecord
from gateway.cluster.settings import ClusterConfig
from gateway.config.registry import ConfigError
from gateway.link.remote_keys import WorkerKey
from wire.codec import MAX_SOCKET_MESSAGE_BYTES

logger = logging.getLogger(__name__)


def load_cluster_keys(cluster: ClusterConfig) -> tuple[bytes, bytes, bytes | None]:
    """(the gateway's public key, its secret key, the shared worker key or None); ConfigError naming
    the file and the field when one is unusable."""

    def load(path: Path, field: str) -> tuple[bytes, bytes | None]:
        try:
            return zmq.auth.load_certificate(str(path))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: server.cluster.{field}: cannot read the CURVE key: {exc}") from None

    assert cluster.secret_key_file is not None  # the registry requires it
    public, secret = load(cluster.secret_key_file, "secret_key_file")
    if secret is None:
        raise ConfigError(
            f"{cluster.secret_key_file}: server.cluster.secret_key_file: not a CURVE secret key file "
            "(make one: gateway keys)"
        )
    shared = None
    if cluster.worker_public_key_file is not None:
        shared, _ = load(cluster.worker_public_key_file, "worker_public_key_file")
    for worker in cluster.workers:
        if worker.public_key_file is not None:
            load(worker.public_key_file, f"workers[{worker.worker_id}].public_key_file")
    return public, secret, shared


class WorkerDialer:
    def __init__(
        self, ctx: zmq.asyncio.Context, keys: tuple[bytes, bytes, bytes | None], identity: str
    ) -> None:
        public, secret, self._shared_key = keys
        self.routing_id = f"{identity}/{secrets.token_hex(4)}"
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.IDENTITY, self.routing_id.encode())  # what each worker knows us by
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_SOCKET_MESSAGE_BYTES)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a frame to a worker not connected fails loudly
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_secretkey, sock.curve_publickey = secret, public
        self.sock = sock
        self._records: dict[str, WorkerRecord] = {}
        self._keys: dict[str, WorkerKey] = {}

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._records

    @property
    def worker_ids(self) -> list[str]:
        return list(self._records)

    def connect(self, record: WorkerRecord) -> bool:
        """Connect to a worker that joined the membership; False (logged) if it has no key to check."""
        key = record.public_key.encode("ascii") if record.public_key is not None else self._shared_key
        if key is None:
            logger.error(
                "worker %s names no public key and server.cluster.worker_public_key_file is unset; "
                "not connecting",
                record.worker_id,
            )
            return False
        if record.worker_id in self._records:
            self.disconnect(record.worker_id)
        # Both options apply to the next connect only: each worker gets its own id and server key.
        self.sock.setsockopt(zmq.CONNECT_ROUTING_ID, record.worker_id.encode())
        self.sock.curve_serverkey = key
        self.sock.connect(record.endpoint)
        self._records[record.worker_id] = record
        # The link and remote membership admit a worker by its key: this one may serve its model only.
        name = f"cluster:{record.worker_id}"
        self._keys[record.worker_id] = WorkerKey(name, key.decode("ascii"), frozenset({record.model}))
        logger.info(
            "connecting to worker %s at %s (model %s)", record.worker_id, record.endpoint, record.model
        )
        return True

    def disconnect(self, worker_id: str) -> None:
        record = self._records.pop(worker_id, None)
        self._keys.pop(worker_id, None)
        if record is None:
            return
        try:
            self.sock.disconnect(record.endpoint)
        except zmq.ZMQError as exc:  # never connected (a name that did not resolve): nothing to undo
            logger.debug("disconnect from %s: %s", record.endpoint, exc)
        logger.info("disconnected from worker %s at %s", worker_id, record.endpoint)

    def key_of(self, worker_id: str) -> WorkerKey | None:
        return self._keys.get(worker_id)

    def close(self) -> None:
        self.sock.close()
