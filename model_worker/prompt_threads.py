"""The worker's prompt threads: one that takes what the link read, in order, and a few that prepare.

Runs in the worker process, on threads of its own beside the link and engine threads
(model_worker.link_thread starts and stops them). Owns the order in which what the gateway sent
reaches the engine thread, and the preparing of prompts (through model_worker.prompt_desk).

The dispatching thread ("worker-prompts") takes every message the link thread read, in arrival
order, and hands each Generate, Embed, Tokenize and Detokenize to the first free preparing thread
("worker-prep-1" and on, `PREPARING_THREADS` of them): a long prompt takes one of them a while, and
the requests behind it are prepared meanwhile on the others, so that a short request does not wait
for someone else's long prompt. What they prepare goes to the engine thread (`hand_over`), or, for
Tokenize and Detokenize, back to the gateway (`reply`), as each is done. What the engine thread must
see in order stays in order:
- one request's messages (its rid's): a Cancel never overtakes its Generate or Embed, nor a second
  Generate with the same rid the first. While a rid is being prepared, whatever comes for it waits
  behind it here and follows it in its turn, as the thread that finishes it hands it over.
- a message about no request in particular (Shutdown, Retire, Unload, Load, Reintroduce) goes to
  the engine thread after everything read before it has been handed over, and nothing read after it
  is handed over before it, as with one thread: the jobs sent before a Shutdown are run in its
  drain, and none sent after it slips in ahead of it.
A failure on any of these threads fails the link, as every error of the link does (its `guarded`),
and `close()` prepares what has arrived, then stops and joins them all.
"""

from __future__ import annotations

import collections
import functools
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from model_worker.prompt_desk import PREPARING_THREADS
from wire import messages as wire

if TYPE_CHECKING:
    from model_worker.prompt_desk import PromptDesk

_STOP = object()  # the last item of each queue
# What the preparing threads prepare or answer; the other messages the link reads (Cancel, Shutdown,
# ...) go to the engine thread as they are, in their turn.
PREPARED_TYPES = frozenset({wire.Generate, wire.Embed, wire.Tokenize, wire.Detokenize})
# The messages about one request, whose order the engine thread sees as it arrived.
_ONE_REQUEST = (wire.Generate, wire.Embed, wire.Tokenize, wire.Detokenize, wire.Cancel)


def _rid_of(message: wire.Message) -> str | None:
    return message.rid if isinstance(message, _ONE_REQUEST) else None


class PromptThreads:
    def __init__(
        self,
        hand_over: Callable[[Any], None],
        reply: Callable[[wire.Message], None],
        guarded: Callable[[Callable[[], None]], None],
    ) -> None:
        """`hand_over` gives the engine thread an item (it never blocks), `reply` sends an answer to
        the gateway, `guarded` runs a thread's loop and fails the link if it raises."""
        self._hand_over, self._reply = hand_over, reply
        self.arrived: queue.SimpleQueue[Any] = queue.SimpleQueue()  # the link thread puts, in order
        self._work: queue.SimpleQueue[Any] = queue.SimpleQueue()  # for the preparing threads
        self._desk: PromptDesk | None = None
        self._desk_set = threading.Event()  # the dispatching thread waits for it (a listener reads early)
        self._lock = threading.Lock()
        # The rids being prepared, each with what arrived for it since, in order; the condition is
        # told when the last of them is handed over, or a preparing thread fails.
        self._busy: dict[str, collections.deque[wire.Message]] = {}
        self._settled = threading.Condition(self._lock)
        self._broken = False  # a preparing thread ended on an error: what it held never comes
        # Generates handed over prepared (or dropped at a stop): several threads count, under the lock.
        self._generates_prepared = 0
        self._preparers: dict[type[wire.Message], Callable[[PromptDesk, Any], None]] = {
            wire.Generate: self._prepare_generate,
            wire.Embed: self._prepare_embed,
            wire.Tokenize: self._answer_tokenize,
            wire.Detokenize: self._answer_detokenize,
        }
        assert frozenset(self._preparers) == PREPARED_TYPES
        dispatching = threading.Thread(
            target=guarded, args=(self._dispatch_loop,), name="worker-prompts", daemon=True
        )
        preparing = [
            threading.Thread(
                target=guarded,
                args=(functools.partial(self._telling_failure, self._prepare_loop),),
                name=f"worker-prep-{number}",
                daemon=True,
            )
            for number in range(1, PREPARING_THREADS + 1)
        ]
        self._threads = [dispatching, *preparing]

    # ---- the link's side -----------------------------------------------------------------------

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def serve(self, desk: PromptDesk) -> None:
        """Prepare with `desk` from now on (each item with the desk set when its preparing begins)."""
        self._desk = desk
        self._desk_set.set()

    @property
    def serving(self) -> bool:
        """A desk has been set: the link thread reads the gateway's frames."""
        return self._desk is not None

    @property
    def generates_prepared(self) -> int:
        """Generates handed over prepared (a stop before the model was loaded drops them)."""
        return self._generates_prepared

    @property
    def alive(self) -> bool:
        """One of these threads may still hand over, reply, or ring the link's bell."""
        return any(thread.is_alive() for thread in self._threads)

    def close(self, timeout_s: float) -> None:
        """Prepare what has arrived, then stop every thread; waits up to timeout_s in all."""
        deadline = time.monotonic() + timeout_s
        self._desk_set.set()  # a dispatching thread still waiting for a model sees the stop instead
        self.arrived.put(_STOP)
        for thread in self._threads:  # the dispatching thread first: it stops the others
            if thread.is_alive():
                thread.join(max(deadline - time.monotonic(), 0.0))

    # ---- the dispatching thread ------------------------------------------------------------------

    def _dispatch_loop(self) -> None:
        try:
            while (message := self.arrived.get()) is not _STOP:
                self._desk_set.wait()  # frames read while the model loads wait for it here
                if self._desk is None:  # stopping before the model was ever loaded
                    if type(message) is wire.Generate:
                        with self._lock:
                            self._generates_prepared += 1
                    continue
                if not self._dispatch(message):
                    return
            self._all_handed_over()  # what follows a request's message is queued by its thread
        finally:
            for _ in range(PREPARING_THREADS):
                self._work.put(_STOP)

    def _dispatch(self, message: wire.Message) -> bool:
        """False once a preparing thread has failed (the link fails with its error)."""
        rid = _rid_of(message)
        if rid is None:  # about no request: after everything read before it, as with one thread
            if not self._all_handed_over():
                return False
            self._hand_over(message)
            return True
        with self._lock:
            waiting = self._busy.get(rid)
            if waiting is not None:  # its request is being prepared: it follows in its turn
                waiting.append(message)
                return True
            if type(message) in self._preparers:
                self._busy[rid] = collections.deque()
                self._work.put(message)
                return True
        # A Cancel whose request is not being prepared: what it follows is handed over already.
        self._hand_over(message)
        return True

    def _all_handed_over(self) -> bool:
        """Wait until every message dispatched so far is handed over; False if one never will be."""
        with self._settled:
            self._settled.wait_for(lambda: not self._busy or self._broken)
            return not self._broken

    # ---- the preparing threads -------------------------------------------------------------------

    def _telling_failure(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException:
            with self._settled:
                self._broken = True
                self._settled.notify_all()
            raise

    def _prepare_loop(self) -> None:
        while (message := self._work.get()) is not _STOP:
            desk = self._desk
            assert desk is not None  # only dispatched once a desk is set
            self._preparers[type(message)](desk, message)
            self._done(message.rid)

    def _prepare_generate(self, desk: PromptDesk, message: wire.Generate) -> None:
        prepared = desk.prepare(message)
        # Counted before the hand-over: a gather that then sees none preparing steps without this
        # job (it joins the next step), never waits for one already handed over.
        with self._lock:
            self._generates_prepared += 1
        self._hand_over(prepared)

    def _prepare_embed(self, desk: PromptDesk, message: wire.Embed) -> None:
        self._hand_over(desk.prepare_embed(message))

    def _answer_tokenize(self, desk: PromptDesk, message: wire.Tokenize) -> None:
        self._reply(desk.tokenize(message))

    def _answer_detokenize(self, desk: PromptDesk, message: wire.Detokenize) -> None:
        self._reply(desk.detokenize(message))

    def _done(self, rid: str) -> None:
        """The rid's message is handed over: what waited behind it follows, up to its next message to
        prepare, which goes back in line for a preparing thread."""
        with self._lock:
            waiting = self._busy[rid]
            while waiting:
                message = waiting.popleft()
                if type(message) in self._preparers:
                    self._work.put(message)
                    return
                self._hand_over(message)
            del self._busy[rid]
            if not self._busy:
                self._settled.notify_all()
