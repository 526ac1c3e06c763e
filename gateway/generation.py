"""One generation request's life in the gateway: admission, submit, stream outputs, cancel.

Runs in the gateway process, on its asyncio loop. Owns `ActiveJob` (a request that holds a slot on
a replica and an open stream) and the per-request timers: the deadline (cancels the engine job
and tells the client) and the SSE keep-alive ticker. Every way out of a request goes through
`ActiveJob.close()`, which cancels the engine job unless it finished — the abort table's contract.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from gateway.errors import APIError, InvalidRequest, RequestTimeout, ServiceUnavailable, WorkerFailed
from gateway.router import ModelRoute
from gateway.supervisor import WorkerHandle
from gateway.worker_link import KEEPALIVE, RequestStream, StreamEnd, WorkerLink
from model_worker import protocol as wire

logger = logging.getLogger(__name__)

_REJECTION_STATUS = {"service_unavailable": ServiceUnavailable}
_END_ERRORS: dict[int, type[APIError]] = {408: RequestTimeout, 503: WorkerFailed}


class _NotStarted(Exception):
    """A replica failed before accepting the job: safe to try another replica."""

    def __init__(self, replica_id: str, error: APIError) -> None:
        super().__init__(error.message)
        self.replica_id = replica_id
        self.error = error


class ActiveJob:
    def __init__(
        self, link: WorkerLink, route: ModelRoute, replica: WorkerHandle, stream: RequestStream, work: int = 0
    ) -> None:
        self.work = work
        self.link = link
        self.route = route
        self.replica = replica
        self.stream = stream
        self.rid = stream.rid
        self.prompt_tokens = 0
        self.done = False
        self._closed = False
        self._deadline_timer: asyncio.TimerHandle | None = None

    def arm_deadline(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        delay = deadline - time.monotonic()
        self._deadline_timer = loop.call_later(max(delay, 0.0), self._on_deadline)

    def _on_deadline(self) -> None:
        if self.done or self._closed:
            return
        logger.info("request %s: deadline passed; cancelling its job", self.rid)
        self.link.send(self.replica.id, wire.Cancel(self.rid))
        self.link.end_stream(self.stream, StreamEnd(408, "request_timeout", "the request timed out"))

    async def outputs(self, keepalive: bool = False) -> AsyncIterator[wire.JobOutput | object]:
        """Yield JobOutputs until the job finishes; raise APIError if it ends any other way."""
        queue = self.stream.queue
        while not self.done:
            item = await queue.get()
            self.stream.last_consumed = time.monotonic()
            if item is KEEPALIVE:
                if keepalive:
                    yield item
                continue
            if isinstance(item, StreamEnd):
                self.done = True
                raise _END_ERRORS.get(item.status, ServiceUnavailable)(item.message, code=item.code)
            if item.finish_reason == "abort":
                self.done = True
                reason = (item.usage or {}).get("error", "the job was aborted")
                raise ServiceUnavailable(str(reason), code="aborted")
            if item.finish_reason is not None:
                self.done = True
            yield item

    async def close(self) -> None:
        """Idempotent: cancel the engine job unless it finished, free the slot and the stream."""
        if self._closed:
            return
        self._closed = True
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        if not self.done:
            self.link.send(self.replica.id, wire.Cancel(self.rid))
        self.link.close_stream(self.rid)
        self.route.release(self.replica, self.work)


class GenerationService:
    def __init__(self, link: WorkerLink, keepalive_s: float, write_stall_timeout_s: float) -> None:
        self.link = link
        self.keepalive_s = keepalive_s
        self.write_stall_timeout_s = write_stall_timeout_s
        self.draining = False
        self.in_flight = 0
        self._ticker: asyncio.Task[None] | None = None
        self._abandoned: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._ticker = asyncio.create_task(self._keepalive_forever(), name="sse-keepalive")

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)

    async def submit(
        self,
        route: ModelRoute,
        params: wire.SamplingParams,
        deadline: float,
        *,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
    ) -> ActiveJob:
        if self.draining:
            raise ServiceUnavailable("the server is shutting down", code="shutting_down")
        chars = len(prompt or "") + sum(len(m["content"]) for m in messages or [])
        size = chars // 4 + len(prompt_token_ids or [])
        generate = (prompt, prompt_token_ids, messages, params.to_wire())
        avoid: frozenset[str] = frozenset()
        while True:
            try:
                return await self._submit_once(
                    route, generate, deadline, size, size + params.max_tokens, avoid
                )
            except _NotStarted as failure:
                # The replica died before it took the job: nothing ran, so another replica may.
                avoid |= {failure.replica_id}
                if not any(
                    r.id not in avoid and r.state not in ("failed", "stopped") for r in route.replicas
                ):
                    raise failure.error from None
                logger.info("replica %s failed before starting a job; trying another", failure.replica_id)

    async def _submit_once(
        self,
        route: ModelRoute,
        generate: tuple[Any, ...],
        deadline: float,
        size: int,
        work: int,
        avoid: frozenset[str],
    ) -> ActiveJob:
        replica = await route.acquire(deadline, size, work, avoid)
        stream = self.link.open_stream(uuid.uuid4().hex, replica.id)
        job = ActiveJob(self.link, route, replica, stream, work)
        stream.on_abandon = job.close
        try:
            if not self.link.send(replica.id, wire.Generate(job.rid, *generate)):
                unreachable = WorkerFailed(f"the worker for model '{route.config.name}' is unreachable")
                raise _NotStarted(replica.id, unreachable)
            try:
                reply = await asyncio.wait_for(stream.accepted, max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                raise RequestTimeout("the request timed out before the model accepted it") from None
            if isinstance(reply, wire.Rejected):
                job.done = True
                error_class = _REJECTION_STATUS.get(reply.code, InvalidRequest)
                raise error_class(reply.message, code=reply.code, param=reply.param)
            if isinstance(reply, StreamEnd):
                job.done = True
                error = _END_ERRORS.get(reply.status, ServiceUnavailable)(reply.message, code=reply.code)
                raise _NotStarted(replica.id, error) if reply.code == "worker_failed" else error
            if not isinstance(reply, wire.Accepted):
                raise WorkerFailed("unexpected reply from the worker")
            job.prompt_tokens = reply.prompt_tokens
            job.arm_deadline(deadline)
            return job
        except BaseException:
            await job.close()
            raise

    async def ask(
        self, route: ModelRoute, build: Callable[[str], wire.Message], timeout_s: float
    ) -> wire.Tokens:
        """One request/reply exchange with a ready worker (tokenize, detokenize)."""
        if self.draining:
            raise ServiceUnavailable("the server is shutting down", code="shutting_down")
        replica = route.any_ready()
        stream = self.link.open_stream(uuid.uuid4().hex, replica.id)
        try:
            if not self.link.send(replica.id, build(stream.rid)):
                raise WorkerFailed(f"the worker for model '{route.config.name}' is unreachable")
            try:
                reply = await asyncio.wait_for(stream.accepted, timeout_s)
            except asyncio.TimeoutError:
                raise RequestTimeout("the worker did not answer in time") from None
        finally:
            self.link.close_stream(stream.rid)
        if isinstance(reply, wire.Rejected):
            raise InvalidRequest(reply.message, code=reply.code, param=reply.param)
        if isinstance(reply, StreamEnd):
            raise _END_ERRORS.get(reply.status, ServiceUnavailable)(reply.message, code=reply.code)
        if not isinstance(reply, wire.Tokens):
            raise WorkerFailed("unexpected reply from the worker")
        return reply

    def track_release(self, jobs: list[ActiveJob]) -> Callable[[], Awaitable[None]]:
        """An idempotent release for a streamed request, also run when its request task ends.

        A streamed response's body may never start (the client left between the handler's return
        and the first chunk); then its `finally` never runs. The request task always ends, though,
        so a done-callback on it guarantees the jobs are cancelled and the slots freed.
        """
        released = False

        async def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self.in_flight -= 1
            await asyncio.gather(*(job.close() for job in jobs))

        def on_task_done(_: asyncio.Task[Any]) -> None:
            if not released:
                task = asyncio.get_running_loop().create_task(release())
                self._abandoned.add(task)
                task.add_done_callback(self._abandoned.discard)

        request_task = asyncio.current_task()
        if request_task is not None:
            request_task.add_done_callback(on_task_done)

            async def abandon() -> None:
                # A client that stopped reading: drop its connection; the callback above frees the rest.
                request_task.cancel()
                await release()

            for job in jobs:
                job.stream.on_abandon = abandon
        return release

    async def _keepalive_forever(self) -> None:
        """One ticker for all streams: keep-alive pings, and dropping clients that stopped reading."""
        while True:
            await asyncio.sleep(min(self.keepalive_s / 2, self.write_stall_timeout_s / 4, 1.0))
            now = time.monotonic()
            for stream in self.link.open_streams():
                # Finished jobs count too: their last chunks may be stuck behind a client that
                # stopped reading, holding a slot and a connection.
                if stream.queue.qsize() and now - stream.last_consumed >= self.write_stall_timeout_s:
                    logger.warning("request %s: client stopped reading; dropping it", stream.rid)
                    if not stream.finished:
                        self.link.send(stream.worker_id, wire.Cancel(stream.rid))
                        self.link.end_stream(
                            stream, StreamEnd(503, "slow_reader", "the client stopped reading")
                        )
                    self.link.close_stream(stream.rid)
                    if stream.on_abandon is not None:
                        task = asyncio.create_task(stream.on_abandon())
                        self._abandoned.add(task)
                        task.add_done_callback(self._abandoned.discard)
                elif not stream.finished and now - stream.last_activity >= self.keepalive_s:
                    stream.feed(KEEPALIVE)
