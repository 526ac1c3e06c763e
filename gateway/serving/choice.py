"""One choice of a generation request: one engine job on one replica, and its slot.

Runs in the gateway process, on its asyncio loop. Owns `Choice`, the object the link delivers a
job's frames to (its reply, outputs, abort, the worker's failure), which hands them to its
gateway.serving.request_owner.RequestOwner, and which ends the job (Cancel, slot released) once;
and `NotStarted`, a replica's failure before it accepted the job (another replica may take it).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.errors import APIError, ServiceUnavailable
from gateway.serving.choice_text import ChoiceText, TextPlan
from gateway.serving.outputs import ChoiceInput, ChoiceOutput
from wire import messages as wire
from wire.params import SamplingParams
from wire.results import AbortReason, JobOutput

if TYPE_CHECKING:
    from gateway.link.handle import WorkerHandle
    from gateway.serving.request_owner import RequestOwner


@dataclass(frozen=True, slots=True)
class NotStarted:
    """The replica failed before it accepted the job: nothing ran, so another replica may take it."""

    error: APIError


@dataclass(eq=False)
class Choice:
    """One choice of a request: one engine job on one replica. The link delivers its frames here."""

    owner: RequestOwner
    index: int
    input: ChoiceInput
    params: SamplingParams
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    worker_id: str | None = None
    replica: WorkerHandle | None = None
    work: int = 0  # prompt + completion budget: the replica's routing load while this job runs
    accepted: asyncio.Future[Any] | None = None
    sent: bool = False  # a Generate went out: a Cancel must follow unless the job finishes
    finished: bool = False  # the engine job is over (finished, refused, cancelled or gone)
    text_plan: TextPlan | None = None
    output: ChoiceOutput = field(init=False)
    text: ChoiceText = field(init=False)  # the producer's side: worker outputs become Deltas

    def __post_init__(self) -> None:
        self.output = ChoiceOutput(self.index, self.input.prompt_index)
        self.text = ChoiceText(self.text_plan)

    # ---- the link's calls ------------------------------------------------------------------

    def on_reply(self, reply: wire.Accepted | wire.Rejected) -> None:
        if self.accepted is not None and not self.accepted.done():
            self.accepted.set_result(reply)

    def on_output(self, output: JobOutput) -> None:
        self.owner.on_output(self, output)

    def on_aborted(self, message: wire.JobsAborted) -> None:
        code = "shutting_down" if message.reason is AbortReason.SHUTDOWN else "aborted"
        self.owner.abort(ServiceUnavailable(message.message, code=code))

    def on_worker_failed(self, error: APIError) -> None:
        if self.accepted is not None and not self.accepted.done():
            self.accepted.set_result(NotStarted(error))
        else:
            self.owner.abort(error)

    # ---- slot --------------------------------------------------------------------------------

    def end_job(self, cancel: bool) -> None:
        """The engine job is over for us: cancel it if asked and still running, free its slot."""
        if self.finished:
            return
        self.finished = True
        owner = self.owner
        if cancel and self.sent and self.worker_id is not None:
            owner.service.link.send(self.worker_id, wire.Cancel(self.rid))
        owner.service.link.remove_job(self.rid)
        if self.replica is not None:
            owner.route.release(self.replica, self.work)
