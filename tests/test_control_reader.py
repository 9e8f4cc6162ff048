"""The control connection's reader: a stream reader for the handshake, then a direct feed to the link."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import pytest

from aio_datadist.control_reader import ControlReader, open_control


@contextlib.asynccontextmanager
async def connected(limit: int = 1 << 16) -> AsyncIterator[tuple[ControlReader, asyncio.StreamWriter, socket.socket]]:
    """A ControlReader on a dialled loopback connection, and the accepted far end (blocking, 5 s bound);
    both ends are closed on exit."""
    server = socket.create_server(("127.0.0.1", 0))
    try:
        reader, writer = await open_control(server.getsockname()[:2])
        far, _ = server.accept()
    finally:
        server.close()
    far.settimeout(5.0)
    reader._limit = limit  # a small limit makes the reader pause the connection sooner
    try:
        yield reader, writer, far
    finally:
        writer.close()
        far.close()


async def until(condition, what: str) -> None:
    for _ in range(500):  # 5 s at most
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.asyncio
async def test_it_reads_like_a_stream_reader_then_feeds_the_rest_in_order():
    async with connected() as (reader, writer, far):
        far.sendall(b"HELLO" + b"left-over ")
        assert await reader.readexactly(5) == b"HELLO"
        await until(lambda: len(reader._buffer) == 10, "the left-over bytes")
        chunks: list[bytes] = []
        ends: list[BaseException | None] = []
        reader.feed_to(chunks.append, ends.append)
        assert chunks == [b"left-over "]  # what the handshake left comes first, at once
        far.sendall(b"then this")
        await until(lambda: b"".join(chunks) == b"left-over then this", "the next chunk")
        assert not ends
        far.close()
        await until(lambda: ends == [None], "the end of the stream")


@pytest.mark.asyncio
@pytest.mark.parametrize("end", ["eof", "reset"])
async def test_a_stream_that_ended_during_the_handshake_ends_the_feed_at_once(end):
    """Ended or reset before the link was up: the feed ends at once, with the connection's error if it had one
    (the reset case: added by the audit of 2026-12-07, ``feed_to`` passed checking ``_eof`` alone)."""
    async with connected() as (reader, writer, far):
        if end == "eof":
            far.sendall(b"last words")
        else:
            far.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        far.close()  # with SO_LINGER 0: RST
        await until(lambda: reader._eof or reader.exception() is not None, "the end of the stream")
        chunks: list[bytes] = []
        ends: list[BaseException | None] = []
        reader.feed_to(chunks.append, ends.append)
        if end == "eof":
            assert chunks == [b"last words"] and ends == [None]
        else:
            assert chunks == [] and len(ends) == 1 and isinstance(ends[0], ConnectionError), ends


@pytest.mark.asyncio
async def test_a_reset_connection_ends_the_feed_with_its_error_and_later_bytes_are_dropped():
    async with connected() as (reader, writer, far):
        chunks: list[bytes] = []
        ends: list[BaseException | None] = []
        reader.feed_to(chunks.append, ends.append)
        far.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        far.close()  # RST
        await until(lambda: ends, "the error")
        assert isinstance(ends[0], ConnectionError)
        reader.feed_data(b"late")  # what a protocol might still deliver: nobody reads it
        reader.feed_eof()
        assert chunks == [] and len(ends) == 1


@pytest.mark.asyncio
async def test_a_reader_paused_by_a_flood_reads_again_once_fed():
    """A peer that floods right after the handshake filled the buffer past its limit, which paused the
    connection; handing over must resume it, or the link would stall."""
    async with connected(limit=1024) as (reader, writer, far):
        flood = bytes(range(256)) * 64  # 16 KiB, well past 2 x 1 KiB
        far.sendall(flood)
        await until(lambda: reader._paused, "the reader pausing")
        received = bytearray()
        reader.feed_to(received.extend, lambda exc: None)
        far.sendall(b"and more")
        await until(lambda: bytes(received) == flood + b"and more", "every byte")


@pytest.mark.asyncio
async def test_it_feeds_one_link_only():
    async with connected() as (reader, writer, far):
        reader.feed_to(lambda data: None, lambda exc: None)
        with pytest.raises(RuntimeError, match="feeds a link already"):
            reader.feed_to(lambda data: None, lambda exc: None)


@pytest.mark.asyncio
async def test_a_message_the_link_fails_to_act_on_fails_the_link_with_a_clear_error():
    """Messages are acted on inside the connection's callback: a bug there must fail the link (both ends
    learn of it), not vanish into the event loop's exception handler."""
    from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMException, LLMStatusCode, Placement
    from aio_datadist.testing import usable_link
    from peers import DECODER_ID, PROMPT_ID, linked_pair

    desc = CacheDesc(2, (4, 256), DataType.DT_UINT8, Placement.HOST)
    async with linked_pair(link=False) as pair:
        pair.pm.allocate_blocks_cache(desc, BlocksCacheKey(PROMPT_ID, 0))
        dst = pair.dm.allocate_blocks_cache(desc, BlocksCacheKey(DECODER_ID, 0))
        await pair.link()
        owner_link = usable_link(pair.prompt, DECODER_ID)

        def broken(*args):
            raise KeyError("a bug")

        owner_link.on_request = broken
        with pytest.raises(LLMException) as raised:
            await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, [0], [1], timeout=5000)
        assert raised.value.status_code == LLMStatusCode.LLM_LINK_FAILED
        assert owner_link.broken is not None and "internal error" in str(owner_link.broken)
        assert "KeyError" in str(owner_link.broken)
