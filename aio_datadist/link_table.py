"""The link table of one LLMDataDist: listening, accepting, dialling, unlinking.

:class:`LinkTable` owns the listener (TCP and, for same-host peers, the
abstract unix socket), runs the handshake of every incoming and outgoing
control connection (``handshake.py``; TLS first when configured), attaches
data channels, and keeps one :class:`~aio_datadist.links.Link` per remote
cluster. It also feeds newly registered caches to the same-host shares and
the NIXL plane of its links. Incoming connections are admitted at a pace
(``admission.py``): past ``aio.MaxPendingHandshakes`` they wait in the listen
backlog, and stalled ones make room. A link is made only when its fds fit
under ``RLIMIT_NOFILE`` (``fd_budget.py``). There is at most one link per
remote cluster id: a second attempt for an id waits for the first, and a
link that finds the id taken is closed, never left behind.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aio_datadist import fd_budget, handshake, wire
from aio_datadist._checks import param_invalid
from aio_datadist.admission import ARRIVAL_FACTOR, LISTEN_BACKLOG, Admission, Pending, streams
from aio_datadist.links import SUCCESS, ZERO32, DataConn, Link, layout_hash, tune
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.transport import tls
from aio_datadist.transport.local import SHARE_AUTH_S, LocalListener, boot_id, connect_share
from aio_datadist.transport.nixl import NixlPlane
from aio_datadist.types import LLMClusterInfo, LLMRole
from aio_datadist.wire import Msg, ProtocolError

if TYPE_CHECKING:
    from aio_datadist.runtime import Runtime

#: Serves one request a peer sent over a link (``transfers.handle_request``, injected from above).
RequestHandler = Callable[[Link, Msg, int, dict], None]

__all__ = ["LinkTable"]

log = logging.getLogger("aio_datadist.links")

HANDSHAKE_LIMIT_S = 10.0
#: How long finalize waits for peers to acknowledge UNLINK (so they have let the link go when it returns).
UNLINK_WAIT_S = 1.0
#: The size of a first message that is neither a TLS preamble nor an attach record: a HELLO.
_HELLO_SIZE = len(wire.encode(Msg.HELLO, 0, nonce=bytes(wire.NONCE_BYTES)))

class LinkTable:
    """The links and the listener of one LLMDataDist.

    :param cluster_id: this endpoint's cluster id.
    :param role: returns this endpoint's current role (it changes with ``switch_role``).
    :param on_request: serves the requests peers send over every link.
    """

    def __init__(self, runtime: Runtime, cluster_id: int, role: Callable[[], LLMRole],
                 on_request: RequestHandler) -> None:
        self.cluster_id = cluster_id
        self._role = role
        self.runtime = runtime
        self.links: dict[int, Link] = {}
        self.admission: Admission | None = None
        self.listen_address: tuple[str, int] | None = None
        self._accepting: set[asyncio.Task] = set()  # accepted before the listener stopped
        self._dialling: dict[int, asyncio.Task] = {}
        self.closing = False
        fd_budget.raise_soft_limit()
        self.on_request = on_request
        self.local_listener: LocalListener | None = None
        self.nixl = NixlPlane(runtime, cluster_id) if runtime.settings.transport == "nixl" else None
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

    def _new_link(self, remote_id: int, remote_role: LLMRole, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter, *, is_client: bool, channels: int, token: bytes,
                  remote_address: tuple[str, int]) -> Link:
        """A link that redials its data channels, forgets itself and finds the NIXL plane through this table."""
        return Link(self.runtime, remote_id, remote_role, reader, writer, is_client=is_client, channels=channels,
                    token=token, remote_address=remote_address,
                    redial=lambda *args: self.dial_data(*args),  # looked up per call: tests may wrap dial_data
                    forget=self.forget, nixl_plane=self.nixl)

    def _live(self, remote_id: int) -> Link | None:
        link = self.links.get(remote_id)
        return link if link is not None and link.broken is None and not link.closed else None

    def _register(self, link: Link) -> bool:
        """Make ``link`` the link to its cluster, unless another live one is (or the table closes)."""
        if self.closing or self._live(link.remote_cluster_id) is not None:
            return False
        link.on_request = self.on_request
        self.links[link.remote_cluster_id] = link
        link.start()
        return True

    @property
    def _handshakes(self) -> set[asyncio.Task]:
        """The tasks of incoming connections not through their handshake yet."""
        tasks = {t for t in self._accepting if not t.done()}
        return tasks if self.admission is None else tasks | self.admission.tasks()

    def _reserve(self) -> int:
        """fds kept free besides links (see ``fd_budget``)."""
        pending = ((1 + ARRIVAL_FACTOR) * self.runtime.settings.max_pending_handshakes
                   if self.admission is not None else 0)
        return fd_budget.RESERVE + pending

    def _claim(self) -> fd_budget.Claim:
        per_link = fd_budget.per_link(self.runtime.settings.data_channels, self.shares_memory)
        return fd_budget.claim(per_link, self._reserve())

    # -- listening ---------------------------------------------------------

    async def listen(self, ip: str, port: int) -> None:
        if self.runtime.settings.tls and self.tls_server is None:
            raise param_invalid("aio.TlsServerContext", "is needed to listen: this endpoint uses TLS "
                                "(aio.TlsClientContext is set) and never accepts a link without it")
        try:
            sock = socket.create_server((ip, port), backlog=LISTEN_BACKLOG)
        except OSError as exc:
            raise LLMException(f"option 'llm.listenIpInfo': cannot listen on {ip}:{port}: {exc}",
                               status_code=LLMStatusCode.LLM_LINK_FAILED) from exc
        sock.setblocking(False)
        sockname = sock.getsockname()
        self.admission = Admission(sock, self.runtime.settings.max_pending_handshakes, self._accept)
        self.listen_address = (sockname[0], sockname[1])
        if self.shares_memory and self.local_listener is None:
            try:
                self.local_listener = LocalListener(self.secret, self._share_candidates)
            except OSError as exc:
                log.info("no same-host sharing (unix socket: %s); links use TCP only", exc)

    async def stop_listening(self) -> None:
        if self.local_listener is not None:
            self.local_listener.close()
            self.local_listener = None
        if self.admission is not None:
            admission, self.admission = self.admission, None
            # connections accepted already finish their handshakes (or time out) as before
            self._accepting = {t for t in self._accepting if not t.done()} | admission.tasks()
            await admission.close()
            self.listen_address = None

    def _first_size(self, head: bytes) -> int:
        if head == tls.MAGIC:
            return tls.PREAMBLE_SIZE
        if head == wire.ATTACH_MAGIC:
            return wire.ATTACH.size
        return _HELLO_SIZE

    async def _accept(self, conn: socket.socket, pending: Pending) -> None:
        """One accepted connection: its first message, a handshake slot, then the handshake (``admission``)."""
        admission = self.admission
        assert admission is not None
        writer: asyncio.StreamWriter | None = None
        keep = False
        try:
            async with asyncio.timeout(HANDSHAKE_LIMIT_S):
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
                        keep = await self._accept_tls_data(writer, admission, pending)
                        return
                    if kind != tls.CONTROL:
                        raise ProtocolError(f"unknown TLS connection kind {kind!r}")
                    await tls.accept_control(writer, self.tls_server, HANDSHAKE_LIMIT_S)
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
        own_id = self.cluster_id
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
        if self.closing:
            return await refuse(LLMStatusCode.LLM_LINK_FAILED, "this endpoint is being finalized")
        if self._live(remote_id) is not None:
            return await refuse(LLMStatusCode.LLM_ALREADY_LINK, f"cluster {remote_id} is already linked")
        try:
            claim = self._claim()
        except LLMException as exc:
            log.warning("refused a link from cluster %s: %s", remote_id, exc)
            return await refuse(exc.status_code, str(exc))
        try:
            existing = self.links.get(remote_id)
            if existing is not None:
                with pending.working():
                    await existing.close()
                self.forget(existing)
                if self._live(remote_id) is not None:  # another handshake linked it meanwhile
                    return await refuse(LLMStatusCode.LLM_ALREADY_LINK, f"cluster {remote_id} is already linked")
            token = os.urandom(32)
            channels = self.runtime.settings.data_channels
            tune(writer.get_extra_info("socket"))
            peer = writer.get_extra_info("peername")
            admission.leave(pending)  # through: never dropped as stalled from here on
            link = self._new_link(remote_id, remote_role, reader.inner, writer, is_client=False,
                                  channels=channels, token=token, remote_address=(peer[0], peer[1]))
            if not self._register(link):
                return await refuse(LLMStatusCode.LLM_ALREADY_LINK, f"cluster {remote_id} is already linked")
        finally:
            claim.release()
        local_name = self.local_listener.name if self.local_listener is not None else b""
        writer.write(handshake.link_ok(self.secret, accepted, SUCCESS, cluster_id=own_id, role=self._role(),
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

    async def _accept_data(self, magic: bytes, reader: _Watched, writer: asyncio.StreamWriter,
                           admission: Admission, pending: Pending) -> bool:
        link, index, generation = self._attach_target(magic + await reader.readexactly(wire.ATTACH.size - 4))
        if link is None:
            writer.write(wire.ATTACH_OK.pack(wire.ATTACH_MAGIC, LLMStatusCode.LLM_LINK_FAILED))
            await writer.drain()
            return False
        admission.leave(pending)
        sock = socket.socket(fileno=os.dup(writer.get_extra_info("socket").fileno()))
        sock.setblocking(False)
        tune(sock)
        # Installed before it is acknowledged: a peer that has the acknowledgement may use the channel.
        link.install(index, sock, generation)
        writer.write(wire.ATTACH_OK.pack(wire.ATTACH_MAGIC, SUCCESS))
        await writer.drain()
        writer.transport.abort()
        return True

    async def _accept_tls_data(self, writer: asyncio.StreamWriter, admission: Admission, pending: Pending) -> bool:
        assert self.tls_server is not None
        tune(writer.get_extra_info("socket"))
        channel = await tls.accept_data(writer, self.tls_server, HANDSHAKE_LIMIT_S)
        try:
            pending.progress()
            link, index, generation = self._attach_target(await channel.recv_exactly(wire.ATTACH.size))
            pending.progress()
            if link is None:
                await channel.sendall(wire.ATTACH_OK.pack(wire.ATTACH_MAGIC, LLMStatusCode.LLM_LINK_FAILED))
                channel.close()
                return True
            admission.leave(pending)
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
            tune(sock)
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
            channel = await tls.dial_data(address, self.tls_client, HANDSHAKE_LIMIT_S, tune)
            try:
                await channel.sendall(record)
                _check_attached(await channel.recv_exactly(wire.ATTACH_OK.size), index)
                return channel
            except BaseException:
                channel.close()
                raise

    async def connect(self, cluster: LLMClusterInfo, timeout_ms: int) -> LLMStatusCode:
        """Link to one listening peer; returns a status, never raises for link failures.

        One attempt per remote cluster id at a time: a second waits for the
        first (within its own timeout) and then reports ``LLM_ALREADY_LINK``
        if that one linked, or tries itself if it did not.
        """
        remote_id = cluster.remote_cluster_id
        assert remote_id is not None  # the caller checked the clusters it was given
        address = cluster.remote_endpoints[0]
        if remote_id == self.cluster_id:
            log.warning("link_clusters: cluster %s is this endpoint itself", remote_id)
            return LLMStatusCode.LLM_LINK_FAILED
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_ms / 1000
        while True:
            if self._live(remote_id) is not None:
                return LLMStatusCode.LLM_ALREADY_LINK
            if self.closing:
                return LLMStatusCode.LLM_LINK_FAILED
            other = self._dialling.get(remote_id)
            if other is None:
                break
            await asyncio.wait([other], timeout=deadline - loop.time())
            if not other.done():
                log.warning("link to cluster %s at %s:%s timed out after %s ms (another call was linking it)",
                            remote_id, *address, timeout_ms)
                return LLMStatusCode.LLM_TIMEOUT
        try:
            claim = self._claim()
        except LLMException as exc:
            log.warning("link to cluster %s at %s:%s refused here: %s", remote_id, *address, exc)
            return exc.status_code
        task = loop.create_task(self._handshake(remote_id, address, self.links.get(remote_id), deadline))
        self._dialling[remote_id] = task
        try:
            async with asyncio.timeout_at(deadline):
                return await task
        except TimeoutError:
            log.warning("link to cluster %s at %s:%s timed out after %s ms", remote_id, *address, timeout_ms)
            return LLMStatusCode.LLM_TIMEOUT
        except (OSError, ConnectionError, asyncio.IncompleteReadError, ProtocolError) as exc:
            log.warning("link to cluster %s at %s:%s failed: %s", remote_id, *address, exc)
            return LLMStatusCode.LLM_LINK_FAILED
        except LLMException as exc:
            log.warning("link to cluster %s at %s:%s failed: %s", remote_id, *address, exc)
            return exc.status_code
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and self.closing and (current is None or not current.cancelling()):
                log.warning("link to cluster %s at %s:%s: the endpoint was finalized meanwhile", remote_id, *address)
                return LLMStatusCode.LLM_LINK_FAILED
            raise
        finally:
            claim.release()
            if self._dialling.get(remote_id) is task:
                del self._dialling[remote_id]

    async def _handshake(self, remote_id: int, address: tuple[str, int], existing: Link | None,
                         deadline: float | None = None) -> LLMStatusCode:
        reader, writer = await asyncio.open_connection(*address)
        link: Link | None = None
        sockets: list[DataConn] = []
        try:
            tune(writer.get_extra_info("socket"))
            if self.tls_client is not None:
                await tls.dial_control(reader, writer, self.tls_client, address[0], HANDSHAKE_LIMIT_S)
            ok = await handshake.dial(reader, writer, secret=self.secret, cluster_id=self.cluster_id,
                                      role=self._role(), peer_id=remote_id, layout=layout_hash(self.runtime))
            channels = ok["channels"]
            for index in range(2 * channels):
                sockets.append(await self.dial_data(address, ok["link_token"], index, 0))
            if existing is not None:
                await existing.close()
                self.forget(existing)
            link = self._new_link(remote_id, ok["role"], reader, writer, is_client=True,
                                  channels=channels, token=ok["link_token"], remote_address=address)
            for index, sock in enumerate(sockets):
                link.install(index, sock, 0)
            if not self._register(link):
                # Finalized meanwhile, or a link from that cluster was accepted meanwhile: this one goes, and
                # the peer is told (it forgets its end).
                link.send(Msg.UNLINK, link.new_req_id())
                await link.close()
                if self.closing:
                    return LLMStatusCode.LLM_LINK_FAILED
                return LLMStatusCode.LLM_ALREADY_LINK
            await self._share_with(link, ok)
            await self._nixl_with(link, deadline)
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

    def _share_candidates(self) -> list[tuple[bytes, Callable[[socket.socket], None]]]:
        """The links a same-host peer may attach its share to now: live, sharing nothing yet."""
        return [(lk.token, lk.attach_share) for lk in self.links.values()
                if lk.broken is None and not lk.closed and lk.local is None]

    async def _share_with(self, link: Link, ok: dict) -> None:
        """Attach the same-host share channel when the peer runs on this kernel."""
        name = ok["local_name"][:1] + ok["local_name"][1:].rstrip(b"\0")
        if not self.shares_memory or not name.startswith(b"\0") or ok["boot_id"] != boot_id():
            return
        try:
            async with asyncio.timeout(SHARE_AUTH_S):
                sock = await connect_share(name, link.token, self.secret)
        except (OSError, TimeoutError) as exc:
            log.info("link to cluster %s: same-host sharing unavailable (%s); using TCP", link.remote_cluster_id, exc)
            return
        link.attach_local(sock)
        share = link.local
        assert share is not None  # attach_local set it
        # The peer's caches are mapped before link_clusters returns.
        await asyncio.wait([share.ready], timeout=SHARE_AUTH_S)
        if not share.ready.done() or share.ready.cancelled():
            if link.local is share:
                share.close()
                link.local = None
            log.info("link to cluster %s: the peer did not finish sharing; using TCP", link.remote_cluster_id)

    async def _nixl_with(self, link: Link, deadline: float | None = None) -> None:
        """With ``aio.Transport=nixl``: exchange NIXL metadata and cache lists before returning.

        The exchange may take a share of the time left until ``deadline`` (the
        caller's, in loop time); a plane not set up by then falls back to TCP
        for this link on both ends (``NixlPeer.set_up``), so a failing plane
        never costs the link.
        """
        peer = link.start_nixl()
        if peer is None:
            return
        await peer.set_up(deadline, HANDSHAKE_LIMIT_S)

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
        """Stop listening, stop every link attempt, and unlink every link (peers acknowledge within
        :data:`UNLINK_WAIT_S`, so they have let the link go when this returns)."""
        self.closing = True
        await self.stop_listening()
        attempts = [*self._handshakes, *self._dialling.values()]
        for task in attempts:
            task.cancel()
        if attempts:
            await asyncio.wait(attempts)
        links = list(self.links.values())
        self.links.clear()
        acks = []
        for link in links:
            if link.broken is None and not link.closed:
                req_id = link.new_req_id()
                acks.append(link.expect(req_id))
                link.send(Msg.UNLINK, req_id)
        if acks:
            await asyncio.wait(acks, timeout=UNLINK_WAIT_S)
        for ack in acks:
            if ack.done() and not ack.cancelled():
                ack.exception()  # a link that failed meanwhile: nothing to wait for
        await asyncio.gather(*(link.close() for link in links), return_exceptions=True)
        if self.nixl is not None:
            self.nixl.close()


class _Watched:
    """A handshake's reader that counts every complete read as progress (``admission``)."""

    def __init__(self, inner: asyncio.StreamReader, pending: Pending) -> None:
        self.inner = inner
        self._pending = pending

    async def readexactly(self, n: int) -> bytes:
        data = await self.inner.readexactly(n)
        self._pending.progress()
        return data


def _check_attached(reply: bytes, index: int) -> None:
    magic, status = wire.ATTACH_OK.unpack(reply)
    if magic != wire.ATTACH_MAGIC or status != SUCCESS:
        raise LLMException(f"peer refused data channel {index}", status_code=LLMStatusCode.LLM_LINK_FAILED)
