"""Runs the gateway app on Hypercorn with signal handling and a graceful drain.

Runs in the gateway process. Owns the shutdown sequence: on SIGTERM/SIGINT new requests get 503
(the service is draining), in-flight requests get `shutdown_grace_s` to finish, then Hypercorn
stops and `after_serving` stops every worker. The process exits 0. SIGHUP starts a registry reload
(gateway.reloads), refused and logged once the drain has begun. Once started, the heap that
start-up built is frozen out of the garbage collector's full passes.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

from hypercorn.asyncio import serve
from hypercorn.utils import LifespanFailureError

from gateway.config.registry import ConfigError, Registry
from gateway.core import Gateway
from gateway.errors import Conflict, ServiceUnavailable
from gateway.heap import freeze_startup_heap
from gateway.http.admin_routes import start_reload
from gateway.http.app import create_app
from gateway.http.connections import (
    FD_RESERVE,
    CappedConfig,
    install_prompt_close,
    listen,
    quiet_accept_errors,
    raise_fd_limit,
)

logger = logging.getLogger(__name__)
# `--own-port` serves one process's metrics scrapes and admin calls, never the traffic of the shared
# port: a small cap of its own, so that it adds few descriptors to `max_connections`.
OWN_PORT_MAX_CONNECTIONS = 32
OWN_PORT_MAX_PER_CLIENT = 8


async def _drain(gateway: Gateway, grace_s: float) -> None:
    gateway.service.draining = True
    gateway.supervisor.mark_draining()
    # Nothing is routed from now on, so a request still waiting for a slot would only wait out the
    # grace (and hold the exit back that long): it is told at once, as the new ones are.
    waiting = gateway.service.abort_waiting(
        ServiceUnavailable("the server is shutting down", code="shutting_down")
    )
    if waiting:
        logger.info("shutting down: %d request(s) waiting for a slot refused", waiting)
    deadline = time.monotonic() + grace_s
    while gateway.service.in_flight > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if gateway.service.in_flight:
        logger.warning("grace period over; cancelling %d request(s)", gateway.service.in_flight)
        # End each request ourselves so its client gets an error event, not a cut connection.
        gateway.service.abort_all(ServiceUnavailable("the server is shutting down", code="shutting_down"))
        flush_deadline = time.monotonic() + 1.0
        while gateway.service.in_flight > 0 and time.monotonic() < flush_deadline:
            await asyncio.sleep(0.02)


async def run_server(registry: Registry, host: str, port: int, own_port: int | None = None) -> None:
    server = registry.server
    fd_limit = raise_fd_limit()
    max_connections = min(server.max_connections, max(fd_limit - FD_RESERVE, 16))
    if max_connections < server.max_connections:
        logger.warning("max_connections lowered to %d by the open-file limit (%d)", max_connections, fd_limit)
    listener = listen(host, port, max_connections, server.max_connections_per_client, server.reuse_port)
    listeners = [listener]
    if own_port is not None:  # this process's alone, beside a port it may share (server.reuse_port)
        try:
            listeners.append(listen(host, own_port, OWN_PORT_MAX_CONNECTIONS, OWN_PORT_MAX_PER_CLIENT))
        except BaseException:
            listener.close()
            raise
    app = create_app(registry)
    gateway: Gateway = app.extensions["gateway"]
    app.before_serving(freeze_startup_heap)  # registered after create_app's own, so it runs after it
    install_prompt_close()
    config = CappedConfig()
    config.listeners = listeners
    config.accesslog = None  # gateway.http.request_log writes the access log, with request ids
    # A logger, not a stream: Hypercorn's errors then go through our handler and format (JSON too).
    config.errorlog = logging.getLogger("hypercorn.error")
    # Also the deadline for a new connection's request headers: Hypercorn's idle timer runs until
    # the headers are in, so a client trickling them (slowloris) is dropped.
    config.keep_alive_timeout = server.keep_alive_timeout_s
    # In-flight streams are drained by _drain first; this only bounds what is left after it.
    config.graceful_timeout = 2.0
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    quiet_accept_errors(loop)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reloads: set[asyncio.Task[None]] = set()

    async def reload_on_signal() -> None:
        try:
            await start_reload(app)
        except ConfigError as exc:
            logger.error("SIGHUP reload refused; the running models are unchanged: %s", exc)
        except Conflict as exc:
            logger.error("SIGHUP reload refused: %s", exc.message)
        except ServiceUnavailable as exc:  # the SIGTERM drain has begun (gateway.reloads)
            logger.warning("SIGHUP ignored: %s", exc.message)

    def on_sighup() -> None:
        task = loop.create_task(reload_on_signal())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, on_sighup)

    async def shutdown_trigger() -> None:
        await stop.wait()
        logger.info("shutdown requested; draining for up to %.0fs", registry.server.shutdown_grace_s)
        await _drain(gateway, registry.server.shutdown_grace_s)

    logger.info("listening on http://%s:%d", host, port)
    if own_port is not None:
        logger.info("also listening on http://%s:%d (this process alone)", host, own_port)
    try:
        await serve(app, config, shutdown_trigger=shutdown_trigger)
    except LifespanFailureError:
        startup_error = app.extensions.get("startup_error")
        if startup_error is None:
            raise
        # The CLI prints it as a config error (exit 2), with no traceback.
        raise ConfigError(f"{registry.source}: {startup_error}") from None
