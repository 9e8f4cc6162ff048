"""A slow network path on loopback: a relay that holds MiBs in flight, for tests that cut transfers."""

from __future__ import annotations

import array
import asyncio
import fcntl
import termios

from relay import Relay

__all__ = ["SlowPath"]


class SlowPath(Relay):
    """A loopback relay in front of ``target`` that acts as a long, thin network path: bytes towards
    the dialler go at ``rate`` bytes/s and arrive ``latency`` s after they were sent, so that MiBs
    are on their way at any time. What is on its way is delivered even after the sender closed or
    reset its end (as packets in flight are); a receiver that closes its end gets no more."""

    CHUNK = 1 << 16

    def __init__(self, target: tuple[str, int], rate: float, latency: float) -> None:
        super().__init__(target)
        self.rate = rate
        self.latency = latency
        self.queued = 0  # bytes taken from a sender and not yet delivered, over every connection: on the wire

    def on_its_way(self) -> int:
        """Bytes a sender can no longer take back: those on the line (:attr:`queued`) and those the relay's
        kernel received and it has not read yet (a peer host's receive queue). Its own read-ahead buffers
        (asyncio's, up to 384 KiB a connection) are not counted."""
        unread = array.array("i", [0])
        total = self.queued
        for writer in self.writers:
            sock = writer.get_extra_info("socket")
            if sock is not None and sock.fileno() >= 0:
                fcntl.ioctl(sock.fileno(), termios.FIONREAD, unread)
                total += unread[0]
        return total

    async def downstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._line(reader, writer)

    async def _line(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        line: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()

        async def take() -> None:
            try:
                while data := await reader.read(self.CHUNK):
                    self.queued += len(data)
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
                self.queued -= len(data)
                if writer.is_closing():  # the receiver's end was closed meanwhile: it gets no more (uvloop's
                    return  # transport raises RuntimeError on a write then, asyncio's drops it)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            writer.transport.abort()
        finally:
            taker.cancel()
            await asyncio.wait([taker])
            while not line.empty():  # never delivered: no longer on the wire
                self.queued -= len(line.get_nowait()[1] or b"")
