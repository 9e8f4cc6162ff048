"""A slow network path on loopback: a relay that holds MiBs in flight, for tests that cut transfers."""

from __future__ import annotations

import asyncio

__all__ = ["SlowPath"]


class SlowPath:
    """A loopback relay in front of ``target`` that acts as a long, thin network path: bytes towards
    the dialler go at ``rate`` bytes/s and arrive ``latency`` s after they were sent, so that MiBs
    are on their way at any time. What is on its way is delivered even after the sender closed or
    reset its end (as packets in flight are); a receiver that closes its end gets no more."""

    CHUNK = 1 << 16

    def __init__(self, target: tuple[str, int], rate: float, latency: float) -> None:
        self.target = target
        self.rate = rate
        self.latency = latency
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> SlowPath:
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
        await asyncio.gather(self._pipe(reader, up_writer), self._line(up_reader, writer))
        self.tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(self.CHUNK):
                writer.write(data)
                await writer.drain()
            writer.close()
        except (ConnectionError, OSError):
            writer.transport.abort()

    async def _line(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        line: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()

        async def take() -> None:
            try:
                while data := await reader.read(self.CHUNK):
                    line.put_nowait((loop.time() + self.latency, data))
                    await asyncio.sleep(len(data) / self.rate)
                line.put_nowait((loop.time() + self.latency, b""))
            except (ConnectionError, OSError):
                line.put_nowait((loop.time() + self.latency, None))

        taker = asyncio.ensure_future(take())
        try:
            while True:
                due, data = await line.get()
                await asyncio.sleep(max(0.0, due - loop.time()))
                if not data:
                    writer.close() if data == b"" else writer.transport.abort()
                    return
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            writer.transport.abort()
        finally:
            taker.cancel()
            await asyncio.wait([taker])
