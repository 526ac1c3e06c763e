"""The hooks that count a request as being admitted (gateway.serving.admissions).

Runs in the gateway process, as Quart `before_request` / `teardown_request` hooks registered by
app.py right after the request id's. Owns nothing but the hand-over: a request that may generate (a
POST) begins its admission before its body is read, so that the requests of a burst are counted as
soon as the gateway starts on them; the serving layer ends it when the request's Generate goes out,
and the teardown ends it otherwise (refused, failed, or an endpoint that does not generate).
"""

from __future__ import annotations

from quart import request

from gateway.serving.admissions import CURRENT, Admissions


class AdmissionHooks:
    def __init__(self, admissions: Admissions) -> None:
        self.admissions = admissions

    async def begin(self) -> None:
        if request.method == "POST":
            CURRENT.set(self.admissions.begin())

    async def end(self, exc: BaseException | None) -> None:
        admission = CURRENT.get()
        if admission is not None:
            admission.end()  # a no-op when its Generate went out already
