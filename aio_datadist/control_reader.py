"""The control connection's reader: a stream reader for the handshake, a direct feed once the link is up.

The handshake reads records one at a time (``readexactly``), which a
:class:`asyncio.StreamReader` does well. An established link reads every
chunk the connection delivers and acts on it at once; through a stream
reader that costs a task wake-up per chunk (the protocol's callback fills the
buffer, the loop runs again, the reading task takes the chunk). A
:class:`ControlReader` is a stream reader until :meth:`~ControlReader.feed_to`
is called; from then on each chunk goes straight from the protocol's callback
to the link, first whatever the handshake left in the buffer.

The connection's protocol is still the stream protocol, so the writer, its
flow control and ``wait_closed`` work as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import SupportsIndex

__all__ = ["ControlReader", "open_control"]


class ControlReader(asyncio.StreamReader):
    """A stream reader that can hand its chunks to a callback instead of buffering them."""

    # The stream reader's own state (CPython's asyncio.StreamReader, unchanged since 3.4), which
    # handing over reads once: the bytes the handshake left and whether the stream ended.
    _buffer: bytearray
    _eof: bool
    _maybe_resume_transport: Callable[[], None]

    _fed = False  # whether feed_to was called: from then on nothing is buffered
    _on_data: Callable[[bytes], None] | None = None
    _on_end: Callable[[BaseException | None], None] | None = None

    def feed_to(self, on_data: Callable[[bytes], None], on_end: Callable[[BaseException | None], None]) -> None:
        """Hand every chunk to ``on_data`` from now on, starting with what is buffered; ``on_end`` once
        (``None`` at the end of the stream, else the connection's error), after which chunks are dropped.
        Nothing reads the stream any more after this."""
        if self._fed:
            raise RuntimeError("this reader feeds a link already")
        self._fed = True
        self._on_data, self._on_end = on_data, on_end
        buffered = bytes(self._buffer)
        self._buffer.clear()
        self._maybe_resume_transport()  # a handshake that filled the buffer paused the connection's reading
        if buffered:
            on_data(buffered)
        failed = self.exception()
        if failed is not None or self._eof:
            self._end(failed)

    def _end(self, exc: BaseException | None) -> None:
        on_end, self._on_data, self._on_end = self._on_end, None, None
        if on_end is not None:
            on_end(exc)

    def feed_data(self, data: Iterable[SupportsIndex]) -> None:
        if not self._fed:
            super().feed_data(data)
        elif self._on_data is not None:
            self._on_data(data)  # type: ignore[arg-type]  # the protocol feeds bytes

    def feed_eof(self) -> None:
        if self._fed:
            self._end(None)
        else:
            super().feed_eof()

    def set_exception(self, exc: Exception) -> None:
        if self._fed:
            self._end(exc)
        else:
            super().set_exception(exc)


async def open_control(address: tuple[str, int]) -> tuple[ControlReader, asyncio.StreamWriter]:
    """Dial a control connection (``asyncio.open_connection`` with a :class:`ControlReader`)."""
    loop = asyncio.get_running_loop()
    reader = ControlReader(loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport, _ = await loop.create_connection(lambda: protocol, *address)
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)
