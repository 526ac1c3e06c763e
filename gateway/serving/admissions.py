"""The requests this gateway process is still admitting: begun, not yet sent to a worker.

Runs in the gateway process, on its asyncio loop (no locks: one thread counts). Owns the count
that each Generate carries as `following`. Requests sent together reach the gateway together, but
its one event loop admits them one after another, about a millisecond each; a worker that started
its first step with the first of them would make the others wait for that step, then prefill them
in a second one. Told how many are still behind, an idle worker waits for them
(`limits.burst_gather_ms`, model_worker.serve_loop) and prefills the burst in one step, as the
engine's library does when it is handed all of them at once.

An admission begins when the HTTP layer starts a request that may generate (a POST), before its
body is read: that is when the burst is visible. Its model is not known yet; once it is
(`route`), only the workers of that model count it. It ends when its first Generate goes out, when
it starts to wait in the gateway's queue for a slot (no worker can take it in a burst then), or when
the request ends without a Generate (refused, an error, an endpoint that does not generate).
`CURRENT` carries the request's admission from the HTTP layer to the serving layer.
"""

from __future__ import annotations

import collections
from contextvars import ContextVar


class Admission:
    __slots__ = ("_admissions", "model", "open")

    def __init__(self, admissions: Admissions) -> None:
        self._admissions = admissions
        self.model: str | None = None
        self.open = True

    def route(self, model: str) -> None:
        """The request is for this model: from now on only its workers count it."""
        if self.open and self.model is None:
            self.model = model
            self._admissions.moved(model)

    def end(self) -> None:
        """Sent, or ended without a Generate; a second call does nothing."""
        if self.open:
            self.open = False
            self._admissions.ended(self.model)


class Admissions:
    def __init__(self) -> None:
        self._unrouted = 0
        self._by_model: collections.Counter[str] = collections.Counter()

    def begin(self) -> Admission:
        self._unrouted += 1
        return Admission(self)

    @property
    def total(self) -> int:
        return self._unrouted + sum(self._by_model.values())

    def behind(self, model: str) -> int:
        """Requests still being admitted that may go to this model's workers."""
        return self._unrouted + self._by_model[model]

    def moved(self, model: str) -> None:
        self._unrouted -= 1
        self._by_model[model] += 1

    def ended(self, model: str | None) -> None:
        if model is None:
            self._unrouted -= 1
            return
        self._by_model[model] -= 1
        if not self._by_model[model]:
            del self._by_model[model]  # models come and go with reloads; the counter must not grow


# The admission of the request the current task serves, if it may generate.
CURRENT: ContextVar[Admission | None] = ContextVar("gateway_admission", default=None)
