"""Whose frames the worker link takes, and over which socket: local, remote and listening workers.

Runs in the gateway process, on its asyncio loop, as the base of `WorkerLink`
(gateway.link.worker_link), whose readers ask `_admit` about every frame. Owns the tables that bind
each worker id to where it belongs, the remote workers' side of the link (the check of their keys
that `gateway serve` runs before it starts, the set-up of the tcp listener with CURVE and its ZAP
authenticator, which the link then reads and closes), and in cluster mode the dialling of listening
workers, the hanging up on them and their Pings, through gateway.link.worker_dialer.

Identities are bound to where they belong: a local worker's id is accepted only on the ipc
socket (the supervisor registers it before spawning), and a remote worker's id only over tcp, from
the CURVE key it joined with, while that key is still authorized; a listening worker's id only on
the connection made to it with its own key. Every refusal is logged (rate-limited) with the key's name.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, cast

import zmq
import zmq.asyncio

from gateway.cluster.membership import WorkerRecord
from gateway.config.registry import ConfigError
from gateway.config.server_config import RemoteWorkersConfig
from gateway.link.remote_keys import AuthorizedKeys, WorkerKey, key_label
from gateway.link.router_socket import configured
from gateway.link.worker_dialer import WorkerDialer
from gateway.observability.logging_setup import RateLimitedLog
from wire import messages as wire

# The link's logger, not this module's: every log line names its logger (wire.log_format), and
# the link's lines, refusals above all, carry one name whichever of its modules writes them.
logger = logging.getLogger("gateway.link.worker_link")


def check_remote_keys(remote: RemoteWorkersConfig) -> tuple[bytes, bytes, list[Path]]:
    """The gateway's CURVE key pair and the authorized worker keys; ConfigError if unusable."""
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(str(remote.secret_key_file))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{remote.secret_key_file}: cannot read the CURVE secret key: {exc}") from None
    if secret is None:
        raise ConfigError(f"{remote.secret_key_file}: not a CURVE secret key file (make one: gateway keys)")
    authorized = sorted(Path(remote.authorized_keys_dir).glob("*.key"))
    if not authorized:
        raise ConfigError(
            f"{remote.authorized_keys_dir}: no authorized worker keys (*.key); refusing to listen on tcp"
        )
    return public, secret, authorized


class WorkerIdentities:
    # The link's context, made by WorkerLink before anything here runs; every socket lives in it.
    _ctx: zmq.asyncio.Context

    def __init__(self) -> None:
        self.dialer: WorkerDialer | None = None  # cluster mode: made when the link starts
        self._authenticator: Any = None
        self.keys: AuthorizedKeys | None = None
        self._local_ids: set[str] = set()  # registered by the supervisor before each spawn
        self._remote_keys: dict[str, str] = {}  # remote worker id -> the public key it joined with
        self._refusals = RateLimitedLog(logger, every_s=10.0)
        # When each worker last sent anything: any frame proves it alive, not only heartbeats.
        self.last_seen: dict[str, float] = {}

    def _router_socket(self) -> zmq.asyncio.Socket:
        return configured(self._ctx.socket(zmq.ROUTER))

    def _start_remote_listener(self, remote: RemoteWorkersConfig) -> zmq.asyncio.Socket:
        """tcp with CURVE: traffic is encrypted and only workers whose public key is authorized get in."""
        from zmq.auth.asyncio import AsyncioAuthenticator

        public, secret, authorized = check_remote_keys(remote)
        self.keys = AuthorizedKeys(remote.authorized_keys_dir)
        self._authenticator = AsyncioAuthenticator(self._ctx)
        self._authenticator.start()
        # ZAP asks at each handshake whether the key is in the folder now (re-read when it changes).
        self._authenticator.configure_curve_callback(domain="*", credentials_provider=self.keys)
        sock = self._router_socket()
        # A connection that has not finished its handshake by then is dropped: no key, no stay.
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(remote.handshake_timeout_s * 1000))
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        sock.bind(remote.bind)
        logger.info("remote workers: listening on %s (%d authorized key(s))", remote.bind, len(authorized))
        return sock

    def expect_local(self, worker_id: str) -> None:
        """A worker the supervisor spawns: its id is accepted on the ipc socket only."""
        self._local_ids.add(worker_id)
        self.last_seen[worker_id] = time.monotonic()

    def bind_remote(self, worker_id: str, key: WorkerKey) -> None:
        """A remote worker joined with this key: its id is accepted only over tcp, with this key."""
        self._remote_keys[worker_id] = key.public_z85
        self.last_seen[worker_id] = time.monotonic()

    def dial(self, record: WorkerRecord) -> bool:
        """Cluster mode: connect to a listening worker that joined the membership."""
        assert self.dialer is not None
        return self.dialer.connect(record)

    def hang_up(self, worker_id: str) -> None:
        """Cluster mode: the worker left the membership; no frame of its is admitted any more."""
        if self.dialer is not None:
            self.dialer.disconnect(worker_id)

    def ping_dialed(self) -> None:
        """Every listening worker hears from this gateway each heartbeat interval (else it cancels
        our jobs); a worker not connected yet is skipped (its first Ping makes it introduce itself)."""
        if self.dialer is None:
            return
        frame = wire.encode(wire.Ping())
        for worker_id in self.dialer.worker_ids:
            sent = cast(
                "asyncio.Future[Any]",
                self.dialer.sock.send_multipart([worker_id.encode(), frame], zmq.NOBLOCK),
            )
            # EHOSTUNREACH (not connected yet, or gone) is expected here; take it so it is not reported.
            sent.add_done_callback(_take_exception)

    def _admit(self, worker_id: str, remote: bool, public_z85: str | None) -> tuple[bool, WorkerKey | None]:
        """Whether the frame may be handled, and (over tcp) the key it came with."""
        if not remote:
            if worker_id in self._local_ids:
                self.last_seen[worker_id] = time.monotonic()
                return True, None
            self._refusals.warning("frame from unknown local worker %r dropped", worker_id)
            return False, None
        key = self.keys.lookup(public_z85) if self.keys is not None else None
        if key is None:
            self._refusals.warning("frame over tcp refused: %s is not authorized", key_label(public_z85))
            return False, None
        if worker_id in self._local_ids:
            self._refusals.warning("key %r claimed the id of local worker %r; refused", key.name, worker_id)
            return False, key
        bound = self._remote_keys.get(worker_id)
        if bound is not None and bound != key.public_z85:
            self._refusals.warning(
                "key %r claimed remote worker %r of another key; refused", key.name, worker_id
            )
            return False, key
        if bound is not None:  # an unbound id is only trusted once membership lets it join
            self.last_seen[worker_id] = time.monotonic()
        return True, key


def _take_exception(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
