"""The gateway of the app serving the current request (routes and hooks reach its parts here).

Runs in the gateway process, inside Quart request handling. The Gateway is stored on the app
(app.extensions), never in a module global, so two apps in one process never share one.
"""

from __future__ import annotations

from quart import current_app

from gateway.core import Gateway


def current_gateway() -> Gateway:
    return current_app.extensions["gateway"]  # type: ignore[no-any-return]
