"""TLS on links: the control connection and the data channels, encrypted end to end.

With ``aio.TlsServerContext`` (listening) / ``aio.TlsClientContext``
(dialling) set, every TCP connection of a link opens with a 5-byte plaintext
preamble, ``AIOT`` and the connection's kind (control or data), which the
server answers with one byte before the client starts its TLS handshake. The
answer keeps the ClientHello out of whatever the server has read ahead in
plaintext, so the server can hand the connection to asyncio's TLS (control)
or to a :class:`TlsChannel` (data) without losing a byte. After the TLS
handshake everything is encrypted: the link handshake, control messages,
data-channel attach records and cache bytes. Nothing is sent in plaintext
but the preamble and its answer.

The native SocketEngine moves plaintext between cache memory and a socket
and cannot speak TLS, so a data channel with TLS is a :class:`TlsChannel`:
an asyncio TLS transport whose protocol decrypts straight into the
destination cache memory (``BufferedProtocol.get_buffer`` hands the TLS
layer the cache's own bytes) and encrypts straight from the source cache
memory in bounded chunks, with flow control. Cache memory is only touched on
the event loop thread, by the job that owns it; cancelling the job stops it
before its next chunk.
"""

from __future__ import annotations

import asyncio
import ctypes
import socket
import ssl
import struct
from collections.abc import Callable, Sequence
from typing import Any, cast

from aio_datadist.status import LLMException, LLMStatusCode

__all__ = ["CONTROL", "DATA", "MAGIC", "PREAMBLE_SIZE", "TlsChannel", "accept_control", "accept_data",
           "dial_control", "dial_data", "is_tls"]

MAGIC = b"AIOT"
CONTROL = b"C"
DATA = b"D"
PREAMBLE_SIZE = len(MAGIC) + 1
_GO = b"G"

#: Plaintext bytes handed to the TLS layer per write: big enough for few Python steps, small enough
#: that one write never encrypts a whole request into memory at once.
CHUNK = 256 * 1024
#: Decrypted bytes kept for a receive that has not started yet (the peer starts sending as soon as it
#: accepted a request); beyond this the channel stops reading until the receive starts.
SPILL_LIMIT = 1 << 20
_SPILL_READ = 64 * 1024


def is_tls(conn: Any) -> bool:
    """Whether a data-channel connection is a :class:`TlsChannel` (else a plain socket)."""
    return isinstance(conn, TlsChannel)


def _nothing_ahead(reader: asyncio.StreamReader, what: str) -> None:
    """Refuse a connection whose peer sent plaintext behind the preamble (or its answer).

    A stream keeps what it read ahead, and ``start_tls`` keeps the stream: bytes
    that came in before TLS would be read first, as if they had come out of the
    TLS session. An honest peer sends nothing there (it waits for the answer, or
    for our TLS handshake); a process in the path could (a relay that passes the
    TLS handshake on to the real peer, so the certificate checks pass, but writes
    its own handshake records behind the answer). ``start_tls`` pauses reading
    before its first await, so nothing reaches the stream between this check and
    TLS. (``_buffer``: the stream's read-ahead, in CPython's streams, which uvloop
    uses too.)"""
    if len(reader._buffer):  # type: ignore[attr-defined]
        raise ConnectionError(f"{what}: the peer sent plaintext behind the TLS preamble")


def _no_renegotiation(context: ssl.SSLContext) -> ssl.SSLContext:
    """``context`` with TLS 1.2 renegotiation refused (``parse_options`` sets it already; this keeps every
    connection made here so). A peer that starts a renegotiation and leaves it hanging makes ``SSL_write``
    answer WANT_READ: the TLS layer then keeps what was written, views of cache memory, in its write
    backlog, to be encrypted (read) whenever the peer goes on."""
    context.options |= ssl.OP_NO_RENEGOTIATION
    return context


def missing_certificate(context: ssl.SSLContext) -> bool:
    """Whether the server ``context`` has no certificate to present (no ``load_cert_chain``): an in-memory
    handshake with a client that checks nothing fails on the server's side for want of a cipher it can use."""
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE
    bios = [ssl.MemoryBIO() for _ in range(4)]
    server_end = context.wrap_bio(bios[0], bios[1], server_side=True)
    client_end = client.wrap_bio(bios[2], bios[3], server_side=False)
    for _ in range(8):
        for end, out, into in ((client_end, bios[3], bios[0]), (server_end, bios[1], bios[2])):
            try:
                end.do_handshake()
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError as exc:
                return end is server_end and exc.reason in ("NO_SHARED_CIPHER", "NO_CERTIFICATE_SET")
            data = out.read()
            if data:
                into.write(data)
    return False


async def dial_control(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, context: ssl.SSLContext,
                       host: str, limit_s: float) -> None:
    """Turn a freshly opened control connection into TLS (client side)."""
    writer.write(MAGIC + CONTROL)
    if await reader.readexactly(1) != _GO:
        raise ConnectionError("the peer did not accept TLS")
    _nothing_ahead(reader, "control connection")
    await writer.start_tls(_no_renegotiation(context), server_hostname=host, ssl_handshake_timeout=limit_s)


async def accept_control(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, context: ssl.SSLContext,
                         limit_s: float) -> None:
    """Turn an accepted control connection whose preamble was read into TLS (server side)."""
    _nothing_ahead(reader, "control connection")
    writer.write(_GO)
    await writer.start_tls(_no_renegotiation(context), ssl_handshake_timeout=limit_s)


async def dial_data(address: tuple[str, int], context: ssl.SSLContext, limit_s: float,
                    tune: Callable[[socket.socket], None]) -> TlsChannel:
    """Open a data connection and make it a TLS :class:`TlsChannel` (client side)."""
    loop = asyncio.get_running_loop()
    channel = TlsChannel()
    transport, _ = await loop.create_connection(lambda: channel, *address)
    try:
        tune(transport.get_extra_info("socket"))
        await channel.sendall(MAGIC + DATA)
        if await channel.recv_exactly(1) != _GO:
            raise ConnectionError("the peer did not accept TLS")
        if channel.read_ahead():  # plaintext behind the answer (see _nothing_ahead); later bytes go to TLS
            raise ConnectionError("data connection: the peer sent plaintext behind the TLS preamble")
        tls = await loop.start_tls(transport, channel, _no_renegotiation(context), server_hostname=address[0],
                                   ssl_handshake_timeout=limit_s)
        if tls is None:
            raise ConnectionError("the data connection closed during the TLS handshake")
        channel.wrapped(tls)
        return channel
    except BaseException:
        channel.close()
        transport.abort()
        raise


async def accept_data(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, context: ssl.SSLContext,
                      limit_s: float) -> TlsChannel:
    """Make an accepted data connection whose preamble was read a TLS :class:`TlsChannel` (server side).

    The stream's writer is kept by the channel: a collected ``StreamWriter``
    closes its transport, which the channel now runs on.
    """
    _nothing_ahead(reader, "data connection")
    loop = asyncio.get_running_loop()
    channel = TlsChannel(keep=writer)
    writer.write(_GO)
    tls = await loop.start_tls(writer.transport, channel, _no_renegotiation(context), server_side=True,
                               ssl_handshake_timeout=limit_s)
    if tls is None:
        raise ConnectionError("the data connection closed during the TLS handshake")
    channel.wrapped(tls)
    return channel


def _views(pairs: Sequence[int]) -> list[memoryview]:
    # ``pairs`` are ``[addr, nbytes, ...]`` runs from the validated cache geometry (cache.py / the
    # owner's request checks); the job that uses the views keeps the caches alive.
    return [memoryview((ctypes.c_ubyte * pairs[i + 1]).from_address(pairs[i])).cast("B")
            for i in range(0, len(pairs), 2) if pairs[i + 1]]


LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST and drops unsent bytes


def reset_on_close(sock: Any) -> None:
    """Make closing ``sock`` (a data channel's TCP socket, plain or under TLS) send a reset: the kernel then
    drops what it has not sent yet instead of delivering it to a peer after our transfer gave up."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
    except OSError:
        pass  # already dead: nothing left to drop


class TlsChannel(asyncio.BufferedProtocol):
    """One data channel over TLS: ordered jobs that move cache bytes, per direction.

    :meth:`start` mirrors the native engine's jobs: it returns a future of
    the bytes moved that fails with ``LLM_TIMEOUT`` after ``timeout_ms``,
    ``LLM_LINK_FAILED`` when the peer or the TLS session goes, and
    ``LLM_FAILED`` when this end closes the channel; cancelling the future
    stops the job. A job stopped part-way leaves the channel out of step, as
    a native one does, and the link resets it.
    """

    def __init__(self, keep: Any = None) -> None:
        self._keep = keep
        self._transport: asyncio.Transport | None = None
        self._closed = False
        self._lost: BaseException | None = None
        self._views: list[memoryview] = []  # where the TLS layer decrypts to, for the receiving task
        self._view = 0
        self._got = 0
        self._receiver: asyncio.Task | None = None
        self._filled: asyncio.Future | None = None
        self._spill = bytearray()
        self._spill_buf = memoryview(bytearray(_SPILL_READ))
        self._reading = True
        self._writable: asyncio.Future | None = None
        self._write_paused = False
        self._turns = {True: asyncio.Lock(), False: asyncio.Lock()}  # one job per direction at a time, in order
        self._jobs: set[asyncio.Task] = set()

    # -- life --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # a stream connection's

    def read_ahead(self) -> int:
        """Bytes received that no receive has taken yet."""
        return len(self._spill)

    def wrapped(self, transport: asyncio.Transport) -> None:
        """The TLS transport replaced the plain one (``start_tls`` does not call ``connection_made``)."""
        self._transport = transport
        self._reading = True  # the TLS layer reads for the application until told otherwise
        if self._closed:
            transport.abort()

    def close(self, *, reset: bool = False) -> None:
        """Drop the connection now (no TLS close_notify: a reset channel's stream is out of step); ``reset``:
        with a TCP reset, so that the kernel drops what it has not sent yet. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._fail(ConnectionAbortedError("the data channel was closed"))
        if self._transport is not None:
            sock = self._transport.get_extra_info("socket") if reset else None
            if sock is not None:
                reset_on_close(sock)
            self._transport.abort()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._fail(exc or ConnectionResetError("the peer closed the data channel"))

    def eof_received(self) -> bool:
        self._fail(ConnectionResetError("the peer closed the data channel"))
        return False

    def _fail(self, exc: BaseException) -> None:
        if self._lost is None:
            self._lost = exc
        for fut in (self._filled, self._writable):
            if fut is not None and not fut.done():
                fut.set_exception(self._lost)
                fut.exception()

    # -- reading -----------------------------------------------------------

    def _pause(self) -> None:
        if self._reading and self._transport is not None and self._lost is None:
            self._reading = False
            self._transport.pause_reading()

    def _resume(self) -> None:
        if not self._reading and self._transport is not None and self._lost is None:
            self._reading = True
            self._transport.resume_reading()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._view < len(self._views):
            view = self._views[self._view]
            return view[self._got:]
        return self._spill_buf

    def buffer_updated(self, nbytes: int) -> None:
        if self._view >= len(self._views):
            self._spill += self._spill_buf[:nbytes]
            if len(self._spill) >= SPILL_LIMIT:
                self._pause()
            return
        self._got += nbytes
        if self._got == len(self._views[self._view]):
            self._view += 1
            self._got = 0
            if self._view == len(self._views) and self._filled is not None and not self._filled.done():
                self._filled.set_result(None)

    async def _recv_into(self, views: list[memoryview]) -> None:
        if self._lost is not None:
            raise self._lost
        index = 0
        while index < len(views) and self._spill:  # what arrived before this receive started
            take = min(len(self._spill), len(views[index]))
            views[index][:take] = self._spill[:take]
            del self._spill[:take]
            if take < len(views[index]):
                views[index] = views[index][take:]
            else:
                index += 1
        if index == len(views):
            return
        self._views, self._view, self._got = views, index, 0
        self._receiver = asyncio.current_task()
        self._filled = asyncio.get_running_loop().create_future()
        try:
            self._resume()
            await self._filled
        finally:
            self._stop_receiving()

    def _stop_receiving(self) -> None:
        """Forget the receiving task's memory: not one more byte goes there."""
        self._views, self._view, self._got, self._filled, self._receiver = [], 0, 0, None, None

    async def recv_exactly(self, n: int) -> bytes:
        """The next ``n`` bytes (records of the attach exchange)."""
        buf = bytearray(n)
        await self._recv_into([memoryview(buf)])
        return bytes(buf)

    # -- writing -----------------------------------------------------------

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    async def _drain(self) -> None:
        if self._lost is not None:
            raise self._lost
        if not self._write_paused:
            # Encrypting is CPU work on the loop thread: let other links (and this channel's own
            # connection_lost) run between chunks even while the socket keeps up.
            await asyncio.sleep(0)
            if self._lost is not None:
                raise self._lost
            return
        self._writable = asyncio.get_running_loop().create_future()
        try:
            await self._writable
        finally:
            self._writable = None

    async def _send(self, views: list[memoryview]) -> None:
        assert self._transport is not None
        for view in views:
            for start in range(0, len(view), CHUNK):
                await self._drain()
                self._transport.write(view[start:start + CHUNK])
        await self._drain()

    async def sendall(self, data: bytes) -> None:
        """Send ``data`` (records of the attach exchange)."""
        await self._send([memoryview(data)])

    # -- jobs --------------------------------------------------------------

    def start(self, pairs: Sequence[int], *, send: bool, timeout_ms: int | None, what: str,
              keepalive: Any) -> asyncio.Future:
        """Send from or receive into the ``[addr, nbytes, ...]`` runs ``pairs``, after earlier jobs in the
        same direction; the future of the byte count (see the class docstring)."""
        loop = asyncio.get_running_loop()
        result: asyncio.Future = loop.create_future()
        if self._closed or self._lost is not None:  # a failed future, as a native job on a dead socket ends
            result.set_exception(self._error(what, self._lost))
            return result
        views = _views(pairs)
        total = sum(len(v) for v in views)
        job = loop.create_task(self._job(views, send, keepalive))
        self._jobs.add(job)
        timer = None if timeout_ms is None else loop.call_later(timeout_ms / 1000, _expire, result, what, timeout_ms)

        def job_done(task: asyncio.Task) -> None:
            self._jobs.discard(task)
            failure = ConnectionAbortedError("stopped") if task.cancelled() else task.exception()
            if result.done():
                return
            if failure is not None:
                result.set_exception(self._error(what, failure))
            else:
                result.set_result(total)

        def result_done(_: asyncio.Future) -> None:
            if timer is not None:
                timer.cancel()
            if not job.done():
                job.cancel()
                if self._receiver is job:  # it stops at its next step; its caches get no byte before that
                    self._stop_receiving()

        job.add_done_callback(job_done)
        result.add_done_callback(result_done)
        return result

    def running(self) -> int:
        """Jobs started and not finished yet."""
        return len(self._jobs)

    async def _job(self, views: list[memoryview], send: bool, keepalive: Any) -> None:
        try:
            async with self._turns[send]:  # FIFO: jobs run in the order they were started
                if send:
                    await self._send(views)
                else:
                    await self._recv_into(views)
        finally:
            del keepalive  # the caches live as long as the job, not as long as a failure's traceback

    def _error(self, what: str, exc: BaseException | None) -> LLMException:
        if self._closed:
            return LLMException(f"{what}: the data channel was closed", status_code=LLMStatusCode.LLM_FAILED)
        return LLMException(f"{what}: TLS data channel lost ({type(exc).__name__}: {exc})",
                            status_code=LLMStatusCode.LLM_LINK_FAILED)


def _expire(result: asyncio.Future, what: str, timeout_ms: int) -> None:
    if not result.done():
        result.set_exception(LLMException(f"{what} timed out after {timeout_ms} ms",
                                          status_code=LLMStatusCode.LLM_TIMEOUT))
