"""The worker's serve loop: socket in, engine steps, one Step frame out per generator step.

Runs in the worker process, on its main thread: the only thread that touches the engine (the
exllamav2 generator is not thread-safe). Owns the DEALER socket, the engine, the chat template
and the worker's lifecycle (loading -> warming -> ready -> draining -> stopped).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from model_worker import protocol as wire
from model_worker.chat_template import ChatTemplate, TemplateError
from model_worker.engines.base import Engine, EngineSettings, RequestRejected, load_engine
from model_worker.handshake_watch import HandshakeWatch

logger = logging.getLogger(__name__)

WARMUP_PROMPT = (
    "Warm-up: the worker runs this once after loading so that kernels, allocators and caches "
    "are initialised before the first user request arrives. " * 3
)


class Worker:
    def __init__(
        self,
        worker_id: str,
        endpoint: str,
        spec: dict[str, Any],
        parent_pid: int | None,
        curve: tuple[bytes, bytes, bytes] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.spec = spec
        self.parent_pid = parent_pid
        self.heartbeat_interval_s = float(spec.get("heartbeat_interval_s", 1.0))
        self.state = "starting"
        self.engine: Engine | None = None
        self.chat_template: ChatTemplate | None = None
        self._stop_deadline: float | None = None
        self._ready_info: dict[str, Any] | None = None
        self._announce_draining = False
        self._live_rids: set[str] = set()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self._sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_SOCKET_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.SNDHWM, 10_000)
        self._sock.setsockopt(zmq.RCVHWM, 10_000)
        # Linger so the final Fatal/Heartbeat frames are flushed when we exit.
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._handshake: HandshakeWatch | None = None
        if curve is not None:
            # (own public key, own secret key, the gateway's public key): encrypted, and the gateway
            # admits only authorized worker keys.
            self._sock.curve_publickey, self._sock.curve_secretkey, self._sock.curve_serverkey = curve
            self._handshake = HandshakeWatch(self._sock)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._handlers: dict[type[wire.Message], Callable[[Any], None]] = {
            wire.Generate: self._on_generate,
            wire.Cancel: self._on_cancel,
            wire.Tokenize: self._on_tokenize,
            wire.Detokenize: self._on_detokenize,
            wire.Shutdown: self._on_shutdown,
            wire.Reintroduce: self._on_reintroduce,
        }

    # ---- lifecycle -------------------------------------------------------------------------

    def request_stop(self, grace_s: float) -> None:
        if self.state in ("starting", "loading", "warming"):
            sys.exit(0)  # nothing to drain; stop loading at once
        deadline = time.monotonic() + grace_s
        if self._stop_deadline is None or deadline < self._stop_deadline:
            self._stop_deadline = deadline
        self.state = "draining"
        # May run in a signal handler: the socket is touched only by the loop, which sees this flag.
        self._announce_draining = True

    def run(self) -> int:
        self._sock.connect(self.endpoint)
        # Before loading anything: a gateway that refuses our key gets a clear exit, not a silent worker.
        if self._handshake is not None and self._handshake.refused(wait_s=10.0):
            logger.error("the gateway at %s refused this worker's CURVE key; exiting", self.endpoint)
            return 3
        self._send(wire.Hello(wire.PROTOCOL_VERSION, self.worker_id, os.getpid()))
        try:
            self._load_and_warm()
            self._serve()
        except SystemExit:
            raise
        except BaseException as exc:  # the engine's state is now unknown: report, then exit
            logger.error("fatal: %s", exc)
            logger.debug("fatal traceback:\n%s", traceback.format_exc())
            self._send(wire.Fatal(f"{type(exc).__name__}: {exc}"))
            return 1
        finally:
            if self.engine is not None:
                try:
                    self.engine.close()
                except Exception:  # closing is best effort; the process exits next
                    logger.debug("engine close failed", exc_info=True)
            if self._handshake is not None:
                self._handshake.close()
            self._sock.close()
            self._ctx.term()
        return 0

    def _status(self, state: str, detail: str, progress: float | None = None) -> None:
        self.state = state
        self._send(wire.Status(state, detail, progress))

    def _load_and_warm(self) -> None:
        settings = EngineSettings(**self.spec["settings"])
        self._status("loading", f"loading {self.spec['engine']} model", 0.0)
        started = time.monotonic()
        engine = load_engine(self.spec["engine"], settings)
        engine.load(lambda detail, progress: self._status("loading", detail, progress))
        self.engine = engine
        self.chat_template = ChatTemplate.for_model(settings.path, self.spec.get("chat_template"))
        load_s = time.monotonic() - started
        logger.info("model loaded in %.1fs", load_s)
        self._status("warming", "warm-up generation", None)
        warm_s = self._warm_up(engine, int(self.spec.get("warmup_runs", 2)))
        info = dict(engine.info())
        info.update(pid=os.getpid(), load_s=round(load_s, 3), warmup_s=round(warm_s, 3))
        info["chat_template"] = self.chat_template is not None
        self.state = "ready"
        self._ready_info = info
        self._send(wire.Ready(info))
        logger.info("ready (warm-up %.2fs)", warm_s)

    def _warm_up(self, engine: Engine, runs: int) -> float:
        """Pay one-time costs now (kernel selection, allocator growth, sampling paths), so the first
        user request is as fast as the tenth: a short greedy run, a longer prompt and completion
        (new sequence-length shapes), and a sampled run; `runs` repeats the short one."""
        started = time.monotonic()
        max_seq_len = int(engine.info().get("max_seq_len") or 2048)
        # Prompts and completions always fit the context, however small it is configured.
        short = engine.encode(WARMUP_PROMPT, add_special_tokens=True)[: max(max_seq_len // 4, 1)]
        long_len = max(min(512, max_seq_len // 2), len(short))
        long = (short * (long_len // len(short) + 1))[:long_len]

        def params(prompt: list[int], tokens: int, **sampling: Any) -> wire.SamplingParams:
            room = max(min(tokens, max_seq_len - len(prompt) - 1), 1)
            return wire.SamplingParams(max_tokens=room, ignore_eos=True, **{"temperature": 0.0, **sampling})

        plan = [(short, params(short, 32))] * max(runs - 1, 1)
        plan.append((long, params(long, 128)))
        plan.append((short, params(short, 32, temperature=0.8, top_p=0.9, seed=0)))
        for run, (prompt_ids, params) in enumerate(plan):
            engine.submit(f"__warmup-{run}", prompt_ids, params)
            while engine.has_work():
                engine.step()
        return time.monotonic() - started

    # ---- the loop --------------------------------------------------------------------------

    def _serve(self) -> None:
        assert self.engine is not None
        engine = self.engine
        last_heartbeat = 0.0
        idle_timeout_ms = int(self.heartbeat_interval_s * 1000)
        while True:
            busy = engine.has_work()
            # Never block on the socket while jobs are active; block only when idle.
            if self._poller.poll(0 if busy else idle_timeout_ms):
                self._drain_socket()
            if engine.has_work():
                outputs = engine.step()
                if outputs:
                    outputs = [self._with_token_texts(o) if o.logprobs else o for o in outputs]
                    for output in outputs:
                        if output.finish_reason is not None:
                            self._live_rids.discard(output.rid)
                    self._send(wire.Step(outputs))
            now = time.monotonic()
            if self._announce_draining:
                self._announce_draining = False
                self._status("draining", "shutting down")  # the gateway stops routing to us
            if now - last_heartbeat >= self.heartbeat_interval_s:
                last_heartbeat = now
                if self._handshake is not None and self._handshake.refused():
                    logger.error("the gateway at %s refused this worker's CURVE key; exiting", self.endpoint)
                    return
                self._send(wire.Heartbeat(self._stats()))
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    logger.warning("gateway (pid %s) is gone; exiting", self.parent_pid)
                    return
            if self._stop_deadline is not None:
                if not engine.has_work():
                    return
                if now >= self._stop_deadline:
                    self._abort_all("the server is shutting down")
                    return

    def _drain_socket(self) -> None:
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = wire.decode(frame)
            except wire.ProtocolError as exc:
                logger.warning("dropped a bad frame (%d bytes): %s", len(frame), exc)
                continue
            handler = self._handlers.get(type(message))
            if handler is None:
                logger.warning("dropped an unexpected %s frame", type(message).__name__)
                continue
            handler(message)

    def _abort_all(self, reason: str) -> None:
        assert self.engine is not None
        outputs = []
        for rid in sorted(self._live_rids):
            self.engine.cancel(rid)
            outputs.append(wire.JobOutput(rid, "", [], "abort", {"error": reason}))
        self._live_rids.clear()
        if outputs:
            self._send(wire.Step(outputs))

    # ---- message handlers --------------------------------------------------------------------

    def _on_generate(self, msg: wire.Generate) -> None:
        assert self.engine is not None
        if self.state != "ready":
            self._send(wire.Rejected(msg.rid, "service_unavailable", "the model is shutting down", None))
            return
        try:
            params = wire.SamplingParams.from_wire(msg.params)
            prompt_ids = self._prompt_ids(msg)
            prompt_tokens = self.engine.submit(msg.rid, prompt_ids, params)
        except RequestRejected as exc:
            self._send(wire.Rejected(msg.rid, exc.code, exc.message, exc.param))
            return
        except wire.ProtocolError as exc:
            self._send(wire.Rejected(msg.rid, "invalid_request", str(exc), None))
            return
        self._live_rids.add(msg.rid)
        self._send(wire.Accepted(msg.rid, prompt_tokens))

    def _on_tokenize(self, msg: wire.Tokenize) -> None:
        assert self.engine is not None
        try:
            if msg.messages is not None:
                ids = self._render_chat(msg.messages)
            else:
                ids = self.engine.encode(msg.prompt or "", add_special_tokens=msg.add_special_tokens)
        except RequestRejected as exc:
            self._send(wire.Rejected(msg.rid, exc.code, exc.message, exc.param))
            return
        self._send(wire.Tokens(msg.rid, ids, ""))

    def _on_detokenize(self, msg: wire.Detokenize) -> None:
        assert self.engine is not None
        vocab = int(self.engine.info().get("vocab_size") or 0)
        bad = [t for t in msg.token_ids if not isinstance(t, int) or t < 0 or (vocab and t >= vocab)]
        if bad:
            self._send(
                wire.Rejected(msg.rid, "invalid_tokens", f"token ids out of range: {bad[:5]}", "tokens")
            )
            return
        self._send(wire.Tokens(msg.rid, list(msg.token_ids), self.engine.decode(list(msg.token_ids))))

    def _render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        assert self.engine is not None
        if self.chat_template is None:
            raise RequestRejected(
                "chat_template_missing",
                "this model has no chat template; use /v1/completions or set one in models.yaml",
                "messages",
            )
        try:
            text = self.chat_template.render(messages, add_generation_prompt=True)
        except TemplateError as exc:
            raise RequestRejected("invalid_messages", str(exc), "messages") from None
        # The template already holds bos and other special tokens.
        return self.engine.encode(text, add_special_tokens=False)

    def _prompt_ids(self, msg: wire.Generate) -> list[int]:
        assert self.engine is not None
        if msg.messages is not None:
            return self._render_chat(msg.messages)
        if msg.prompt_token_ids is not None:
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in msg.prompt_token_ids):
                raise RequestRejected("invalid_prompt", "prompt token ids must be integers", "prompt")
            return list(msg.prompt_token_ids)
        return self.engine.encode(msg.prompt or "", add_special_tokens=True)

    def _on_cancel(self, msg: wire.Cancel) -> None:
        assert self.engine is not None
        self._live_rids.discard(msg.rid)
        if self.engine.cancel(msg.rid):
            logger.debug("cancelled %s", msg.rid)

    def _on_reintroduce(self, msg: wire.Reintroduce) -> None:
        self._send(wire.Hello(wire.PROTOCOL_VERSION, self.worker_id, os.getpid()))
        if self.state == "ready" and self._ready_info is not None:
            self._send(wire.Ready(self._ready_info))

    def _on_shutdown(self, msg: wire.Shutdown) -> None:
        logger.info("shutdown requested (grace %.1fs)", msg.grace_s)
        self.request_stop(msg.grace_s)

    # ---- helpers -----------------------------------------------------------------------------

    def _with_token_texts(self, output: wire.JobOutput) -> wire.JobOutput:
        """Engines give logprobs by token id; clients want token strings, which need our tokenizer."""
        assert self.engine is not None and output.logprobs is not None
        decode = self.engine.decode
        entries = []
        for token_id, (logprob, alternatives) in zip(output.token_ids, output.logprobs, strict=False):
            alts = [[decode([int(alt_id)]), float(alt_lp)] for alt_id, alt_lp in alternatives]
            entries.append([decode([int(token_id)]), float(logprob), alts])
        return wire.JobOutput(
            output.rid, output.text, output.token_ids, output.finish_reason, output.usage, entries
        )

    def _stats(self) -> dict[str, Any]:
        assert self.engine is not None
        stats = dict(self.engine.stats())
        stats["state"] = self.state
        return stats

    def _send(self, message: wire.Message) -> None:
        try:
            self._sock.send(wire.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            # The gateway is not reading (gone or stalled); heartbeats and steps are droppable,
            # and the gateway's liveness checks will notice.
            logger.warning("send queue full; dropped %s", type(message).__name__)
