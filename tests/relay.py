"""A TCP relay on loopback that can cut one client off from a server.

Runs in the pytest process, on the test's event loop. `Relay` forwards one client's connections to
a server (etcd, a fake Kubernetes API) and can cut them and refuse new ones: that client's host is
cut off, while every other client still reaches the server.
"""

from __future__ import annotations

import asyncio


class Relay:
    """127.0.0.1:port -> 127.0.0.1:target_port, for one client; `cut()` drops its connections and
    refuses new ones until `mend()`."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._cut = False

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)
        if self._cut:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.transport.abort()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            self._writers -= {writer, up_writer}

    def cut(self) -> None:
        self._cut = True
        for writer in list(self._writers):
            writer.transport.abort()

    def mend(self) -> None:
        self._cut = False

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        # Every connection was aborted: its pipes end on their own.
        await asyncio.gather(*self._handlers, return_exceptions=True)
