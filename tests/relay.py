"""A loopback TCP relay in front of an endpoint, for tests that watch or shape the bytes of a link.

Subclasses say what each direction does: :meth:`Relay.upstream` (dialler to
target) and :meth:`Relay.downstream` (target to dialler). Closing the relay
aborts every connection it made and waits (bounded) for its tasks.
"""

from __future__ import annotations

import asyncio

__all__ = ["Relay"]


class Relay:
    """Accepts on a loopback port (``address``) and connects each connection on to ``target``."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> Relay:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.address = self.server.sockets[0].getsockname()[:2]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=5)
        await self.server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        self.writers.append(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            self.tasks.discard(task)
            return
        self.writers.append(up_writer)
        await asyncio.gather(self.upstream(reader, up_writer), self.downstream(up_reader, writer))
        self.tasks.discard(task)

    async def upstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.pipe(reader, writer)

    async def downstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.pipe(reader, writer)

    async def pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward bytes as they come, through :meth:`seen`; close (or abort, on an error) when done."""
        try:
            while data := await reader.read(1 << 16):
                if writer.is_closing():  # the other side went meanwhile (uvloop's transport raises on a write)
                    break
                self.seen_bytes(data)
                writer.write(data)
                await writer.drain()
            writer.close()
        except (ConnectionError, OSError):
            writer.transport.abort()

    def seen_bytes(self, data: bytes) -> None:
        """Called with every chunk :meth:`pipe` forwards."""
