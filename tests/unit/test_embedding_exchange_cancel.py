"""The gateway cancels an embedding on its worker when it ends unanswered (its deadline passed, its
client went away, an abort ended it), so that the worker stops running its inputs for nobody; an
answered one is not cancelled, nor is a tokenize (answered too soon for a Cancel to matter).

Runs in the pytest process: the gateway's real WorkerLink and serving objects over a real ipc
socket, with scripted workers (the rig of tests/unit/test_request_owner.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.errors import RequestTimeout, ServiceUnavailable
from tests.unit.test_request_owner import rig
from wire import messages as wire


def embed(rid: str) -> wire.Embed:
    return wire.Embed(rid, ["a"], None)


def tokenize(rid: str) -> wire.Tokenize:
    return wire.Tokenize(rid, "hi", None, True)


def test_an_embedding_that_ends_unanswered_is_cancelled_on_its_worker(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with rig(tmp_path) as r:
            loop = asyncio.get_running_loop()
            peer = r.peers["w0"]

            def start(deadline_s: float) -> asyncio.Task[wire.Embeddings]:
                owner = r.service.open_exchange(r.route, loop.time() + deadline_s)
                return asyncio.create_task(owner.run(embed, slot_work=3))

            async def sent() -> str:
                message = await peer.receive()
                assert isinstance(message, wire.Embed), message
                return message.rid

            timed_out = start(0.3)
            rid = await sent()
            with pytest.raises(RequestTimeout):
                await asyncio.wait_for(timed_out, 5)
            assert await r.cancels() == {rid}

            left = start(10.0)  # the client goes away: its handler's task is cancelled
            rid = await sent()
            left.cancel()
            with pytest.raises(asyncio.CancelledError):
                await left
            assert await r.cancels() == {rid}

            answered = start(10.0)
            rid = await sent()
            await peer.send(wire.Embeddings(rid, [[0.5]], 1))
            assert (await asyncio.wait_for(answered, 2)).vectors == [[0.5]]
            quick = r.service.open_exchange(r.route, loop.time() + 0.3).run(tokenize)
            with pytest.raises(RequestTimeout):
                await asyncio.wait_for(quick, 5)
            assert isinstance(await peer.receive(), wire.Tokenize)
            assert await r.cancels() == set()

            aborted = start(10.0)
            rid = await sent()
            r.service.abort_all(ServiceUnavailable("the server is shutting down", code="shutting_down"))
            with pytest.raises(ServiceUnavailable):
                await asyncio.wait_for(aborted, 2)
            assert await r.cancels() == {rid}
            r.assert_all_released()

    asyncio.run(scenario())
