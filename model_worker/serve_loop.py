"""The worker's serve loop: prepared jobs in, engine steps, one Step message out per generator step.

Runs in the worker process, on its main thread, the engine thread: the only thread that touches the
engine (the exllama generators are not thread-safe), and it does little else. Owns the engine and
the worker's own lifecycle (starting -> loading -> warming -> ready -> draining -> stopped, checked
against wire.states). The socket (a DEALER connected to one gateway, or a ROUTER that several
gateways connect to: model_worker.listener) is created here and handed to the link thread
(model_worker.link_thread), which decodes what arrives and encodes and sends every frame; its
prompt thread prepares prompts. What they pass on is dispatched by type through a table;
generation jobs are admitted and tracked by model_worker.jobs, embedding requests batched by
model_worker.embedding_batch. A standby worker (cluster mode, `load: on_demand`) waits without a
model until the leading gateway sends Load, and goes back to standby on Unload
(model_worker.standby); the process, its socket and its registration stay throughout.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq
from pydantic import ValidationError

from model_worker.chat_template import ChatTemplate
from model_worker.embedding_batch import EmbeddingBatch
from model_worker.engines import registry
from model_worker.engines.base import CountsPrefill, Engine, missing_capabilities
from model_worker.gateway_peers import GatewayPeers
from model_worker.handshake_watch import HandshakeWatch
from model_worker.jobs import JobDesk
from model_worker.link_thread import LinkThread
from model_worker.listener import Listener
from model_worker.prompt_desk import PreparedEmbed, PreparedJob, PromptDesk
from model_worker.standby import NOT_LOADED, Standby, StandbyDesk
from model_worker.step_trace import StepTrace
from model_worker.tokenizer_info import tokenizer_info
from model_worker.warmup import warm_up, warm_up_embeddings
from wire import messages as wire
from wire.codec import MAX_SOCKET_MESSAGE_BYTES
from wire.params import WorkerSpec
from wire.results import RejectCode
from wire.states import WorkerState, check_transition
from wire.stats import EngineInfo

logger = logging.getLogger(__name__)

LOADING_STATES = (WorkerState.STARTING, WorkerState.LOADING, WorkerState.WARMING)
# How long a full send queue may wait for the gateway before the worker gives up (the gateway's
# own heartbeat timeout, 30 s by default, has declared it lost by then).
SEND_PATIENCE_S = 60.0
# Gateways that share a listening worker admit by the load it reports (gateway.serving.router): a
# change in the jobs it holds is reported at once, at most this often, not a heartbeat later.
LOAD_REPORT_GAP_S = 0.01


class Worker:
    def __init__(
        self,
        worker_id: str,
        endpoint: str,
        spec: WorkerSpec,
        parent_pid: int | None,
        curve: tuple[bytes, bytes, bytes] | None = None,
        listen: tuple[bytes, bytes, frozenset[bytes]] | None = None,
        reread_spec: Callable[[], WorkerSpec] | None = None,
    ) -> None:
        """`curve` (own public, own secret, the gateway's public key) connects to one gateway;
        `listen` (own public, own secret, the authorized gateway keys) binds `endpoint` instead.
        `reread_spec` reads the worker's registry file again: a load from standby uses what the
        file says then (a registry reload, model_worker.standby)."""
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.spec = spec
        self.reread_spec = reread_spec
        self.parent_pid = parent_pid
        self.state = WorkerState.STARTING
        self.engine: Engine | None = None
        self.info: EngineInfo | None = None
        self._stop_deadline: float | None = None
        self._stop_requested = False  # SIGTERM or Shutdown: the goodbye says so
        self._ready: wire.Ready | None = None
        self._announce_draining = False
        self._following = 0  # what the last Generate said its gateway was still admitting
        self.jobs: JobDesk | None = None
        self.embeddings: EmbeddingBatch | None = None
        self.standby = Standby(self)
        self._ctx = zmq.Context()
        self._handshake: HandshakeWatch | None = None
        self._listener: Listener | None = None
        peers: GatewayPeers | None = None
        if listen is not None:
            self._listener = Listener(self._ctx, *listen)
            self._sock = self._listener.sock
            peers = GatewayPeers(spec.heartbeat_timeout_s)
        else:
            self._sock = self._dealer_socket(worker_id)
        if curve is not None:
            # (own public key, own secret key, the gateway's public key): encrypted, and the gateway
            # admits only authorized worker keys.
            self._sock.curve_publickey, self._sock.curve_secretkey, self._sock.curve_serverkey = curve
            self._handshake = HandshakeWatch(self._sock)
        self._handlers: dict[type, Callable[[Any], None]] = {
            PreparedJob: self._on_generate,
            wire.Cancel: self._on_cancel,
            PreparedEmbed: self._on_embed,
            wire.Shutdown: self._on_shutdown,
            wire.Retire: self._on_retire,
            wire.Reintroduce: self._on_reintroduce,
            wire.Load: self.standby.on_load,
            wire.Unload: self.standby.on_unload,
        }
        # From its start() on, the socket is the link thread's alone. It passes on the messages
        # handled here; a prepared job stands for each Generate, a prepared embed for each Embed.
        forward = frozenset(t for t in self._handlers if issubclass(t, wire.Message))
        self.link = LinkThread(self._sock, patience_s=SEND_PATIENCE_S, forward=forward, peers=peers)

    def _dealer_socket(self, worker_id: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_SOCKET_MESSAGE_BYTES)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        # Linger so the final Fatal/Heartbeat frames are flushed when we exit.
        sock.setsockopt(zmq.LINGER, 2000)
        return sock

    # ---- lifecycle -------------------------------------------------------------------------

    def request_stop(self, grace_s: float) -> None:
        self._stop_requested = True
        if self.state is WorkerState.UNLOADED:  # standby: nothing to drain; the wait loop sees it
            self._stop_deadline = time.monotonic()
            self.link.wake()
            return
        if self.state in LOADING_STATES:
            sys.exit(0)  # nothing to drain; stop loading at once
        deadline = time.monotonic() + grace_s
        if self._stop_deadline is None or deadline < self._stop_deadline:
            self._stop_deadline = deadline
        # May run in a signal handler: the loop sees this flag, woken from a wait for messages.
        self._announce_draining = True
        self.link.wake()

    def run(self) -> int:
        if self._listener is not None:
            self._sock.bind(self.endpoint)
            logger.info("listening for gateways on %s", self.endpoint)
        else:
            self._sock.connect(self.endpoint)
        self.link.start()
        # Before loading anything: a gateway that refuses our key gets a clear exit, not a silent worker.
        if self._handshake is not None and self._handshake.refused(wait_s=10.0):
            logger.error("the gateway at %s refused this worker's CURVE key; exiting", self.endpoint)
            return 3
        self._send(wire.Hello(wire.PROTOCOL_VERSION, self.worker_id, os.getpid()))
        try:
            loading = not self.spec.standby or self.standby.wait()
            while loading:
                self._load_and_warm()
                unloaded = self._serve()
                # Unloaded on request (not stopped meanwhile): free the model, stand by again.
                loading = unloaded and self._stop_deadline is None and self.standby.release_and_wait()
        except SystemExit:
            raise
        except BaseException as exc:  # the engine's state is now unknown: report, then exit
            logger.error("fatal: %s", exc)
            logger.debug("fatal traceback:\n%s", traceback.format_exc())
            self.link.send_last(wire.Fatal(f"{type(exc).__name__}: {exc}"))
            return 1
        finally:
            self._close()
        return 0

    def _say_goodbye(self) -> None:
        """The last frame: the gateway learns at once that this process is gone (LINGER flushes it),
        instead of waiting for its heartbeat timeout. Sent from every exit; the fatal one included."""
        detail = "stopped on request" if self._stop_requested else "exiting"
        self.link.send_last(wire.Status(WorkerState.STOPPED, detail, None))

    def _close(self) -> None:
        self._say_goodbye()
        # Within the LINGER time the gateway has to take the last frames anyway.
        socket_released = self.link.close(flush_s=2.0)
        if self.jobs is not None:
            self.jobs.close()
        if self.engine is not None:
            try:
                self.engine.close()
            except Exception:  # closing is best effort; the process exits next
                logger.debug("engine close failed", exc_info=True)
        if self._handshake is not None:
            self._handshake.close()
        if self._listener is not None:
            self._listener.close()
        if socket_released:  # else the link thread still holds it; the process exits without waiting
            self._sock.close()
            self._ctx.term()

    def move_to(
        self, state: WorkerState, detail: str = "", progress: float | None = None, epoch: int | None = None
    ) -> None:
        check_transition(self.state, state)
        self.state = state
        self._send(wire.Status(state, detail, progress, epoch))

    def _load_and_warm(self) -> None:
        spec = self.spec
        entry = registry.lookup(spec.engine)
        try:
            context = {"max_seq_len": spec.max_seq_len}  # the gateway checked with this context too
            settings = entry.settings.model_validate(spec.engine_settings, context=context)
        except ValidationError as exc:
            raise RuntimeError(f"engine_settings of model {spec.name!r} are invalid: {exc}") from None
        self.move_to(WorkerState.LOADING, f"loading {spec.engine} model", 0.0)
        started = time.monotonic()
        engine_class = entry.engine_class() if spec.task != "embed" else entry.package.embedding_class()
        supported = type(settings).supported_parameters
        if missing := missing_capabilities(engine_class, supported):
            # A contract bug, not a user error: caught by tests/unit/test_engine_contract.py first.
            raise RuntimeError(
                f"{engine_class.__name__} lists {', '.join(missing)} but does not implement it"
            )
        engine: Engine = engine_class(spec.path, spec.max_seq_len, settings)
        engine.load(lambda detail, progress: self.move_to(WorkerState.LOADING, detail, progress))
        self.engine = engine
        self.info = engine.info()
        chat_template = ChatTemplate.for_model(spec.path, spec.chat_template)
        self.jobs = JobDesk(engine, spec, self._send)
        self.embeddings = EmbeddingBatch(engine, self.info, spec, self._send, self.jobs.spans, self._beat,
                                         arrived=self._handle_arrived,
                                         counted=self.jobs.count_embeds)  # fmt: skip
        load_s = time.monotonic() - started
        logger.info("model loaded in %.1fs", load_s)
        self.move_to(WorkerState.WARMING, "warm-up generation")
        if spec.task == "embed":
            warm_s = warm_up_embeddings(engine)
        else:
            warm_s = warm_up(engine, self.info.max_seq_len, spec.warmup_runs)
        # Devices again: memory in use now includes the cache and the warm-up's allocations.
        self.info = engine.info()
        # The model's Python objects live until an unload: kept out of full collections, which
        # would otherwise walk them all with the GIL held, stalling every stream (400,000 objects,
        # 0.1 s, for the CPU demo model on a 2-core VM). release_model unfreezes them first.
        gc.collect()
        gc.freeze()
        # The link reads the gateway's frames from here on; its prompt thread prepares prompts with
        # a tokenizer the engine hands out for that thread.
        self.link.serve_prompts(PromptDesk(engine.text_codec(), chat_template, spec, self.info, supported))
        self._ready = wire.Ready(
            self.info,
            os.getpid(),
            round(load_s, 3),
            round(warm_s, 3),
            chat_template is not None,
            tokenizer_info(spec.path, spec.max_seq_len, chat_template),
        )
        check_transition(self.state, WorkerState.READY)
        # The gateway holds the warm-up's counts from the moment it sees Ready, not one heartbeat later.
        self._beat()
        self.state = WorkerState.READY
        self._send(self._ready)
        logger.info("ready (warm-up %.2fs)", warm_s)

    # ---- the loop --------------------------------------------------------------------------

    def _serve(self) -> bool:
        """Serve until a stop (False) or an Unload (True) ends it."""
        assert self.engine is not None
        engine = self.engine
        jobs, embeddings = self.jobs, self.embeddings
        assert jobs is not None and embeddings is not None
        trace = StepTrace.from_environment()  # None unless GATEWAY_STEP_TRACE names a file
        if trace is not None:
            self.link.trace_handoffs(trace.handoff_waits)
            if isinstance(engine, CountsPrefill):
                trace.count_prefill(engine.prefill_tokens, engine.cached_prompt_tokens)
        try:
            self._loop(engine, jobs, embeddings, trace)
        finally:
            if trace is not None:
                self.link.trace_handoffs(None)
                trace.close()
        return self.standby.unload_deadline is not None

    def _loop(
        self, engine: Engine, jobs: JobDesk, embeddings: EmbeddingBatch, trace: StepTrace | None
    ) -> None:
        last_heartbeat = last_report = 0.0
        reported_held = 0  # the requests held, as the last heartbeat told the gateways
        interval_s = self.spec.heartbeat_interval_s
        link, handlers = self.link, self._handlers
        window_s, gather_s = self.spec.admission_window_s, self.spec.burst_gather_s
        while True:
            # Never wait for messages while jobs are active; wait only when idle (and only briefly
            # while a job waits for its constraint to compile in the compiler process, or a change
            # of load waits for its report).
            idle = not engine.has_work()
            # Embeds that arrived during the last embedding turn make the next one at once.
            timeout_s = 0.0 if not idle or embeddings.queue else (0.005 if jobs.waiting else interval_s)
            if idle and jobs.held != reported_held and link.gateways > 1:
                timeout_s = min(timeout_s, max(last_report + LOAD_REPORT_GAP_S - time.monotonic(), 0.0))
            for item in link.take(timeout_s):
                handlers[type(item)](item)
            if idle and engine.has_work():
                if gather_s and (self._following or link.preparing):
                    gathered = self._gather_following(gather_s)
                    if trace is not None:
                        trace.note_gather(*gathered)
                if window_s:
                    self._gather_burst(window_s)
                self._following = 0
            if embeddings.queue:
                # A turn may take minutes, with a heartbeat only every interval: the gateways that
                # share this worker hear of its work before it starts, not an interval later.
                now, held = time.monotonic(), jobs.held
                if link.gateways > 1 and held != reported_held and now >= last_report + LOAD_REPORT_GAP_S:
                    last_report, reported_held = now, held
                    self._beat()
                embeddings.run()
            if jobs.waiting:
                jobs.settle()
            if engine.has_work():
                if trace is not None:
                    trace.before_step()
                outputs = engine.step()
                if trace is not None:
                    trace.after_step(
                        [(o.rid, len(o.token_ids), o.finish_reason is not None) for o in outputs]
                    )
                if outputs:
                    self._send(wire.Step(jobs.outputs(outputs)))
                    jobs.start_waiting()  # queued jobs the finished ones made room for
                if trace is not None:
                    trace.after_send()
            now = time.monotonic()
            if self._announce_draining:
                self._announce_draining = False
                if self.state is not WorkerState.DRAINING:
                    self.move_to(WorkerState.DRAINING, "shutting down")  # the gateway stops routing to us
            heartbeat_due = now - last_heartbeat >= interval_s
            if not heartbeat_due and jobs.held != reported_held and link.gateways > 1:
                # Several gateways admit by this worker's load: each hears of the others' jobs now.
                if now - last_report >= LOAD_REPORT_GAP_S:
                    last_report, reported_held = now, jobs.held
                    self._beat()
            if heartbeat_due:
                last_heartbeat = last_report = now
                reported_held = jobs.held
                if self._handshake is not None and self._handshake.refused():
                    logger.error("the gateway at %s refused this worker's CURVE key; exiting", self.endpoint)
                    return
                # Its step counter and job counts are what the gateway's wedge watchdog judges by:
                # prefill chunks send no Step frame, and only the engine knows which jobs it holds.
                self._beat()
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    logger.warning("gateway (pid %s) is gone; exiting", self.parent_pid)
                    return
            if self._stop_deadline is not None:
                if not (engine.has_work() or embeddings.queue):  # Embeds taken during the last turn
                    return
                if now >= self._stop_deadline:
                    jobs.abort_all("the server is shutting down")
                    return
            unload_at = self.standby.unload_deadline
            busy = engine.has_work() or jobs.waiting or embeddings.queue
            if unload_at is not None and (not busy or now >= unload_at):
                jobs.abort_all("the model is being unloaded")
                return

    def _gather_following(self, limit_s: float) -> tuple[float, str]:
        """The engine was idle and has just been given a job, and more are on their way: the gateway
        was still admitting others when it sent it (Generate.following), or their frames are here
        with their prompts being prepared. Take them before the first step, so that the burst is
        prefilled in one step, as the library prefills jobs it is handed together; without it the
        first job steps alone and the others wait for that step. Waits up to limit_s in all, and a
        quarter of it for each next job (the gateway's requests may have gone to another model).
        Returns the seconds it waited and why it stopped: "told" (the last Generate said none was
        coming and no prompt was being prepared), "quiet" (no job for a quarter of limit_s) or
        "limit"."""
        link, handlers = self.link, self._handlers
        started = time.monotonic()
        deadline = started + limit_s
        quiet_s = limit_s / 4
        while self._following or link.preparing:
            left = deadline - time.monotonic()
            if left <= 0:
                return time.monotonic() - started, "limit"
            items = link.take(min(quiet_s, left))
            if not items:
                ended = time.monotonic()
                return ended - started, "limit" if ended >= deadline else "quiet"
            for item in items:
                handlers[type(item)](item)
        return time.monotonic() - started, "told"

    def _gather_burst(self, window_s: float) -> None:
        """The engine was idle and has just been given a job: take the rest of a burst that is on
        its way (requests sent together reach the worker about a gateway's admission apart) before
        the first step, so that they are prefilled together. Without it the first job's prefill
        starts alone, the others wait for it, and a burst is prefilled a few jobs per step, each
        step also decoding the jobs already started (the library, handed all of them at once,
        prefills them in one go). Ends at window_s, or once nothing has come for a quarter of it."""
        deadline = time.monotonic() + window_s
        quiet_s = window_s / 4
        while (left := deadline - time.monotonic()) > 0:
            items = self.link.take(min(quiet_s, left))
            if not items:
                return
            for item in items:
                self._handlers[type(item)](item)

    # ---- message handlers --------------------------------------------------------------------

    def handle(self, item: Any) -> None:
        """One message (or prepared job) the link passed on, by its type."""
        self._handlers[type(item)](item)

    @property
    def stopping(self) -> bool:
        return self._stop_deadline is not None

    def release_model(self) -> None:
        """After an unload: the engine closed and its memory freed; the process stays."""
        self.link.serve_prompts(StandbyDesk())  # the prompt thread stops using the model first
        if self.jobs is not None:
            self.jobs.close()
        if self.engine is not None:
            self.engine.close()
        self.engine, self.info, self.jobs, self.embeddings, self._ready = None, None, None, None, None
        gc.unfreeze()
        gc.collect()  # the engine's tensors go now, not at some later collection
        logger.info("model unloaded; its memory is free")

    def _on_generate(self, prepared: PreparedJob) -> None:
        if self.state is not WorkerState.READY or self.jobs is None:
            rid = prepared.message.rid
            text = NOT_LOADED if self.jobs is None else "the model is shutting down"
            self._send(wire.Rejected(rid, RejectCode.SHUTTING_DOWN, text, None))
            return
        self._following = prepared.message.following
        self.jobs.generate(prepared)

    def _on_embed(self, prepared: PreparedEmbed) -> None:
        self.link.took_embed()  # counted as the batch's (or answered) from here on, not the link's
        if self.embeddings is None:  # a standby worker
            self._send(wire.Rejected(prepared.message.rid, RejectCode.SHUTTING_DOWN, NOT_LOADED, None))
            return
        self.embeddings.add(prepared)  # answered once what has arrived is taken, batched with the others

    def _on_cancel(self, msg: wire.Cancel) -> None:
        if self.embeddings is not None and self.embeddings.cancel(msg.rid):
            logger.debug("cancelled embedding request %s", msg.rid)
        elif self.jobs is not None and self.jobs.cancel(msg.rid):
            logger.debug("cancelled %s", msg.rid)

    def _handle_arrived(self) -> None:
        """Between the engine batches of a long embedding turn: what the link has passed on since
        (a Cancel for one of the turn's requests among it), without waiting."""
        for item in self.link.take(0.0):
            self._handlers[type(item)](item)

    def _on_reintroduce(self, msg: wire.Reintroduce) -> None:
        self._send(wire.Hello(wire.PROTOCOL_VERSION, self.worker_id, os.getpid()))
        if self.state is WorkerState.READY and self._ready is not None:
            self._send(self._ready)

    def _on_shutdown(self, msg: wire.Shutdown) -> None:
        logger.info("shutdown requested (grace %.1fs)", msg.grace_s)
        self.request_stop(msg.grace_s)

    def _on_retire(self, msg: wire.Retire) -> None:
        logger.info("retired by the leading gateway (grace %.1fs)", msg.grace_s)
        self.request_stop(msg.grace_s)

    # ---- sending -------------------------------------------------------------------------------

    def _send(self, message: wire.Message) -> None:
        # Never dropped: a Step can carry a job's end. A gateway that takes nothing for the patience
        # makes this raise, which is fatal for the worker (model_worker.link_thread).
        self.link.send(message)

    def _beat(self) -> None:
        """A Heartbeat now: the worker's state, its engine's counters and its load."""
        assert self.engine is not None and self.jobs is not None
        load = self.jobs.load(self.link.embeds_arriving)
        self._send(wire.Heartbeat(self.state, self.engine.stats(), load))
