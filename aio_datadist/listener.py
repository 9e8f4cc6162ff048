"""The listening side of a link table: accepting and sorting incoming connections.

A :class:`Listener` listens on TCP (and, for same-host peers, on the
abstract unix socket of ``transport.local``) and sorts each accepted
connection by its first message: a TLS preamble, a data channel's attach
record, or a control connection's HELLO. Incoming connections are admitted
at a pace (``admission.py``): past ``aio.MaxPendingHandshakes`` they wait in
the listen backlog, and stalled ones make room. A control connection runs
the server side of the handshake (``handshake.py``; TLS first when
configured) and asks its link table (:class:`Table`) whether to take the
link; a data connection attaches to the link its token names.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from aio_datadist import handshake, wire
from aio_datadist._checks import param_invalid
from aio_datadist.admission import LISTEN_BACKLOG, Admission, Pending, streams
from aio_datadist.control_reader import ControlReader
from aio_datadist.links import SUCCESS, Link, tune
from aio_datadist.own_dials import OwnDials
from aio_datadist.refusal_log import REFUSAL_LOG_EVERY_S as REFUSAL_LOG_EVERY_S
from aio_datadist.refusal_log import RefusalLog as RefusalLog
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.transport import tls
from aio_datadist.transport.local import LocalListener, boot_id
from aio_datadist.types import LLMRole
from aio_datadist.wire import Msg, ProtocolError

if TYPE_CHECKING:
    from aio_datadist.runtime import Runtime

__all__ = ["Listener", "RefusalLog", "Table"]

log = logging.getLogger("aio_datadist.links")

#: The size of a first message that is neither a TLS preamble nor an attach record: a HELLO.
_HELLO_SIZE = len(wire.encode(Msg.HELLO, 0, nonce=bytes(wire.NONCE_BYTES)))

#: Why a link is refused: the status and the text the peer is told.
Refusal = tuple[LLMStatusCode, str]

class Table(Protocol):
    """What a :class:`Listener` needs of its link table (``LinkTable``)."""

    links: dict[int, Link]
    own_dials: OwnDials
    #: This endpoint's instance (random, per init): sent in ``LINK_OK``.
    instance: bytes

    @property
    def shares_memory(self) -> bool: ...

    def refusal(self, remote_id: int, peer_id: int, bilateral: bool) -> Refusal | None:
        """Why an authenticated link from ``remote_id`` is refused at once, or None."""

    async def take(self, remote_id: int, remote_role: LLMRole, bilateral: bool, reader: ControlReader,
                   writer: asyncio.StreamWriter, pending: Pending, through: Callable[[], None],
                   instance: bytes) -> Link | Refusal:
        """The link made and registered for an accepted handshake (``instance``: the dialling endpoint's), or
        why not."""

    def attached(self, link: Link, index: int) -> None:
        """Data channel ``index`` of ``link`` was installed (its fd is open)."""

    def leaving_links(self) -> list[Link]:
        """The links being unlinked by us (out of ``links``, not closed yet)."""

    def share_candidates(self) -> list[tuple[bytes, Callable[[socket.socket], None]]]:
        """The links a same-host peer may attach its share to now."""


class Listener:
    """The listener of one link table (see the module docstring).

    :param cluster_id: this endpoint's cluster id.
    :param role: returns this endpoint's current role.
    :param table: the link table that takes the links.
    :param limit_s: how long an incoming connection may take to its link or data channel.
    """

    def __init__(self, runtime: Runtime, cluster_id: int, role: Callable[[], LLMRole], table: Table,
                 limit_s: float) -> None:
        self.runtime = runtime
        self.cluster_id = cluster_id
        self._role = role
        self._table = table
        self.limit_s = limit_s
        self.admission: Admission | None = None
        self.address: tuple[str, int] | None = None
        self.local_listener: LocalListener | None = None
        self._accepting: set[asyncio.Task] = set()  # accepted before the listener stopped
        self.taking = 0  # authenticated handshakes the table is taking (their links are being made)
        self._unauthenticated = RefusalLog()

    @property
    def secret(self) -> bytes | None:
        return self.runtime.settings.shared_secret

    @property
    def tls_server(self) -> ssl.SSLContext | None:
        return self.runtime.settings.tls_server_context

    @property
    def handshakes(self) -> set[asyncio.Task]:
        """The tasks of incoming connections not through their handshake yet."""
        tasks = {t for t in self._accepting if not t.done()}
        return tasks if self.admission is None else tasks | self.admission.tasks()

    async def listen(self, ip: str, port: int) -> None:
        if self.admission is not None:  # a second listener would replace the first, never closed then
            raise LLMException(f"already listening on {self.admission.address[0]}:{self.admission.address[1]}",
                               status_code=LLMStatusCode.LLM_FAILED)
        if self.runtime.settings.tls and self.tls_server is None:
            raise param_invalid("aio.TlsServerContext", "is needed to listen: this endpoint uses TLS "
                                "(aio.TlsClientContext is set) and never accepts a link without it")
        if self.tls_server is not None and tls.missing_certificate(self.tls_server):
            raise param_invalid("aio.TlsServerContext", "it has no certificate (load_cert_chain), so no peer could "
                                "complete a TLS handshake with this endpoint")
        try:
            sock = socket.create_server((ip, port), backlog=LISTEN_BACKLOG)
        except OSError as exc:
            raise LLMException(f"option 'llm.listenIpInfo': cannot listen on {ip}:{port}: {exc}",
                               status_code=LLMStatusCode.LLM_LINK_FAILED) from exc
        sock.setblocking(False)
        sockname = sock.getsockname()
        self.admission = Admission(sock, self.runtime.settings.max_pending_handshakes, self._accept)
        self.address = (sockname[0], sockname[1])
        if self._table.shares_memory and self.local_listener is None:
            try:
                self.local_listener = LocalListener(self.secret, self._table.share_candidates)
            except OSError as exc:
                log.info("no same-host sharing (unix socket: %s); links use TCP only", exc)

    async def stop(self) -> None:
        if self.local_listener is not None:
            self.local_listener.close()
            self.local_listener = None
        if self.admission is not None:
            admission, self.admission, self.address = self.admission, None, None
            # connections accepted already finish their handshakes (or time out) as before
            self._accepting = {t for t in self._accepting if not t.done()} | admission.tasks()
            await admission.close()

    @staticmethod
    def _first_size(head: bytes) -> int:
        if head == tls.MAGIC:
            return tls.PREAMBLE_SIZE
        if head == wire.ATTACH_MAGIC:
            return wire.ATTACH.size
        return _HELLO_SIZE

    async def _accept(self, admission: Admission, conn: socket.socket, pending: Pending) -> None:
        """One accepted connection: its first message, a handshake slot, then the handshake (``admission``, which
        ``stop`` may have let go of before this task first ran: the connection still goes through it)."""
        writer: asyncio.StreamWriter | None = None
        keep = False
        try:
            async with asyncio.timeout(self.limit_s):
                head = await admission.first_message(conn, self._first_size)
                await admission.slot(pending)
                stream, writer = await streams(conn, head)
                reader = _Watched(stream, pending)
                magic = await reader.readexactly(4)
                if self.tls_server is not None:
                    if magic != tls.MAGIC:
                        raise ProtocolError("the peer does not use TLS; this endpoint requires it")
                    kind = await reader.readexactly(1)
                    if kind == tls.DATA:
                        keep = await self._accept_tls_data(stream, writer, admission, pending)
                        return
                    if kind != tls.CONTROL:
                        raise ProtocolError(f"unknown TLS connection kind {kind!r}")
                    await tls.accept_control(stream, writer, self.tls_server, self.limit_s)
                    pending.progress()
                    keep = await self._accept_control(await reader.readexactly(4), reader, writer, admission,
                                                      pending)
                elif magic == tls.MAGIC:
                    raise ProtocolError("the peer uses TLS; this endpoint has no aio.TlsServerContext")
                elif magic == wire.ATTACH_MAGIC:
                    keep = await self._accept_data(magic, reader, writer, admission, pending)
                else:
                    keep = await self._accept_control(magic, reader, writer, admission, pending)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ProtocolError, TimeoutError) as exc:
            log.debug("dropped an incoming connection: %r", exc)
        finally:
            admission.leave(pending)
            if writer is None:
                conn.close()
            elif not keep:
                if writer.get_extra_info("ssl_object") is not None:
                    writer.transport.abort()  # no TLS close_notify exchange with a refused peer
                else:
                    writer.close()

    async def _accept_control(self, magic: bytes, reader: _Watched, writer: asyncio.StreamWriter,
                              admission: Admission, pending: Pending) -> bool:
        accepted = await handshake.accept(magic, reader, writer, secret=self.secret,
                                          own=self._table.own_dials.came_back)
        auth = accepted.auth

        async def refuse(status: LLMStatusCode, text: str) -> bool:
            writer.write(handshake.link_ok(self.secret, accepted, status, text=text))
            await writer.drain()
            return False

        if not accepted.authenticated:
            self._unauthenticated.note("refused a link from %s: authentication failed",
                                       writer.get_extra_info("peername"))
            return await refuse(LLMStatusCode.LLM_LINK_FAILED, "authentication failed")
        try:
            remote_role = LLMRole(auth.role)
        except ValueError:
            raise ProtocolError("bad role") from None
        bilateral = bool(auth.bilateral)
        if self.admission is None or self.address != admission.address:
            # Stopped listening, or listening elsewhere now (switch_role): the link's data channels would find
            # no listener where they dial. A switch that failed and listens where it did keeps the link.
            return await refuse(LLMStatusCode.LLM_LINK_FAILED, "this endpoint stopped listening")
        refused = self._table.refusal(auth.cluster_id, auth.peer_id, bilateral)
        if refused is not None:
            return await refuse(*refused)
        self.taking += 1
        try:
            taken = await self._table.take(auth.cluster_id, remote_role, bilateral, reader.inner, writer, pending,
                                           lambda: admission.leave(pending), auth.instance)
        finally:
            self.taking -= 1
        if not isinstance(taken, Link):
            return await refuse(*taken)
        local_name = self.local_listener.name if self.local_listener is not None else b""
        writer.write(handshake.link_ok(self.secret, accepted, SUCCESS, cluster_id=self.cluster_id,
                                       role=self._role(), token=taken.token, channels=taken.nchannels,
                                       boot=boot_id(), local_name=local_name, instance=self._table.instance))
        taken.start()  # only now: what the peer sent behind its AUTH is answered after LINK_OK
        return True

    def _attach_target(self, record: bytes) -> tuple[Link | None, int, int]:
        """The link and channel a data connection's attach record names, if it may attach there."""
        magic, version, token, index, generation = wire.ATTACH.unpack(record)
        if magic != wire.ATTACH_MAGIC or version != wire.VERSION:
            return None, index, generation
        # Only links this end accepted: the dialler never takes a data connection (it dials its own), so a record
        # it sent, reflected back to its listener, must not attach there.
        link = next((lk for lk in self._table.links.values() if not lk.down and not lk.is_client and
                     hmac.compare_digest(handshake.attach_token(self.secret, lk.token, index, generation), token)),
                    None)
        if link is None or not link.attach_advances(index, generation):
            return None, index, generation
        return link, index, generation

    def _refusal(self, record: bytes) -> LLMStatusCode:
        """The status an attach record that names no link of the table is refused with: a link we are unlinking
        (out of the table, its UNLINK leaving or left) is refused as such, so the peer's redial ends without
        failing the link, whose UNLINK follows (row 324)."""
        _, _, token, index, generation = wire.ATTACH.unpack(record)
        leaving = any(hmac.compare_digest(handshake.attach_token(self.secret, lk.token, index, generation), token)
                      for lk in self._table.leaving_links() if not lk.is_client)
        return LLMStatusCode.LLM_NOT_YET_LINK if leaving else LLMStatusCode.LLM_LINK_FAILED

    async def _accept_data(self, magic: bytes, reader: _Watched, writer: asyncio.StreamWriter,
                           admission: Admission, pending: Pending) -> bool:
        record = magic + await reader.readexactly(wire.ATTACH.size - 4)
        link, index, generation = self._attach_target(record)
        if link is None:
            writer.write(wire.ATTACH_OK.pack(wire.ATTACH_MAGIC, self._refusal(record)))
            await writer.drain()
            return False
        admission.leave(pending)
        sock = socket.socket(fileno=os.dup(writer.get_extra_info("socket").fileno()))
        sock.setblocking(False)
        tune(sock)
        # Installed before it is acknowledged: a peer that has the acknowledgement may use the channel.
        link.install(index, sock, generation)
        self._table.attached(link, index)
        writer.write(wire.ATTACH_OK.pack(wire.ATTACH_MAGIC, SUCCESS))
        await writer.drain()
        writer.transport.abort()
        return True

    async def _accept_tls_data(self, stream: asyncio.StreamReader, writer: asyncio.StreamWriter, admission: Admission,
                               pending: Pending) -> bool:
        assert self.tls_server is not None
        tune(writer.get_extra_info("socket"))
        channel = await tls.accept_data(stream, writer, self.tls_server, self.limit_s)
        try:
            pending.progress()
            record = await channel.recv_exactly(wire.ATTACH.size)
            link, index, generation = self._attach_target(record)
            pending.progress()
            if link is None:
                await channel.sendall(wire.ATTACH_OK.pack(wire.ATTACH_MAGIC, self._refusal(record)))
                channel.close()
                return True
            admission.leave(pending)
            link.install(index, channel, generation)
            self._table.attached(link, index)
            await channel.sendall(wire.ATTACH_OK.pack(wire.ATTACH_MAGIC, SUCCESS))
            return True
        except BaseException:
            channel.close()
            raise


class _Watched:
    """A handshake's reader that counts every complete read as progress (``admission``)."""

    def __init__(self, inner: ControlReader, pending: Pending) -> None:
        self.inner = inner
        self._pending = pending

    async def readexactly(self, n: int) -> bytes:
        data = await self.inner.readexactly(n)
        self._pending.progress()
        return data
