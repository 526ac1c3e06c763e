"""API key checks on every request: who is calling, and may that key do what it asks.

Runs in the gateway process, on its asyncio loop (a Quart `before_request` hook). Owns the live
key set (from gateway.config.api_keys: the keys file plus the environment), its reload when the file
changes, and the checks of each key's rate limit and budget (gateway.cluster.counters: in this
process, or shared through Redis). Only SHA-256 digests of keys are kept, compared in
constant time; keys are never logged, only their names.

Rules once any key source is configured (deny by default):
- every route but the probes (/health/live, /health/ready: ready or not, nothing more without a
  key; /health, /ping, /version) and /dashboard (a page with no data; its script sends the key)
  needs a key: none or an unknown one -> 401 `invalid_api_key`;
- /admin/* needs an admin key -> 403 `permission_denied` for an inference key;
- a model the key may not use answers 404 `model_not_found`, exactly as a model that does not exist
  (same body, from the same place, before the body is validated), so a key cannot probe which
  models are served; /v1/models lists only its models;
- /metrics (every model's figures) needs an admin key, a metrics key or a key for every model;
- /v1/* counts against the key's `rate_limit_rpm` (token bucket) -> 429 with Retry-After, checked
  after the model (so the metrics count the 429 with it);
- a key whose token budget for the UTC day or month is used up (gateway.observability.usage) -> 429
  `insufficient_quota` with Retry-After until the period turns;
- the request's priority class (gateway.serving.priority) is its X-Priority header, else its key's
  `priority` (normal without keys); a class above the key's -> 403 `permission_denied` naming it.
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import time
from collections.abc import Callable, Mapping

from quart import g, request
from werkzeug.datastructures import Headers

from gateway.cluster.counters import KeyCounters
from gateway.config.api_keys import (
    ApiKey,
    check_unique,
    digest_of,
    env_keys,
    keys_file_path,
    parse_keys_file,
    warn_if_readable,
)
from gateway.config.registry import ConfigError, Registry
from gateway.errors import AuthenticationFailed, InvalidRequest, ModelNotFound, PermissionDenied, QueueFull
from gateway.serving import priority

logger = logging.getLogger(__name__)

# Probes answer without a key (load balancers, benchmark tools) and carry no data; /health/ready then
# says only ready or not (gateway.http.health_routes adds the models a valid key may use).
OPEN_PATHS = frozenset({"/health/live", "/health/ready", "/health", "/ping", "/version", "/dashboard"})
RELOAD_CHECK_S = 1.0


# ---- the per-app authenticator ------------------------------------------------------------------


class Authenticator:
    def __init__(
        self,
        registry: Registry,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        counters: KeyCounters | None = None,
    ) -> None:
        self.registry = registry
        self.counters = counters if counters is not None else KeyCounters(monotonic=clock)
        self.path = keys_file_path(registry)
        self._env_keys = env_keys(os.environ if environ is None else environ)
        self._clock = clock
        self._file_keys: list[ApiKey] = []
        self._file_signature: tuple[int, int, int] | None = None
        self._checked_at = clock()
        if self.path is not None:
            self._file_signature = self._signature()
            self._file_keys = parse_keys_file(self.path, registry)
            warn_if_readable(self.path)
        self.keys: tuple[ApiKey, ...] = ()
        self._install(self._file_keys)
        if self.enabled:
            logger.info("API keys required: %d key(s) configured", len(self.keys))

    @property
    def enabled(self) -> bool:
        # A configured but empty keys file still locks the gateway: emptying it must not open it.
        return self.path is not None or bool(self._env_keys)

    def _install(self, file_keys: list[ApiKey]) -> None:
        keys = [*self._env_keys, *file_keys]
        check_unique(keys)
        self.keys = tuple(keys)

    def _signature(self) -> tuple[int, int, int] | None:
        assert self.path is not None
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def maybe_reload(self) -> None:
        """Re-read the keys file if it changed; at most one stat per RELOAD_CHECK_S."""
        now = self._clock()
        if self.path is None or now - self._checked_at < RELOAD_CHECK_S:
            return
        self._checked_at = now
        signature = self._signature()
        if signature == self._file_signature:
            return
        self._file_signature = signature
        try:
            file_keys = parse_keys_file(self.path, self.registry)
            self._install(file_keys)
        except ConfigError as exc:
            logger.error("keys file changed but cannot be used; keeping the previous keys: %s", exc)
            return
        self._file_keys = file_keys
        logger.info("keys file %s reloaded: %d key(s)", self.path, len(file_keys))

    def use_registry(self, registry: Registry) -> None:
        """After a reload: scope checks must see the new models (an unknown name skips the check)."""
        self.registry = registry
        if self.path is None:
            return
        try:
            file_keys = parse_keys_file(self.path, registry)
            self._install(file_keys)
        except ConfigError as exc:
            logger.error("keys file does not fit the reloaded registry; keeping the previous keys: %s", exc)
            return
        self._file_keys = file_keys

    def lookup(self, presented: str) -> ApiKey | None:
        digest = digest_of(presented)
        found = None
        for key in self.keys:  # no early exit: the time taken must not depend on which key matched
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found

    async def before_request(self) -> None:
        """The Quart hook: raise an APIError unless the request's key may do what it asks."""
        path = request.path
        # The matched rule too, so no spelling of a path (extra slashes, ...) slips past a prefix test.
        rule = request.url_rule.rule if request.url_rule is not None else path
        if path in OPEN_PATHS and rule in OPEN_PATHS:
            return
        self.maybe_reload()
        if not self.enabled:
            apply_priority(None)
            return
        presented = presented_key(request.headers)
        if presented is None:
            logger.info("%s %s refused: no API key", request.method, path)
            raise AuthenticationFailed(
                "You didn't provide an API key. "
                "Send it as 'Authorization: Bearer <key>' or as 'x-api-key: <key>'.",
                headers={"WWW-Authenticate": "Bearer"},
            )
        key = self.lookup(presented)
        if key is None:
            logger.info("%s %s refused: unknown API key", request.method, path)
            raise AuthenticationFailed("Incorrect API key provided.", headers={"WWW-Authenticate": "Bearer"})
        g.api_key = key
        if any(p == "/admin" or p.startswith("/admin/") for p in (path, rule)):
            if not key.admin:
                logger.info("%s %s refused: key %r is not an admin key", request.method, path, key.name)
                raise PermissionDenied("this API key may not use the admin API")
            return
        if path == "/metrics" and not key.sees_every_model:
            logger.info("%s %s refused: key %r is scoped to some models", request.method, path, key.name)
            raise PermissionDenied("/metrics shows every model; it needs an admin key or a metrics key")
        if not any(p.startswith(MODEL_SCOPED_PREFIXES) for p in (path, rule)):
            return
        apply_priority(key)
        # The model before the limits: their 429s are then counted with the model asked for
        # (gateway.observability.metrics), and a key's token is not spent on a request for a model
        # it may not use. The body is read here for every request that gets past the limits anyway.
        name = g.requested_model = await requested_model()
        if name is not None:
            model = self.registry.model(name)
            # A model that does not exist and one the key may not use get the same 404, here, before
            # the body is validated: which of the two it was must not show in status, body or timing.
            if model is None or not key.allows(model.name):
                logger.info("%s %s refused: key %r may not use model %r", request.method, path, key.name,
                            name[:100])  # fmt: skip
                raise ModelNotFound(name)
        wait = await self.counters.rate_wait(key)
        if wait > 0:
            logger.info("%s %s refused: key %r is over its rate limit", request.method, path, key.name)
            raise QueueFull(
                f"rate limit of {key.rate_limit_rpm} requests per minute reached for this API key",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(math.ceil(wait))},
            )
        spent = await self.counters.budget_spent(key)
        if spent is not None:
            logger.info(
                "%s %s refused: key %r is over its %s budget", request.method, path, key.name, spent.period
            )
            raise QueueFull(
                spent.message(),
                code="insufficient_quota",
                headers={"Retry-After": str(self.counters.retry_after_s(spent))},
            )


# Routes that name a model, so the key's model scope and rate limit apply to them.
MODEL_SCOPED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")


def apply_priority(key: ApiKey | None) -> None:
    """The request's class in the model queues: X-Priority, else its key's class (normal without
    keys, where any class may be asked for). A header that names no class is a 400 naming it; one
    above the key's class is a 403 naming it, since capping it quietly would not honour it."""
    requested = request.headers.get(priority.HEADER)
    if requested is None:
        priority.set_request_priority(key.priority if key is not None else priority.DEFAULT)
        return
    ceiling = key.priority if key is not None else priority.CLASSES[0]
    chosen = priority.allowed_priority(requested, ceiling)
    if chosen is None:
        raise InvalidRequest(
            f"{priority.HEADER} must be one of {', '.join(priority.CLASSES)}", param=priority.HEADER
        )
    asked = requested.strip().lower()
    if chosen != asked:
        raise PermissionDenied(
            f"this API key may not ask for {priority.HEADER}: {asked}; its class is {ceiling} "
            "(a request may only lower its class)",
            param=priority.HEADER,
        )
    priority.set_request_priority(chosen)


def presented_key(headers: Headers) -> str | None:
    authorization = headers.get("Authorization", "")
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    api_key = headers.get("x-api-key", "").strip()
    return api_key or None


async def requested_model() -> str | None:
    """The model a /v1 request names: in the path (GET /v1/models/<id>) or the JSON body (POST)."""
    view_args = request.view_args or {}
    if "model_id" in view_args:
        return str(view_args["model_id"])
    if request.method == "GET" and "model" in request.args:  # GET /tokenizer_info?model=...
        return request.args["model"]
    if request.method != "POST":
        return None
    # force/silent exactly as the routes parse it, so both read the same cached body.
    body = await request.get_json(force=True, silent=True)
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


def may_use(model: str) -> bool:
    """For the current request: may its key use `model` (a canonical name)? True without auth."""
    key: ApiKey | None = g.get("api_key")
    return key is None or key.allows(model)
