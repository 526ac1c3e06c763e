"""GET /dashboard: the operator's status page (gateway/http/static/dashboard.html).

Runs in the gateway process. Owns serving that one self-contained page. The page holds no data:
its script polls /admin/workers and /health/ready from the browser, with the admin key the
operator types in when keys are configured, so /dashboard itself is open (gateway/auth.py), and
sends the operator's actions (load, unload, reload) to the admin routes with that key.
A strict Content-Security-Policy pins the page to its own inline script and style (by hash) and
to same-origin fetches: it cannot load or send anything elsewhere.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib import resources

from quart import Blueprint, Response

blueprint = Blueprint("dashboard", __name__)

_INLINE = re.compile(r"<(script|style)>(.*?)</\1>", re.DOTALL)


@functools.cache
def _page() -> tuple[bytes, str]:
    """The page and its CSP, read once from the package (the file ships as package data)."""
    html = resources.files("gateway.http").joinpath("static/dashboard.html").read_text(encoding="utf-8")
    hashes: dict[str, list[str]] = {"script": [], "style": []}
    for tag, body in _INLINE.findall(html):
        digest = base64.b64encode(hashlib.sha256(body.encode("utf-8")).digest()).decode("ascii")
        hashes[tag].append(f"'sha256-{digest}'")
    scripts = " ".join(hashes["script"]) or "'none'"
    styles = " ".join(hashes["style"]) or "'none'"
    csp = "; ".join(
        [
            "default-src 'none'",
            f"script-src {scripts}",
            f"style-src {styles}",
            "connect-src 'self'",
            "img-src 'self' data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )
    return html.encode("utf-8"), csp


@blueprint.get("/dashboard")
async def dashboard() -> Response:
    body, csp = _page()
    response = Response(body, content_type="text/html; charset=utf-8")
    response.headers["Content-Security-Policy"] = csp
    response.headers["Cache-Control"] = "no-store"
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    return response
