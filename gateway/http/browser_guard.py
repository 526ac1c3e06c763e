"""Defences against a browser turned on the gateway: cross-site requests and DNS rebinding.

Runs in the gateway process, on its asyncio loop (a Quart `before_request` hook, after the request
id and before the key check). A page on another site can make a visitor's browser send requests to
a gateway it can reach (127.0.0.1 on a laptop); without keys nothing else stops them. So:
- a request with a body that may change state (POST, PUT, PATCH, DELETE) must send it as JSON: a
  cross-site page can send text/plain or a form without asking, never application/json;
- such a request with a foreign `Origin` (not this gateway's own, not in `server.allowed_origins`)
  is refused, bodiless admin actions included;
- without API keys only loopback host names (and `server.allowed_hosts`) are served, so a hostile
  name re-pointed at 127.0.0.1 (DNS rebinding) gets nothing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from urllib.parse import urlsplit

from quart import request

from gateway.config.api_keys import is_loopback
from gateway.config.server_config import ServerConfig
from gateway.errors import PermissionDenied, UnsupportedMediaType
from gateway.observability.logging_setup import RateLimitedLog

logger = logging.getLogger(__name__)
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def host_name(host_header: str) -> str:
    """The name in a Host header, without the port ("[::1]:8000" -> "::1"), lower case."""
    parsed = urlsplit("//" + host_header)
    try:
        return (parsed.hostname or "").lower()
    except ValueError:  # a malformed port or bracket: no name we serve
        return ""


def is_loopback_name(name: str) -> bool:
    return is_loopback(name) or name.endswith(".localhost")  # RFC 6761: *.localhost is loopback


@functools.lru_cache(maxsize=256)
def _served_name(host_header: str) -> tuple[str, bool]:
    """(the Host header's name, whether it is a loopback name), remembered per header value: a
    gateway sees the same few, and urlsplit plus ipaddress cost about 5 µs on every request."""
    name = host_name(host_header)
    return name, is_loopback_name(name)


class BrowserGuard:
    def __init__(self, server: ServerConfig, auth_enabled: Callable[[], bool]) -> None:
        self.allowed_hosts = frozenset(h.lower() for h in server.allowed_hosts)
        self.allowed_origins = frozenset(o.rstrip("/").lower() for o in server.allowed_origins)
        self._auth_enabled = auth_enabled
        self._refusals = RateLimitedLog(logger)

    async def before_request(self) -> None:
        name, loopback = _served_name(request.host)
        if not self._auth_enabled() and not (loopback or name in self.allowed_hosts):
            self._refusals.log(
                logging.INFO, "refused a request for host %r: not served without API keys", name[:100]
            )
            raise PermissionDenied(
                "this gateway has no API keys and answers only to loopback host names (localhost, "
                "127.0.0.1, ::1) and server.allowed_hosts",
                code="host_not_allowed",
            )
        if request.method not in STATE_CHANGING:
            return
        origin = request.headers.get("Origin")
        if origin is not None and not self._same_or_allowed(origin):
            self._refusals.log(logging.INFO, "refused a request from origin %r", origin[:100])
            raise PermissionDenied(
                "cross-origin requests may not change state; add the origin to server.allowed_origins",
                code="origin_not_allowed",
            )
        has_body = bool(request.content_length) or "chunked" in request.headers.get("Transfer-Encoding", "")
        if has_body and not _is_json(request.mimetype):
            raise UnsupportedMediaType(
                f"the request body must be JSON (Content-Type: application/json), not {request.mimetype!r}"
            )

    def _same_or_allowed(self, origin: str) -> bool:
        origin = origin.rstrip("/").lower()
        if origin in self.allowed_origins:
            return True
        parts = urlsplit(origin)
        # Same origin: the page was served by this gateway under the name the request is sent to.
        return parts.scheme in ("http", "https") and parts.netloc == request.host.lower()


def _is_json(mimetype: str) -> bool:
    return mimetype == "application/json" or (
        mimetype.startswith("application/") and mimetype.endswith("+json")
    )
