"""What the etcd and Kubernetes backends' `Membership` and `Leader` classes do alike: one background
task that keeps the view (or the campaign) going, and the leader's state between its backend's
replies (the term, the step-down timer, the calls to `on_change`).

Runs in the gateway process, on its asyncio loop, as the base of `EtcdMembership` and
`KubernetesMembership` (`WatchingMembership`), and of `EtcdLeader` and `LeaseLeader`
(`CampaigningLeader`). Owns that task and that state; each backend owns its client, how it lists,
watches and campaigns, and what it holds in the backend and gives up on resigning.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import ClassVar

from gateway.cluster.membership import MembershipChange, MemberTable, WorkerRecord, cancel_and_wait


class WatchingMembership:
    """The `Membership` half common to the backends: `_run` keeps `_table` current (and
    `_connected`, `_synced`) until `stop` cancels it."""

    _task_name: ClassVar[str]

    def __init__(self) -> None:
        self._table = MemberTable()
        self._connected = False
        self._synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- Membership ---------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self._task_name)

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        await self._close()

    async def synced(self) -> None:
        await self._synced.wait()

    @property
    def connected(self) -> bool:
        return self._connected

    def members(self) -> Mapping[str, WorkerRecord]:
        return self._table.members()

    def changes(self) -> AsyncIterator[MembershipChange]:
        return self._table.changes()

    # -- hooks for each backend ---------------------------------------------------------------------

    async def _run(self) -> None:
        """List, then watch, and again after every failure; never returns."""
        raise NotImplementedError

    async def _close(self) -> None:
        """Release the backend's client, once the task has ended."""
        raise NotImplementedError


class CampaigningLeader:
    """The `Leader` half common to the backends: `_campaign` calls `_begin_term` when it wins and
    `_arm_step_down` after every renewal; `_step_down` ends the term, on that timer or when the
    backend says the leadership is gone."""

    _task_name: ClassVar[str]

    def __init__(self, identity: str, on_change: Callable[[bool], None] | None) -> None:
        self._identity = identity
        self._on_change = on_change
        self._term: int | None = None
        self._step_down_timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        # The backend's logger, not this module's: every log line names its logger (wire.log_format),
        # and a leadership's lines carry the name of the backend that holds it.
        self._logger = logging.getLogger(type(self).__module__)

    # -- Leader -------------------------------------------------------------------------------------

    @property
    def identity(self) -> str:
        return self._identity

    @property
    def is_leader(self) -> bool:
        return self._term is not None

    @property
    def term(self) -> int | None:
        """This leadership's number, as the backend counts them (its module says how); None when
        not leading."""
        return self._term

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._campaign(), name=f"{self._task_name}-{self._identity}")

    async def resign(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        term = self._term
        self._step_down("resigned")
        await self._release(term)

    async def stop(self) -> None:
        await self.resign()
        await self._close()

    # -- hooks for each backend ---------------------------------------------------------------------

    async def _campaign(self) -> None:
        """Win, hold and win again the leadership until cancelled; never returns."""
        raise NotImplementedError

    async def _release(self, term: int | None) -> None:
        """Give up in the backend what this gateway holds there, so that another takes over at once;
        `term`: the leadership `resign` just ended, None if it was not leading."""
        raise NotImplementedError

    async def _close(self) -> None:
        """Release the backend's client, once resigned."""
        raise NotImplementedError

    # -- state ----------------------------------------------------------------------------------------

    def _begin_term(self, term: int, details: str) -> None:
        self._term = term
        self._logger.info("%s is the leader (%s)", self._identity, details)
        if self._on_change is not None:
            self._on_change(True)

    def _arm_step_down(self, when: float, why: str) -> None:
        """Step down at loop time `when` unless armed again before: the backend's renewals push it on."""
        if self._step_down_timer is not None:
            self._step_down_timer.cancel()
        self._step_down_timer = asyncio.get_running_loop().call_at(when, self._step_down, why)

    def _step_down(self, why: str) -> None:
        if self._step_down_timer is not None:
            self._step_down_timer.cancel()
            self._step_down_timer = None
        if self._term is None:
            return
        self._term = None
        self._logger.warning("%s is no longer the leader: %s", self._identity, why)
        if self._on_change is not None:
            self._on_change(False)
