"""Links between LLMDataDist endpoints: handshake, control messages, data channels.

A link is one control connection (asyncio streams, framed messages) plus
``2 * aio.DataChannels`` data connections that carry bulk bytes only. The
client (the side that called ``link_clusters``) dials all of them. Data
channels ``[0, N)`` carry requests the client makes, ``[N, 2N)`` requests the
server makes, so the two ends never contend for a channel. The bytes on a data
channel are moved by the core's :class:`~aio_datadist._core.SocketEngine`
straight from and into cache memory. A transfer that stops part-way leaves its
channel's byte stream out of step, so that channel is closed on both ends and
the client dials it again.

The handshake (``handshake.py``) sends nothing identifying before the peer
proved the shared secret. With TLS (``aio.TlsServerContext`` /
``aio.TlsClientContext``) every connection of a link is TLS from its first
byte after a short preamble (``transport/tls.py``), and data channels are
:class:`~aio_datadist.transport.tls.TlsChannel` objects instead of sockets.
At most ``aio.MaxPendingHandshakes`` incoming connections may be in their
handshake at once; more are dropped on arrival.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import socket
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aio_datadist import handshake, wire
from aio_datadist.status import LLMException, LLMStatusCode, param_invalid
from aio_datadist.transfers import handle_request
from aio_datadist.transport import tls
from aio_datadist.transport.local import LocalListener, LocalShare, boot_id, connect_share
from aio_datadist.transport.nixl import READY as NIXL_READY
from aio_datadist.transport.nixl import NixlPeer, NixlPlane
from aio_datadist.types import LLMClusterInfo, LLMRole
from aio_datadist.wire import Msg, ProtocolError

if TYPE_CHECKING:
    from aio_datadist.datadist import LLMDataDist
    from aio_datadist.runtime import Runtime

__all__ = ["Link", "LinkTable"]

log = logging.getLogger("aio_datadist.links")

HANDSHAKE_LIMIT_S = 10.0
HEARTBEAT_MISSES = 5
ZERO32 = bytes(32)
NO_GENERATION = 0xFFFFFFFF
SUCCESS = LLMStatusCode.LLM_SUCCESS


def layout_hash(runtime: Runtime) -> bytes:
    """Hash of the per-block layouts of this endpoint's blocks caches.

    Peers serving the same model register blocks caches of the same tensor
    count, dtype and block shape; a mismatch fails the link early.
    """
    shapes = sorted({(c.cache_desc.num_tensors, c.cache_desc.data_type.value, c.cache_desc.shape[1:])
                     for c in runtime.registry.caches() if c.is_blocks_cache})
    if not shapes:
        return ZERO32
    return hashlib.sha256(repr(shapes).encode()).digest()


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


#: A data channel's connection: a socket the native engine drives, or a TLS channel.
DataConn = socket.socket | tls.TlsChannel


class _Channel:
    __slots__ = ("index", "sock", "generation", "attached")

    def __init__(self, index: int) -> None:
        self.index = index
        self.sock: DataConn | None = None
        self.generation = 0
        self.attached = False


class Link:
    """One established link to a peer endpoint."""

    def __init__(self, table: LinkTable, remote_cluster_id: int, remote_role: LLMRole,
                 reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, is_client: bool,
                 channels: int, token: bytes, remote_address: tuple[str, int]) -> None:
        self.table = table
        self.runtime = table.runtime
        self.remote_cluster_id = remote_cluster_id
        self.remote_role = remote_role
        self.reader = reader
        self.writer = writer
        self.is_client = is_client
        self.token = token
        self.remote_address = remote_address
        self.nchannels = channels
        self.channels = [_Channel(i) for i in range(2 * channels)]
        self.own = range(0, channels) if is_client else range(channels, 2 * channels)
        self.free: asyncio.Queue[int] = asyncio.Queue()
        self.pending: dict[int, asyncio.Future] = {}
        self.serving: dict[int, Callable[[], Any]] = {}
        self.pull_acks: dict[int, tuple[Callable[[], None], Callable[[], None]]] = {}
        self.broken: LLMException | None = None
        self.closed = False
        self._next_req = 1 if is_client else 2
        self._reader_task: asyncio.Task | None = None
        self.last_heard = 0.0
        self._tasks: set[asyncio.Task] = set()
        self.on_request: Callable[[Link, Msg, int, dict], None] | None = None
        self.local: LocalShare | None = None
        self.nixl: NixlPeer | None = None
        self.redialling: dict[int, asyncio.Future] = {}

    # -- ids, channels -----------------------------------------------------

    def new_req_id(self) -> int:
        rid = self._next_req
        self._next_req += 2
        return rid

    def is_mine(self, req_id: int) -> bool:
        return (req_id % 2 == 1) == self.is_client

    def peer_channel_ok(self, index: int) -> bool:
        return index < 2 * self.nchannels and index not in self.own and self.channels[index].sock is not None

    def install(self, index: int, sock: DataConn, generation: int) -> None:
        ch = self.channels[index]
        self._drop_socket(ch)
        ch.sock = sock
        ch.generation = generation
        ch.attached = True
        if index in self.own:
            self.free.put_nowait(index)

    def _drop_socket(self, ch: _Channel) -> None:
        if ch.sock is not None:
            if isinstance(ch.sock, socket.socket):
                self.runtime.sockets.detach(ch.sock.fileno())
            ch.sock.close()
            ch.sock = None

    async def acquire(self) -> int:
        """A free channel of ours; waits while all are busy or being redialled."""
        while True:
            self.check()
            index = await self.free.get()
            if index < 0:  # the link went down: pass the news on to the next waiter
                self.free.put_nowait(index)
                self.check()
                raise LLMException(f"link to cluster {self.remote_cluster_id} is down",
                                   status_code=LLMStatusCode.LLM_LINK_FAILED)
            if self.channels[index].sock is not None:
                return index

    def attach_advances(self, index: int, generation: int) -> bool:
        """Whether a data connection for ``index`` at ``generation`` is new: a channel is attached once per
        generation and generations only grow (the client redials a reset channel at the next one)."""
        if index >= 2 * self.nchannels:
            return False
        ch = self.channels[index]
        return generation > ch.generation or (generation == ch.generation and not ch.attached)

    def release(self, index: int) -> None:
        if self.channels[index].sock is not None and not self.closed:
            self.free.put_nowait(index)

    def reset_channel(self, index: int, tell_peer: bool, req_id: int = 0) -> None:
        """Close a channel whose byte stream is out of step; the client redials it.

        With ``tell_peer`` the peer also stops serving ``req_id``, even when
        the channel was already reset (then only the request is named).
        """
        ch = self.channels[index]
        if self.closed:
            return
        if ch.sock is None:
            if tell_peer and req_id:
                self.send(Msg.ABORT, req_id, channel=index, generation=NO_GENERATION)
            return  # already reset; its redial is under way
        generation = ch.generation
        self._drop_socket(ch)
        if tell_peer:
            self.send(Msg.ABORT, req_id, channel=index, generation=generation)
        if self.is_client:
            done = asyncio.get_running_loop().create_future()
            self.redialling[index] = done
            self.spawn(self._redial(index, generation + 1, done))

    async def _redial(self, index: int, generation: int, done: asyncio.Future) -> None:
        try:
            try:
                sock = await self.table.dial_data(self.remote_address, self.token, index, generation)
            except (OSError, LLMException, asyncio.TimeoutError) as exc:
                self.fail(LLMException(f"could not redial data channel {index}: {exc}",
                                       status_code=LLMStatusCode.LLM_LINK_FAILED))
                return
            if self.closed:
                sock.close()
                return
            self.install(index, sock, generation)
        finally:
            if self.redialling.get(index) is done:
                del self.redialling[index]
            done.set_result(None)

    async def _request_after_redial(self, redial: asyncio.Future, msg: Msg, req_id: int, fields: dict) -> None:
        """Serve a request on a channel we are still redialling once it is back.

        The peer may use its channel as soon as it accepted our redial, and its
        request can overtake the acknowledgement our redial is waiting for.
        """
        await redial
        if self.on_request is not None and not self.closed and self.broken is None:
            self.on_request(self, msg, req_id, fields)

    def move(self, index: int, pairs: Any, *, send: bool, timeout_ms: int | None, what: str,
             keepalive: Any) -> asyncio.Future:
        """Start sending from (or receiving into) the ``[addr, nbytes, ...]`` runs ``pairs`` on data
        channel ``index``: the future of the bytes moved. Cancelling it stops the job; the channel is
        then out of step and must be reset. Plain channels run on the native SocketEngine, TLS ones
        on their :class:`~aio_datadist.transport.tls.TlsChannel`."""
        conn = self.channels[index].sock
        if conn is None:
            raise LLMException(f"data channel {index} to cluster {self.remote_cluster_id} is down",
                               status_code=LLMStatusCode.LLM_LINK_FAILED)
        if isinstance(conn, tls.TlsChannel):
            return conn.start(pairs, send=send, timeout_ms=timeout_ms, what=what, keepalive=keepalive)
        fd = conn.fileno()
        engine = self.runtime.sockets
        submit = engine.submit_send if send else engine.submit_recv
        return self.runtime.completions.start(lambda t: submit(t, fd, pairs), engine.cancel, timeout_ms=timeout_ms,
                                              what=what, keepalive=keepalive)

    # -- messages ----------------------------------------------------------

    def check(self) -> None:
        if self.broken is not None:
            raise LLMException(f"link to cluster {self.remote_cluster_id} is broken: {self.broken}",
                               status_code=LLMStatusCode.LLM_LINK_FAILED)
        if self.closed:
            raise LLMException(f"link to cluster {self.remote_cluster_id} was unlinked",
                               status_code=LLMStatusCode.LLM_NOT_YET_LINK)

    def send(self, msg: Msg, req_id: int, **fields: Any) -> None:
        if self.closed or self.writer.is_closing():
            return
        self.writer.write(wire.encode(msg, req_id, **fields))

    def expect(self, req_id: int) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.pending[req_id] = fut
        return fut

    def spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def start(self) -> None:
        self.last_heard = asyncio.get_running_loop().time()
        self._reader_task = self.spawn(self._read_loop())
        self.spawn(self._heartbeat(self.runtime.settings.heartbeat_interval_ms / 1000))

    async def _heartbeat(self, interval: float) -> None:
        """PROBE every interval; a peer silent for HEARTBEAT_MISSES intervals is lost.

        This catches peers that stopped (SIGSTOP, a hung host, a cut cable)
        without closing their sockets, which no read would ever notice. A
        PROBE is answered, so a live peer is heard from every interval of
        ours whatever its own heartbeat interval is (a plain PING was not
        answered: a peer configured with a longer interval was dropped).
        """
        loop = asyncio.get_running_loop()
        while self.broken is None and not self.closed:
            await asyncio.sleep(interval)
            silent = loop.time() - self.last_heard
            if silent > HEARTBEAT_MISSES * interval:
                self.fail(LLMException(f"no heartbeat for {silent:.1f} s", status_code=LLMStatusCode.LLM_LINK_FAILED))
                return
            self.send(Msg.PROBE, 0)

    async def _read_loop(self) -> None:
        try:
            while True:
                header = await self.reader.readexactly(wire.HEADER.size)
                msg, req_id, length = wire.parse_header(header)
                body = await self.reader.readexactly(length) if length else b""
                fields = wire.decode_body(msg, body)
                self.last_heard = asyncio.get_running_loop().time()
                self._dispatch(msg, req_id, fields)
        except asyncio.CancelledError:
            raise
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            self.fail(LLMException(f"connection lost ({type(exc).__name__})",
                                   status_code=LLMStatusCode.LLM_LINK_FAILED))
        except ProtocolError as exc:
            log.warning("link to cluster %s: protocol error: %s", self.remote_cluster_id, exc)
            self.fail(LLMException(f"protocol error: {exc}", status_code=LLMStatusCode.LLM_LINK_FAILED))

    def _dispatch(self, msg: Msg, req_id: int, fields: dict) -> None:
        if msg in (Msg.PROBE, Msg.PING):
            if msg is Msg.PROBE:
                self.send(Msg.PROBE_ACK, req_id)
            return
        if msg is Msg.UNLINK:
            self.send(Msg.UNLINK_ACK, req_id)
            self.table.forget(self)
            self.spawn(self.close())
            return
        if msg is Msg.ABORT:
            if req_id and not self.is_mine(req_id):
                serving = self.serving.pop(req_id, None)
                if serving is not None:
                    serving()
                ack = self.pull_acks.pop(req_id, None)  # sent everything, but the puller gave up
                if ack is not None:
                    ack[1]()
            index = fields["channel"]
            if index < len(self.channels) and self.channels[index].generation == fields["generation"]:
                self.reset_channel(index, tell_peer=False)
            return
        if self.is_mine(req_id) and msg in (Msg.RESP, Msg.DONE, Msg.PROBE_ACK, Msg.UNLINK_ACK):
            fut = self.pending.pop(req_id, None)
            if fut is not None and not fut.done():
                fut.set_result(fields)
            return
        if msg is Msg.NIXL:
            self._nixl_record(fields)
            return
        if msg in (Msg.PULL_REQ, Msg.PUSH_REQ) and fields["channel"] in self.redialling:
            self.spawn(self._request_after_redial(self.redialling[fields["channel"]], msg, req_id, fields))
            return
        if self.on_request is not None:
            self.on_request(self, msg, req_id, fields)

    def fail(self, exc: LLMException) -> None:
        """Mark the link broken: every waiter fails now, later calls fail fast."""
        if self.broken is not None or self.closed:
            return
        self.broken = exc
        log.info("link to cluster %s failed: %s", self.remote_cluster_id, exc)
        self._teardown(exc)

    def attach_local(self, sock: Any) -> None:
        """Start sharing caches with a same-host peer over ``sock``."""
        self.local = LocalShare(sock, self.runtime, self._local_lost)
        if self.runtime.settings.remote_cache_accessible:  # else peers may not touch our caches at all
            for cache in self.runtime.registry.caches():
                self.local.offer(cache)

    def start_nixl(self) -> NixlPeer | None:
        """Begin the NIXL exchange with the peer (the client does, once linked)."""
        plane = self.table.nixl
        if plane is None or self.nixl is not None:
            return self.nixl
        self.nixl = NixlPeer(plane, self._send_nixl, self.remote_cluster_id)
        self.nixl.hello()
        return self.nixl

    def _send_nixl(self, kind: int, cache_id: int, count: int, row_bytes: int, rows: tuple, blob: bytes) -> None:
        self.send(Msg.NIXL, 0, kind=kind, cache_id=cache_id, count=count, row_bytes=row_bytes, rows=rows, blob=blob)

    def _nixl_record(self, fields: dict) -> None:
        if self.nixl is None:
            if self.table.nixl is None:
                if fields["kind"] != NIXL_READY:
                    self._send_nixl(NIXL_READY, 0, 0, 0, (), b"")  # we do not speak NIXL: TCP it is
                return
            self.start_nixl()
        assert self.nixl is not None
        self.nixl.on_message(fields)

    def _local_lost(self) -> None:
        log.info("link to cluster %s: same-host sharing stopped; using TCP", self.remote_cluster_id)
        self.local = None

    def _teardown(self, exc: LLMException) -> None:
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                # One exception per waiter: raising a shared one would chain every waiter's frames
                # (and the caches they hold) onto self.broken for as long as the broken link lives.
                fut.set_exception(LLMException(str(exc), status_code=exc.status_code))
                fut.exception()  # a waiter that gave up already must not leave "never retrieved" noise
        serving, self.serving = self.serving, {}
        for cancel in serving.values():
            cancel()
        acks, self.pull_acks = self.pull_acks, {}
        for _, on_fail in acks.values():
            on_fail()
        for ch in self.channels:
            self._drop_socket(ch)
        if self.local is not None:
            self.local.close()
            self.local = None
        if self.nixl is not None:
            self.nixl.close()
            self.nixl = None
        self.writer.close()
        self.free.put_nowait(-1)

    async def close(self) -> None:
        if self.closed:
            return
        if self.broken is None:
            self._teardown(LLMException(f"link to cluster {self.remote_cluster_id} was unlinked",
                                        status_code=LLMStatusCode.LLM_NOT_YET_LINK))
        self.closed = True
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)  # unlike gather, never raises a CancelledError of theirs
        try:
            async with asyncio.timeout(1.0):
                await self.writer.wait_closed()
        except (OSError, TimeoutError, ConnectionError):
            self.writer.transport.abort()  # a TLS close waits for the peer's close_notify: not past here


class LinkTable:
    """The links and the listener of one LLMDataDist."""

    def __init__(self, owner: LLMDataDist, runtime: Runtime) -> None:
        self.owner = owner
        self.runtime = runtime
        self.links: dict[int, Link] = {}
        self.server: asyncio.base_events.Server | None = None
        self.listen_address: tuple[str, int] | None = None
        self._handshakes: set[asyncio.Task] = set()
        self.on_request: Callable[[Link, Msg, int, dict], None] = (
            lambda link, msg, req_id, fields: handle_request(runtime, link, msg, req_id, fields))
        self.local_listener: LocalListener | None = None
        self.nixl = NixlPlane(runtime, owner.cluster_id) if runtime.settings.transport == "nixl" else None
        runtime.registry.on_add = self._shared
        runtime.registry.on_free = self._unshared

    @property
    def shares_memory(self) -> bool:
        """Whether same-host links may share cache memory (``aio.Transport`` auto or local)."""
        return self.runtime.settings.transport in ("auto", "local")

    def _shared(self, cache: Any) -> None:
        if self.nixl is not None:
            self.nixl.register(cache)
        if not self.runtime.settings.remote_cache_accessible:
            return
        for link in self.links.values():
            if link.local is not None:
                link.local.offer(cache)

    def _unshared(self, cache: Any) -> None:
        if self.nixl is not None:
            self.nixl.unregister(cache)
        for link in self.links.values():
            if link.local is not None:
                link.local.withdraw(cache.cache_id)

    @property
    def secret(self) -> bytes | None:
        return self.runtime.settings.shared_secret

    @property
    def tls_server(self) -> ssl.SSLContext | None:
        return self.runtime.settings.tls_server_context

    @property
    def tls_client(self) -> ssl.SSLContext | None:
        return self.runtime.settings.tls_client_context

    def check_can_dial(self) -> None:
        """With TLS on, dialling needs the client context: a link is never made without TLS."""
        if self.runtime.settings.tls and self.tls_client is None:
            raise param_invalid("aio.TlsClientContext", "is needed to link to peers: this endpoint uses TLS "
                                "(aio.TlsServerContext is set) and never links without it")

    def count(self) -> int:
        return sum(1 for link in self.links.values() if not link.closed)

    def get(self, cluster_id: int) -> Link:
        """The usable link to ``cluster_id`` or the documented error."""
        link = self.links.get(cluster_id)
        if link is None or link.closed:
            raise LLMException(f"cluster {cluster_id} is not linked", status_code=LLMStatusCode.LLM_NOT_YET_LINK)
        link.check()
        return link

    def forget(self, link: Link) -> None:
        if self.links.get(link.remote_cluster_id) is link:
            del self.links[link.remote_cluster_id]

    def _register(self, link: Link) -> None:
        link.on_request = self.on_request
        self.links[link.remote_cluster_id] = link
        link.start()

    # -- listening ---------------------------------------------------------

    async def listen(self, ip: str, port: int) -> None:
        if self.runtime.settings.tls and self.tls_server is None:
            raise param_invalid("aio.TlsServerContext", "is needed to listen: this endpoint uses TLS "
                                "(aio.TlsClientContext is set) and never accepts a link without it")
        try:
            self.server = await asyncio.start_server(self._accept, ip, port, reuse_address=True)
        except OSError as exc:
            raise LLMException(f"option 'llm.listenIpInfo': cannot listen on {ip}:{port}: {exc}",
                               status_code=LLMStatusCode.LLM_LINK_FAILED) from exc
        sockname = self.server.sockets[0].getsockname()
        self.listen_address = (sockname[0], sockname[1])
        if self.shares_memory and self.local_listener is None:
            try:
                self.local_listener = LocalListener(self)
            except OSError as exc:
                log.info("no same-host sharing (unix socket: %s); links use TCP only", exc)

    async def stop_listening(self) -> None:
        if self.local_listener is not None:
            self.local_listener.close()
            self.local_listener = None
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None
            self.listen_address = None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._handshakes) >= self.runtime.settings.max_pending_handshakes:
            # Connections that never finish their handshake must not pile up: drop the excess at once.
            log.debug("dropped an incoming connection: %d handshakes already pending", len(self._handshakes))
            writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        self._handshakes.add(task)
        keep = False
        try:
            async with asyncio.timeout(HANDSHAKE_LIMIT_S):
                magic = await reader.readexactly(4)
                if self.tls_server is not None:
                    if magic != tls.MAGIC:
                        raise ProtocolError("the peer does not use TLS; this endpoint requires it")
                    kind = await reader.readexactly(1)
                    if kind == tls.DATA:
                        keep = await self._accept_tls_data(writer)
                        return
                    if kind != tls.CONTROL:
                        raise ProtocolError(f"unknown TLS connection kind {kind!r}")
                    await tls.accept_control(writer, self.tls_server, HANDSHAKE_LIMIT_S)
                    keep = await self._accept_control(await reader.readexactly(4), reader, writer)
                elif magic == tls.MAGIC:
                    raise ProtocolError("the peer uses TLS; this endpoint has no aio.TlsServerContext")
                elif magic == wire.ATTACH_MAGIC:
                    keep = await self._accept_data(magic, reader, writer)
                else:
                    keep = await self._accept_control(magic, reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ProtocolError, TimeoutError) as exc:
            log.debug("dropped an incoming connection: %r", exc)
        finally:
            self._handshakes.discard(task)
            if not keep:
                if writer.get_extra_info("ssl_object") is not None:
                    writer.transport.abort()  # no TLS close_notify exchange with a refused peer
                else:
                    writer.close()

    async def _accept_control(self, magic: bytes, reader: asyncio.StreamReader,
                              writer: asyncio.StreamWriter) -> bool:
        accepted = await handshake.accept(magic, reader, writer, secret=self.secret)
        auth = accepted.auth
        remote_id = auth["cluster_id"]

        async def refuse(status: LLMStatusCode, text: str) -> bool:
            writer.write(handshake.link_ok(self.secret, accepted, status, text=text))
            await writer.drain()
            return False

        if not accepted.authenticated:
            log.warning("refused a link from %s: authentication failed", writer.get_extra_info("peername"))
            return await refuse(LLMStatusCode.LLM_LINK_FAILED, "authentication failed")
        try:
            remote_role = LLMRole(auth["role"])
        except ValueError:
            raise ProtocolError("bad role") from None
        own_id = self.owner.cluster_id
        if auth["peer_id"] != own_id:
            return await refuse(LLMStatusCode.LLM_LINK_FAILED, f"this endpoint is cluster {own_id}, "
                                f"not {auth['peer_id']}")
        if remote_id == own_id:
            return await refuse(LLMStatusCode.LLM_LINK_FAILED, "peer uses this endpoint's own cluster id")
        mine, theirs = layout_hash(self.runtime), auth["layout_hash"]
        if mine != ZERO32 and theirs != ZERO32 and mine != theirs:
            text = ("blocks caches are incompatible (tensor count, dtype or block shape differ "
                    "between the two endpoints)")
            log.warning("refused a link from cluster %s: %s", remote_id, text)
            return await refuse(LLMStatusCode.LLM_LINK_FAILED, text)
        existing = self.links.get(remote_id)
        if existing is not None and existing.broken is None and not existing.closed:
            return await refuse(LLMStatusCode.LLM_ALREADY_LINK, f"cluster {remote_id} is already linked")
        token = os.urandom(32)
        channels = self.runtime.settings.data_channels
        if existing is not None:
            await existing.close()
            self.forget(existing)
            existing = self.links.get(remote_id)  # another handshake may have linked it meanwhile
            if existing is not None and existing.broken is None and not existing.closed:
                return await refuse(LLMStatusCode.LLM_ALREADY_LINK, f"cluster {remote_id} is already linked")
        _tune(writer.get_extra_info("socket"))
        peer = writer.get_extra_info("peername")
        link = Link(self, remote_id, remote_role, reader, writer, is_client=False, channels=channels,
                    token=token, remote_address=(peer[0], peer[1]))
        self._register(link)
        local_name = self.local_listener.name if self.local_listener is not None else b""
        writer.write(handshake.link_ok(self.secret, accepted, SUCCESS, cluster_id=own_id, role=self.owner.role,
                                       token=token, channels=channels, boot=boot_id(), local_name=local_name))
        return True

    def _attach_target(self, record: bytes) -> tuple[Link | None, int, int]:
        """The link and channel a data connection's attach record names, if it may attach there."""
        magic, version, token, index, generation = wire.ATTACH.unpack(record)
        if magic != wire.ATTACH_MAGIC or version != wire.VERSION:
            return None, index, generation
        link = next((lk for lk in self.links.values() if not lk.closed and lk.broken is None and
                     hmac.compare_digest(handshake.attach_token(self.secret, lk.token, index, generation), token)),
                    None)
        if link is None or not link.attach_advances(index, generation):
            return None, index, generation
        return link, index, generation

    async def _accept_data(self, magic: bytes, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> bool:
        link, index, generation = self._attach_target(magic + await reader.readexactly(wire.ATTACH.size - 4))
        if link is None:
            writer.write(wire.ATTACH_OK.pack(wire.ATTACH_MAGIC, LLMStatusCode.LLM_LINK_FAILED))
            await writer.drain()
            return False
        sock = socket.socket(fileno=os.dup(writer.get_extra_info("socket").fileno()))
        sock.setblocking(False)
        _tune(sock)
        # Installed before it is acknowledged: a peer that has the acknowledgement may use the channel.
        link.install(index, sock, generation)
        writer.write(wire.ATTACH_OK.pack(wire.ATTACH_MAGIC, SUCCESS))
        await writer.drain()
        writer.transport.abort()
        return True

    async def _accept_tls_data(self, writer: asyncio.StreamWriter) -> bool:
        assert self.tls_server is not None
        _tune(writer.get_extra_info("socket"))
        channel = await tls.accept_data(writer, self.tls_server, HANDSHAKE_LIMIT_S)
        try:
            link, index, generation = self._attach_target(await channel.recv_exactly(wire.ATTACH.size))
            if link is None:
                await channel.sendall(wire.ATTACH_OK.pack(wire.ATTACH_MAGIC, LLMStatusCode.LLM_LINK_FAILED))
                channel.close()
                return True
            link.install(index, channel, generation)
            await channel.sendall(wire.ATTACH_OK.pack(wire.ATTACH_MAGIC, SUCCESS))
            return True
        except BaseException:
            channel.close()
            raise

    # -- dialling ----------------------------------------------------------

    async def dial_data(self, address: tuple[str, int], token: bytes, index: int,
                        generation: int) -> DataConn:
        record = wire.ATTACH.pack(wire.ATTACH_MAGIC, wire.VERSION,
                                  handshake.attach_token(self.secret, token, index, generation), index, generation)
        if self.tls_client is not None:
            return await self._dial_tls_data(address, record, index)
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            _tune(sock)
            async with asyncio.timeout(HANDSHAKE_LIMIT_S):
                await loop.sock_connect(sock, address)
                await loop.sock_sendall(sock, record)
                reply = b""
                while len(reply) < wire.ATTACH_OK.size:
                    chunk = await loop.sock_recv(sock, wire.ATTACH_OK.size - len(reply))
                    if not chunk:
                        raise ConnectionError("peer closed the data connection")
                    reply += chunk
            _check_attached(reply, index)
            return sock
        except BaseException:
            sock.close()
            raise

    async def _dial_tls_data(self, address: tuple[str, int], record: bytes, index: int) -> tls.TlsChannel:
        assert self.tls_client is not None
        async with asyncio.timeout(HANDSHAKE_LIMIT_S):
            channel = await tls.dial_data(address, self.tls_client, HANDSHAKE_LIMIT_S, _tune)
            try:
                await channel.sendall(record)
                _check_attached(await channel.recv_exactly(wire.ATTACH_OK.size), index)
                return channel
            except BaseException:
                channel.close()
                raise

    async def connect(self, cluster: LLMClusterInfo, timeout_ms: int) -> LLMStatusCode:
        """Link to one listening peer; returns a status, never raises for link failures."""
        remote_id = cluster.remote_cluster_id
        address = cluster.remote_endpoints[0]
        existing = self.links.get(remote_id)
        if existing is not None and existing.broken is None and not existing.closed:
            return LLMStatusCode.LLM_ALREADY_LINK
        if remote_id == self.owner.cluster_id:
            log.warning("link_clusters: cluster %s is this endpoint itself", remote_id)
            return LLMStatusCode.LLM_LINK_FAILED
        writer = None
        try:
            async with asyncio.timeout(timeout_ms / 1000):
                return await self._handshake(remote_id, address, existing)
        except TimeoutError:
            log.warning("link to cluster %s at %s:%s timed out after %s ms", remote_id, *address, timeout_ms)
            return LLMStatusCode.LLM_TIMEOUT
        except (OSError, ConnectionError, asyncio.IncompleteReadError, ProtocolError) as exc:
            log.warning("link to cluster %s at %s:%s failed: %s", remote_id, *address, exc)
            return LLMStatusCode.LLM_LINK_FAILED
        except LLMException as exc:
            log.warning("link to cluster %s at %s:%s failed: %s", remote_id, *address, exc)
            return exc.status_code
        finally:
            if writer is not None:
                writer.close()

    async def _handshake(self, remote_id: int, address: tuple[str, int], existing: Link | None) -> LLMStatusCode:
        reader, writer = await asyncio.open_connection(*address)
        link: Link | None = None
        sockets: list[DataConn] = []
        try:
            _tune(writer.get_extra_info("socket"))
            if self.tls_client is not None:
                await tls.dial_control(reader, writer, self.tls_client, address[0], HANDSHAKE_LIMIT_S)
            ok = await handshake.dial(reader, writer, secret=self.secret, cluster_id=self.owner.cluster_id,
                                      role=self.owner.role, peer_id=remote_id, layout=layout_hash(self.runtime))
            channels = ok["channels"]
            for index in range(2 * channels):
                sockets.append(await self.dial_data(address, ok["link_token"], index, 0))
            if existing is not None:
                await existing.close()
                self.forget(existing)
            link = Link(self, remote_id, ok["role"], reader, writer, is_client=True,
                        channels=channels, token=ok["link_token"], remote_address=address)
            for index, sock in enumerate(sockets):
                link.install(index, sock, 0)
            self._register(link)
            await self._share_with(link, ok)
            await self._nixl_with(link)
            return SUCCESS
        except BaseException:
            if link is None:
                for sock in sockets:
                    sock.close()
                if writer.get_extra_info("ssl_object") is not None:
                    writer.transport.abort()
                else:
                    writer.close()
            raise

    async def _share_with(self, link: Link, ok: dict) -> None:
        """Attach the same-host share channel when the peer runs on this kernel."""
        name = ok["local_name"][:1] + ok["local_name"][1:].rstrip(b"\0")
        if not self.shares_memory or not name.startswith(b"\0") or ok["boot_id"] != boot_id():
            return
        try:
            sock = await connect_share(name, link.token)
        except OSError as exc:
            log.info("link to cluster %s: same-host sharing unavailable (%s); using TCP", link.remote_cluster_id, exc)
            return
        link.attach_local(sock)
        share = link.local
        # The peer's caches are mapped before link_clusters returns.
        await asyncio.wait([share.ready], timeout=HANDSHAKE_LIMIT_S)
        if not share.ready.done() or share.ready.cancelled():
            if link.local is share:
                share.close()
                link.local = None
            log.info("link to cluster %s: the peer did not finish sharing; using TCP", link.remote_cluster_id)

    async def _nixl_with(self, link: Link) -> None:
        """With ``aio.Transport=nixl``: exchange NIXL metadata and cache lists before returning."""
        peer = link.start_nixl()
        if peer is None:
            return
        await asyncio.wait([peer.ready], timeout=HANDSHAKE_LIMIT_S)
        if not peer.usable():
            log.info("link to cluster %s: the peer does not use NIXL; using TCP", link.remote_cluster_id)

    async def disconnect(self, remote_id: int, timeout_ms: int, force: bool) -> LLMStatusCode:
        link = self.links.get(remote_id)
        if link is None:
            return LLMStatusCode.LLM_NOT_YET_LINK
        self.forget(link)
        status = SUCCESS
        if not force and link.broken is None:
            req_id = link.new_req_id()
            fut = link.expect(req_id)
            link.send(Msg.UNLINK, req_id)
            try:
                async with asyncio.timeout(timeout_ms / 1000):
                    await fut
            except (TimeoutError, LLMException):
                status = LLMStatusCode.LLM_NOTIFY_PROMPT_UNLINK_FAILED
        await link.close()
        return status

    async def probe(self, remote_id: int, timeout_ms: int) -> None:
        link = self.get(remote_id)
        req_id = link.new_req_id()
        fut = link.expect(req_id)
        link.send(Msg.PROBE, req_id)
        try:
            async with asyncio.timeout(timeout_ms / 1000):
                await fut
        except TimeoutError:
            link.pending.pop(req_id, None)
            raise LLMException(f"link to cluster {remote_id}: no answer within {timeout_ms} ms",
                               status_code=LLMStatusCode.LLM_TIMEOUT) from None

    async def close(self) -> None:
        await self.stop_listening()
        for task in list(self._handshakes):
            task.cancel()
        links = list(self.links.values())
        self.links.clear()
        for link in links:
            if link.broken is None:
                link.send(Msg.UNLINK, link.new_req_id())
        await asyncio.gather(*(link.close() for link in links), return_exceptions=True)
        if self.nixl is not None:
            self.nixl.close()


def _check_attached(reply: bytes, index: int) -> None:
    magic, status = wire.ATTACH_OK.unpack(reply)
    if magic != wire.ATTACH_MAGIC or status != SUCCESS:
        raise LLMException(f"peer refused data channel {index}", status_code=LLMStatusCode.LLM_LINK_FAILED)
