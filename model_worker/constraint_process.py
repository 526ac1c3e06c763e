"""The constraint compiler's own process: JSON schemas and regular expressions compiled where they
cannot pause the worker's streams, and where a compile over its time budget can be stopped.

Code on both sides. The worker (model_worker.constraints) owns a `CompilerProcess`: it starts the
child lazily, sends one constraint at a time, polls for the answer without blocking the serve loop,
and kills the child when a compile runs past its budget. The child (`_serve`) owns nothing but a
pipe: it compiles each constraint it receives and sends back the pickled parser (or the refusal).

Why a process: compiling is pure Python that holds the GIL for its whole run; on a thread, every
GIL hand-back inside a decode step waited out the switch interval, and a half-second compile
stretched one token gap to half a second. A process also gives a real stop: a thread cannot be
killed, so a slow compile used to run on after its refusal.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from model_worker.engines.base import RequestRejected
from wire.params import SamplingParams
from wire.results import RejectCode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Compiled:
    parser: Any


def _serve(conn: Connection) -> None:
    """The child: compile what arrives until the worker closes the pipe (or dies: EOF)."""
    from model_worker.engines.structured_output import compile_parser, dumps_parser

    compile_parser(SamplingParams(json_object=True))  # the imports, before the first clock starts
    conn.send(("ready",))
    while True:
        try:
            params = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply: tuple[Any, ...] = ("compiled", dumps_parser(compile_parser(params)))
        except RequestRejected as exc:
            reply = ("rejected", exc.code, exc.message, exc.param)
        except Exception as exc:  # the libraries raise many types for what they cannot build
            reply = ("failed", f"{type(exc).__name__}: {exc}")
        conn.send(reply)


class CompilerProcess:
    """One child at a time, started on first use; `send` only while `idle`."""

    def __init__(self) -> None:
        self._process: Any = None
        self._conn: Connection | None = None
        self._ready = False
        self.busy_since: float | None = None  # when the compile now running was sent

    @property
    def idle(self) -> bool:
        """Ready for a constraint (starting the child if there is none)."""
        if self._process is None:
            context = multiprocessing.get_context("spawn")
            self._conn, child_end = context.Pipe()
            self._process = context.Process(
                target=_serve, args=(child_end,), name="constraint-compiler", daemon=True
            )
            self._process.start()
            child_end.close()
            self._ready = False
        if not self._ready:
            self._ready = self._poll() == ("ready",)
        return self._ready and self.busy_since is None

    def send(self, params: SamplingParams) -> None:
        assert self._conn is not None and self.idle
        self._conn.send(params)
        self.busy_since = time.monotonic()

    def answer(self) -> Compiled | RequestRejected | None:
        """The running compile's outcome once there is one (None while it runs)."""
        if self.busy_since is None:
            return None
        reply = self._poll()
        if reply is None:
            return None
        self.busy_since = None
        if reply[0] == "compiled":
            return Compiled(pickle.loads(reply[1]))
        if reply[0] == "rejected":
            return RequestRejected(reply[1], reply[2], reply[3])
        return RequestRejected(
            RejectCode.INVALID_RESPONSE_FORMAT, f"the constraint failed: {reply[-1]}", "response_format"
        )

    def _poll(self) -> tuple[Any, ...] | None:
        assert self._conn is not None
        try:
            if not self._conn.poll():
                return None
            reply: tuple[Any, ...] = self._conn.recv()
            return reply
        except (EOFError, OSError):
            code = self._process.exitcode if self._process is not None else None
            logger.warning("the constraint compiler process ended (exit code %s); starting another", code)
            self.stop()
            return ("failed", "the constraint compiler process ended")

    def stop(self) -> None:
        """Kill the child (a compile over budget, or the worker closing); the next use starts one."""
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None
        self._ready = False
        self.busy_since = None
