"""A listening worker's standby (cluster mode): waiting without its model, loading it on Load, and
going back to standby on Unload.

Runs in the worker process, on its engine thread (model_worker.serve_loop). Owns the count of
standby periods (`epoch`: reported in the unloaded Status, named by the leading gateway's Load and
Unload), the choice to honour or ignore a Load or an Unload, and the wait while no model is loaded
(answering what comes, sending heartbeats); and `StandbyDesk`, what the prompt thread answers
with meanwhile (model_worker.link_thread): no prompt is prepared without a model. The process, its
socket and its etcd registration stay through every period; only the engine comes and goes.

What a Load loads: the model's entry as the worker's registry file says at that moment (when the
worker was started from one), so a registry reload decided by the leading gateway (Unload, then
Load: gateway.workers.cluster_reloads) takes effect without a new process. What needs one (the
model's `env`, read before any import) keeps its start-up value; a file that cannot be read keeps
the settings read before, and says why.

Why a Load may be ignored: a leader that dies just after sending Load is followed by one that may
send it again for the same period. The worker loads at most once per period, so two Loads (from
two gateways, or one repeated) load the model once. An Unload for a period the worker has left is
stale, likewise.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from model_worker.engines.base import RequestRejected
from model_worker.prompt_desk import PreparedEmbed, PreparedJob, PromptDesk
from wire import messages as wire
from wire.results import RejectCode
from wire.states import WorkerState
from wire.stats import EngineStats, WorkerLoad

if TYPE_CHECKING:
    from model_worker.serve_loop import Worker

logger = logging.getLogger(__name__)
S = WorkerState
NOT_LOADED = "the model is not loaded (the worker stands by until the leading gateway loads it)"


class StandbyDesk(PromptDesk):
    """The prompt thread's desk while no model is loaded: every prompt is refused (a gateway
    routes nothing to a worker that is not ready; this answers one that does all the same)."""

    def __init__(self) -> None:  # no tokenizer, no template: there is no model
        pass

    def prepare(self, msg: wire.Generate) -> PreparedJob:
        return PreparedJob(msg, None, RequestRejected(RejectCode.SHUTTING_DOWN, NOT_LOADED, None))

    def prepare_embed(self, msg: wire.Embed) -> PreparedEmbed:
        return PreparedEmbed(msg, None, RequestRejected(RejectCode.SHUTTING_DOWN, NOT_LOADED, None))

    def tokenize(self, msg: wire.Tokenize) -> wire.Tokens | wire.Rejected:
        return wire.Rejected(msg.rid, RejectCode.SHUTTING_DOWN, NOT_LOADED, None)

    def detokenize(self, msg: wire.Detokenize) -> wire.Tokens | wire.Rejected:
        return wire.Rejected(msg.rid, RejectCode.SHUTTING_DOWN, NOT_LOADED, None)


class Standby:
    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self.epoch = 0  # standby periods so far; 0 while a model loaded at start-up is held
        self.unload_deadline: float | None = None  # set by an Unload: drain until then
        self._load_asked = False

    def on_load(self, msg: wire.Load) -> None:
        state = self._worker.state
        if state is not S.UNLOADED or msg.epoch != self.epoch or self._load_asked:
            logger.info(
                "a Load for standby period %d ignored (this worker is %s, period %d)",
                msg.epoch, state.value, self.epoch,
            )  # fmt: skip
            return
        self._load_asked = True
        logger.info("loading on request of the leading gateway (standby period %d)", self.epoch)

    def on_unload(self, msg: wire.Unload) -> None:
        worker = self._worker
        if worker.state is not S.READY or msg.epoch != self.epoch or self.unload_deadline is not None:
            logger.info(
                "an Unload for period %d ignored (this worker is %s, period %d)",
                msg.epoch, worker.state.value, self.epoch,
            )  # fmt: skip
            return
        logger.info("unloading on request of the leading gateway (grace %.1fs)", msg.grace_s)
        self.unload_deadline = time.monotonic() + msg.grace_s
        worker.move_to(S.DRAINING, "unloading")  # the gateways stop routing to it

    def wait(self) -> bool:
        """Stand by without a model until a Load for this period (True) or a stop (False)."""
        worker = self._worker
        spec = worker.spec
        self.epoch += 1
        self._load_asked = False
        self.unload_deadline = None
        worker.link.serve_prompts(StandbyDesk())
        worker.move_to(S.UNLOADED, "standby: loads when the leading gateway asks", epoch=self.epoch)
        logger.info("standing by without the model (period %d)", self.epoch)
        load = WorkerLoad(max_jobs=spec.max_jobs, max_queue=spec.max_queue)
        last_heartbeat = 0.0
        while True:
            for item in worker.link.take(spec.heartbeat_interval_s):
                worker.handle(item)
            if worker.stopping:
                return False
            if self._load_asked:
                self._reread_spec()
                worker.move_to(S.STARTING, "loading on request of the leading gateway")
                return True
            now = time.monotonic()
            if now - last_heartbeat >= spec.heartbeat_interval_s:
                last_heartbeat = now
                worker.link.send(wire.Heartbeat(S.UNLOADED, EngineStats(), load))

    def release_and_wait(self) -> bool:
        """After an unload's drain: free the model, then stand by (see `wait`)."""
        self._worker.release_model()
        return self.wait()

    def _reread_spec(self) -> None:
        worker = self._worker
        if worker.reread_spec is None:
            return
        from model_worker.remote_spec import RemoteSpecError

        try:
            spec = worker.reread_spec()
        except RemoteSpecError as exc:
            logger.error(
                "loading with the settings read before: the registry file cannot be read again: %s", exc
            )
            return
        if spec.env != worker.spec.env:
            logger.warning(
                "model %s: a changed `env` takes effect when the worker process restarts", spec.name
            )
        # The process's own mode and environment stay what they were at its start.
        spec = dataclasses.replace(spec, env=worker.spec.env, standby=worker.spec.standby)
        if spec != worker.spec:
            logger.info("loading with the registry file's new settings for model %s", spec.name)
        worker.spec = spec
