"""Admission of incoming link connections: accept pacing and the dropping of stalled ones.

A listener accepts a connection only when it has room for it. Connections
beyond that wait in the kernel's listen backlog (:data:`LISTEN_BACKLOG`,
capped by ``net.core.somaxconn``), so a burst of honest links (a prompt
restart, a scale-out) waits a moment instead of being dropped, and a flood of
connections that never complete holds a bounded number of fds and memory.

An accepted connection passes two stages: *arriving* holds at most
``ARRIVAL_FACTOR * cap`` connections, *handshaking* at most ``cap``
(``aio.MaxPendingHandshakes``):

- *arriving*: its first message is not complete yet. An honest client sends
  it (HELLO, a data channel's attach record, or the TLS preamble) as soon as
  it is connected, so only a stalled or hostile one stays here. When the
  stage is full and another connection waits in the backlog, the oldest
  arrival older than :data:`ARRIVAL_GRACE_S` is dropped to make room. A
  connection whose first message is complete waits here for a handshake slot
  and is never dropped for it.
- *handshaking*: in the handshake proper (and TLS). When every slot is taken
  and a connection waits for one, the handshake that made no progress for the
  longest time is dropped once it has been idle for :data:`STALL_GRACE_S`;
  progress is each complete step the peer takes (an honest one takes
  milliseconds), and time this end spends on its own work does not count.

Whatever its stage, a connection is dropped when the handshake time limit
since its accept runs out (``link_dials.HANDSHAKE_LIMIT_S``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from aio_datadist.control_reader import ControlReader
from aio_datadist.fd_budget import ACCEPT_GONE, ACCEPT_RETRY_S, NO_ROOM, close_listening

__all__ = ["ARRIVAL_FACTOR", "ARRIVAL_GRACE_S", "LISTEN_BACKLOG", "STALL_GRACE_S", "Admission", "Pending", "streams"]

log = logging.getLogger("aio_datadist.links")

#: The listen backlog asked for; the kernel caps it at ``net.core.somaxconn`` (4096 on current Linux).
LISTEN_BACKLOG = 4096
#: The arriving stage holds this many times the handshake cap. A silent arrival costs one fd; room for
#: several bursts' worth keeps honest connections that are slow to send their first message (a loaded
#: machine, hundreds of links at once) from ever meeting the grace below.
ARRIVAL_FACTOR = 4
#: An arrival this old without its first message may be dropped when the arriving stage is full.
ARRIVAL_GRACE_S = 0.05
#: A handshake idle this long may be dropped when every slot is taken and a connection waits for one.
STALL_GRACE_S = 1.0


class Pending:
    """One accepted connection until its handshake ends (see the module docstring)."""

    __slots__ = ("conn", "task", "accepted", "last", "ready", "busy", "_idle")

    def __init__(self, conn: socket.socket, idle: Callable[[], None] | None = None) -> None:
        self.conn = conn
        self.task: asyncio.Task | None = None
        self.accepted = self.last = time.monotonic()
        self.ready = False
        self.busy = 0
        self._idle = idle  # told when this end's own work ends (the connection may be idle from then on)

    def unread(self) -> bool:
        """Whether bytes from the peer wait in the kernel that this end has not read yet (then the peer
        did its part: this end is behind, not the peer)."""
        try:
            return bool(self.conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except OSError:  # nothing to read (or the connection is gone)
            return False

    def progress(self) -> None:
        """The peer completed a step."""
        self.last = time.monotonic()

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """This end is doing its own work: the connection is not idle meanwhile."""
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1
            self.progress()
            if not self.busy and self._idle is not None:
                self._idle()


class Admission:
    """Accepts connections on a listening socket at the pace described in the module docstring.

    ``serve(admission, conn, pending)`` runs in its own task per accepted
    connection; it calls :meth:`first_message`, then :meth:`slot`, then runs
    the handshake, and :meth:`leave` when done (it owns ``conn``). It is given
    this admission: its owner may have let go of it (stopped listening) by the
    time the task first runs.
    """

    def __init__(self, sock: socket.socket, cap: int,
                 serve: Callable[[Admission, socket.socket, Pending], Coroutine[Any, Any, None]]) -> None:
        self.sock = sock
        name = sock.getsockname()
        self.address = (name[0], name[1])  # where it listens (it listens nowhere once closed)
        self.cap = cap
        self._serve = serve
        self.arriving: dict[Pending, None] = {}  # in accept order
        self.handshaking: dict[Pending, None] = {}
        self._loop = asyncio.get_running_loop()
        self._changed: asyncio.Future = self._loop.create_future()
        self._backlog = False  # a connection waits in the listen backlog (seen readable since the last accept)
        self._task: asyncio.Task | None = self._loop.create_task(self._run())

    def tasks(self) -> set[asyncio.Task]:
        """The tasks of every connection not through its handshake yet."""
        return {p.task for p in (*self.arriving, *self.handshaking) if p.task is not None}

    async def close(self) -> None:
        """Stop accepting and close the listening socket; connections already accepted go on."""
        task, self._task = self._task, None
        try:
            if task is not None and not task.get_loop().is_closed():  # (a closed loop runs it no more)
                task.cancel()
                await asyncio.wait([task])
        finally:  # cancelled in the wait too: a socket left listening would take connections nobody accepts
            close_listening(self.sock)

    # -- the accept loop -----------------------------------------------------

    async def _run(self) -> None:
        said: str | None = None  # what accept()'s failures were said to be since it last took a connection
        while True:
            await self._room()
            self._backlog = False
            try:
                conn = await self._accept_one()
            except OSError as exc:
                if exc.errno in ACCEPT_GONE:
                    continue  # that connection is gone, not the listener
                kind = "room" if exc.errno in NO_ROOM else "listener"
                if said != kind:  # once per kind, not every retry (20 a second for as long as it lasts)
                    said = kind
                    if kind == "room":
                        log.warning("cannot accept a connection now (%s); it waits in the listen backlog", exc)
                    else:
                        log.error("the link door's accept() failed (%s); trying again every %.0f ms",
                                  exc, ACCEPT_RETRY_S * 1e3)
                # Waits before the next try, whatever the error: one the listener keeps returning (EBADF,
                # EINVAL) took the loop's whole CPU when it was tried again at once.
                await self._wait(ACCEPT_RETRY_S)  # (a connection of this listener that leaves wakes it at once)
                continue
            said = None
            conn.setblocking(False)
            pending = Pending(conn, self._signal)
            self.arriving[pending] = None
            pending.task = self._loop.create_task(self._serve(self, conn, pending))

    async def _accept_one(self) -> socket.socket:
        """The next connection of the listen backlog, accepted here and only here, never in a callback.

        asyncio's ``sock_accept`` accepts in a reader callback that may already be queued when the call is
        cancelled (the door closed by ``finalize`` as a peer dials): the connection it then takes is set on a
        cancelled future, logged as an error and its socket left open until collected."""
        while True:
            try:
                return self.sock.accept()[0]
            except (BlockingIOError, InterruptedError):
                pass
            readable = self._loop.create_future()
            self._loop.add_reader(self.sock, _wake, readable)
            try:
                await readable
            finally:
                self._stop_reading()

    async def _room(self) -> None:
        """Until the arriving stage has room, dropping the oldest stalled arrival when someone waits.

        Wakes when a place frees, when a connection comes to wait in the backlog, when the oldest arrival
        reaches its grace, and when an arrival reads part of its first message (it may be stalled again)."""
        while len(self.arriving) >= ARRIVAL_FACTOR * self.cap:
            if not self._backlog:
                await self._backlog_or_change()
                continue
            now = time.monotonic()
            grace: float | None = None
            for p in self.arriving:  # oldest first
                if p.ready:
                    continue
                if now - p.accepted < ARRIVAL_GRACE_S:
                    grace = ARRIVAL_GRACE_S - (now - p.accepted)  # the ones after it are younger still
                    break
                if not p.unread():  # with unread bytes, its first_message reads them and wakes this
                    log.debug("dropped a connection that sent no first message in %.2f s", now - p.accepted)
                    self._drop(p)
                    break
            else:
                await self._wait(None)
                continue
            if grace is not None:
                await self._wait(grace)

    async def _backlog_or_change(self) -> None:
        """Until a connection waits in the listen backlog or a stage changes. The listening socket has this
        reader only meanwhile: ``_accept_one`` sets its own on the same fd."""
        waits = self._loop.create_future()

        def readable() -> None:
            self._loop.remove_reader(self.sock)  # level-triggered: once is enough
            self._backlog = True
            if not waits.done():
                waits.set_result(None)

        self._loop.add_reader(self.sock, readable)
        try:
            await self._wait(None, waits)
        finally:
            self._stop_reading()

    def _stop_reading(self) -> None:
        """Remove the listening socket's reader, unless the loop or the socket is closed already (the coroutine
        collected after its loop closed without shutting down, and the door closed from another loop)."""
        if not self._loop.is_closed() and self.sock.fileno() != -1:
            self._loop.remove_reader(self.sock)

    # -- a connection's stages -----------------------------------------------

    async def first_message(self, conn: socket.socket, size_of: Callable[[bytes], int]) -> bytes:
        """Read exactly the first message: 4 bytes, then up to ``size_of(those 4 bytes)`` in all."""
        data = bytearray()
        need = 4
        while len(data) < need:
            chunk = await self._loop.sock_recv(conn, need - len(data))
            if not chunk:
                raise ConnectionError(f"closed after {len(data)} bytes of its first message")
            data += chunk
            if need == 4 and len(data) == 4:
                need = max(4, size_of(bytes(data)))
            if len(data) < need and len(self.arriving) >= ARRIVAL_FACTOR * self.cap:
                self._signal()  # no unread byte now: it may be the arrival to drop
        return bytes(data)

    async def slot(self, pending: Pending) -> None:
        """Wait for a handshake slot, dropping the most stalled handshake once it is idle long enough."""
        pending.ready = True
        while len(self.handshaking) >= self.cap:
            now = time.monotonic()
            victim: Pending | None = None
            behind = False
            for p in self.handshaking:
                if p.busy:  # its working() wakes this when it ends
                    continue
                if p.unread():
                    behind = True
                elif victim is None or p.last < victim.last:
                    victim = p
            if victim is not None and now - victim.last >= STALL_GRACE_S:
                log.debug("dropped a handshake idle for %.2f s: a connection waits for its slot", now - victim.last)
                self._drop(victim)
                continue
            if victim is not None:
                await self._wait(STALL_GRACE_S - (now - victim.last))
            else:
                # Nothing tells when this end reads bytes that complete no step: look again one grace on, as
                # if they were progress (the drop still goes by the last complete step).
                await self._wait(STALL_GRACE_S if behind else None)
        self.arriving.pop(pending, None)
        self.handshaking[pending] = None
        pending.progress()
        self._signal()

    def leave(self, pending: Pending) -> None:
        """The connection is through its handshake (or gone). Idempotent."""
        if self.arriving.pop(pending, 0) is None or self.handshaking.pop(pending, 0) is None:
            self._signal()

    def _drop(self, pending: Pending) -> None:
        self.leave(pending)
        if pending.task is not None:
            pending.task.cancel()

    def _signal(self) -> None:
        if not self._changed.done():
            self._changed.set_result(None)
        self._changed = self._loop.create_future()

    async def _wait(self, timeout: float | None, *also: asyncio.Future) -> None:
        """Until a stage changes (or one of ``also`` is done), at most ``timeout`` seconds when given."""
        await asyncio.wait([self._changed, *also], timeout=None if timeout is None else max(timeout, 0.001),
                           return_when=asyncio.FIRST_COMPLETED)


async def streams(conn: socket.socket, head: bytes) -> tuple[ControlReader, asyncio.StreamWriter]:
    """Reader and writer of an accepted connection of which ``head`` was read already."""
    loop = asyncio.get_running_loop()
    reader = ControlReader(loop=loop)
    reader.feed_data(head)
    writers: list[asyncio.StreamWriter] = []
    # With a connected callback the protocol is a server's, as asyncio.start_server makes it (start_tls
    # then takes the server side).
    protocol = asyncio.StreamReaderProtocol(reader, lambda _, writer: writers.append(writer), loop=loop)
    await loop.connect_accepted_socket(lambda: protocol, conn)
    return reader, writers[0]


def _wake(readable: asyncio.Future[None]) -> None:
    if not readable.done():
        readable.set_result(None)
