"""A listening worker's socket: a ROUTER bound on tcp with CURVE, for every authorized gateway.

Runs in a worker process started with `model-worker --listen tcp://HOST:PORT`, at start-up, on the
engine thread (the link thread owns the socket from then on). Owns the ROUTER socket and the ZAP
handler that admits only the gateway keys given with `--gateway-public-key`: each gateway connects
with its own routing id, so one worker serves several gateways at once, and a gateway without an
authorized key cannot exchange a single frame. Never an unauthenticated tcp bind.
"""

from __future__ import annotations

import logging

import zmq
from zmq.auth.thread import ThreadAuthenticator

from wire.codec import MAX_SOCKET_MESSAGE_BYTES

logger = logging.getLogger(__name__)


class _GatewayKeys:
    """pyzmq's credentials provider: the CURVE handshake check, against a fixed set of keys."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self._keys = keys

    def callback(self, domain: str, public_z85: bytes) -> bool:
        if public_z85 in self._keys:
            return True
        logger.warning(
            "a gateway's handshake was refused: key %s... is not authorized", public_z85[:8].decode()
        )
        return False


class Listener:
    def __init__(
        self, ctx: zmq.Context, public: bytes, secret: bytes, gateway_keys: frozenset[bytes]
    ) -> None:
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=_GatewayKeys(gateway_keys))
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_SOCKET_MESSAGE_BYTES)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        # A frame for a gateway that is gone raises EHOSTUNREACH instead of vanishing: the link
        # learns at once that the gateway's jobs must be cancelled.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 2000)  # the goodbye frames are flushed on exit
        sock.curve_secretkey, sock.curve_publickey = secret, public
        sock.curve_server = True
        self.sock = sock

    def close(self) -> None:
        self._auth.stop()
