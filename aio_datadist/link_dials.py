"""The dialling side of a link table: the links this endpoint makes to peers.

:class:`LinkDials` is the base of :class:`~aio_datadist.link_table.LinkTable`.
It dials peers (``connect``; the bilateral ``link()`` dials of
``start_bilateral``, and the waits of the end that does not dial) and runs
the client side of the handshake (``handshake.py``; TLS first when
configured) and of the data channels (``dial_data``, also how a link redials
them). A dialled link is set up before the call returns: its same-host share
attached, its NIXL plane set up or declined, the transport
``aio.RequireTransport`` names met. The table itself (its links, fd claims,
crossing dials, the listener) is ``LinkTable``'s, which this class only uses.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING

from aio_datadist import fd_budget, handshake, wire
from aio_datadist._settle import settle
from aio_datadist.control_reader import ControlReader, open_control
from aio_datadist.links import SUCCESS, DataConn, Link, tune
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.transport import tls
from aio_datadist.transport.base import meets
from aio_datadist.transport.local import SHARE_AUTH_S, boot_id, connect_share
from aio_datadist.types import LLMClusterInfo, LLMRole
from aio_datadist.wire import Msg, ProtocolError

if TYPE_CHECKING:
    from aio_datadist.own_dials import OwnDials
    from aio_datadist.runtime import Runtime

__all__ = ["LinkDials"]

log = logging.getLogger("aio_datadist.links")

#: Bound on one handshake or data-channel attach, dialled or accepted (the listener reads it when the table
#: is made).
HANDSHAKE_LIMIT_S = 10.0
#: Bound on a bilateral dial until the peer answers its handshake (connect, TLS, HELLO to LINK_OK): a dial
#: that connects but is never answered (a hung old instance, a half-open connection to a host that rebooted)
#: is dialled again instead of holding the comm for the whole link time. The peer allows HANDSHAKE_LIMIT_S
#: from its accept; the rest covers the wait in its listen backlog.
BILATERAL_ANSWER_S = 2 * HANDSHAKE_LIMIT_S
#: How long a dialled link that was not set up in time may take to close before the call returns.
SET_UP_CLOSE_S = 2.0
#: A bilateral dial is tried again after this long, doubling up to BILATERAL_RETRY_MAX_S.
BILATERAL_RETRY_FIRST_S = 0.05
BILATERAL_RETRY_MAX_S = 0.5


class _WentDown(LLMException):
    """The link went down while it was set up: final for a bilateral dial (the peer's link() took it), never
    a reason to dial again."""


class LinkDials:
    """The dials of a :class:`~aio_datadist.link_table.LinkTable`, its base class.

    The table's state and its own steps (registering a link, claiming its
    fds, telling crossing dials apart) are ``LinkTable``'s; what of them the
    dials use is declared here.
    """

    cluster_id: int
    runtime: Runtime
    links: dict[int, Link]
    own_dials: OwnDials
    instance: bytes
    closing: bool
    _role: Callable[[], LLMRole]
    _dialling: dict[int, asyncio.Task]
    _anonymous: set[asyncio.Task]
    _bilateral: set[asyncio.Task]
    _awaited: dict[int, asyncio.Future]
    _accepted: int

    if TYPE_CHECKING:
        @property
        def shares_memory(self) -> bool: ...

        @property
        def secret(self) -> bytes | None: ...

        @property
        def tls_client(self) -> ssl.SSLContext | None: ...

        def forget(self, link: Link) -> None: ...

        def _new_link(self, remote_id: int, remote_role: LLMRole, reader: ControlReader,
                      writer: asyncio.StreamWriter, *, is_client: bool, channels: int, token: bytes,
                      remote_address: tuple[str, int]) -> Link: ...

        def _live(self, remote_id: int) -> Link | None: ...

        def _register(self, link: Link, *, start: bool = True, awaited: bool = False) -> bool: ...

        def _crossing(self, link: Link, since: int) -> Link | None: ...

        def _close_replaced(self, crossed: Link) -> asyncio.Task: ...

        def _close_forgotten(self, link: Link, why: str) -> asyncio.Task: ...

        def _crossed_by(self, remote_id: int, answered: bytes, since: int) -> Link | None: ...

        def _reserve(self) -> int: ...

        def _claim(self, opened: int = 0) -> fd_budget.Claim: ...

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
        remote_id = cluster.remote_cluster_id  # None: whichever cluster listens there (learned in the handshake)
        address = cluster.remote_endpoints[0]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_ms / 1000
        while remote_id is not None:
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
        if self.closing:
            return LLMStatusCode.LLM_LINK_FAILED
        try:
            claim = self._claim()
        except LLMException as exc:
            log.warning("link to cluster %s at %s:%s refused here: %s", remote_id, *address, exc)
            return exc.status_code
        existing = None if remote_id is None else self.links.get(remote_id)
        # Counted before the dial's task first runs: a peer's dial accepted in this loop pass crossed ours too.
        task = loop.create_task(self._handshake(remote_id, address, existing, deadline, since=self._accepted))
        if remote_id is not None:
            self._dialling[remote_id] = task
        else:  # close() stops it as any other dial
            self._anonymous.add(task)
            task.add_done_callback(self._anonymous.discard)
        try:
            async with asyncio.timeout_at(deadline):
                return await task
        except TimeoutError:
            if task.done() and not task.cancelled() and task.exception() is None:
                return task.result()  # it ended in the loop pass its time ran out: the link is up, and stays
            log.warning("link to cluster %s at %s:%s timed out after %s ms", remote_id, *address, timeout_ms)
            return LLMStatusCode.LLM_TIMEOUT
        except (OSError, ConnectionError, asyncio.IncompleteReadError, ProtocolError) as exc:
            # (a peer that reset the connection says nothing more: the error's type, then, as "failed: " told nothing)
            log.warning("link to cluster %s at %s:%s failed: %s", remote_id, *address, str(exc) or repr(exc))
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
            if remote_id is not None and self._dialling.get(remote_id) is task:
                del self._dialling[remote_id]

    async def _handshake(self, remote_id: int | None, address: tuple[str, int], existing: Link | None,
                         deadline: float | None = None, *, bilateral: bool = False,
                         since: int | None = None) -> LLMStatusCode:
        """Dial ``address`` and register the link; ``remote_id`` None takes whichever cluster answers; ``since``:
        the count of accepted links when the dial began (only a link accepted after can have crossed it)."""
        # Only a bilateral dial is bounded short of the caller's time: it dials again (link_clusters does not).
        answer_by = asyncio.get_running_loop().time() + BILATERAL_ANSWER_S if bilateral else None
        if since is None:
            since = self._accepted
        try:
            async with asyncio.timeout_at(answer_by):
                reader, writer = await open_control(address)
        except TimeoutError:
            if answer_by is None:
                raise
            raise ConnectionError(f"not connected within {BILATERAL_ANSWER_S} s") from None
        link: Link | None = None
        sockets: list[DataConn] = []
        taken = False  # the peer took our dial (its LINK_OK said so)
        more: fd_budget.Claim | None = None  # for the data channels the peer names past ours (the caller claims ours)
        learned: asyncio.Task | None = None  # this dial, listed as dialling the cluster id the handshake told
        answered: bytes | None = None  # the instance of the endpoint that took our dial
        try:
            tune(writer.get_extra_info("socket"))
            try:
                async with asyncio.timeout_at(answer_by):
                    if self.tls_client is not None:
                        await tls.dial_control(reader, writer, self.tls_client, address[0], HANDSHAKE_LIMIT_S)
                    ok = await handshake.dial(reader, writer, secret=self.secret, cluster_id=self.cluster_id,
                                              role=self._role(), instance=self.instance, bilateral=bilateral,
                                              own=self.own_dials,
                                              peer_id=handshake.ANY_PEER if remote_id is None else remote_id)
            except TimeoutError:
                if answer_by is None:
                    raise
                raise ConnectionError(f"the handshake was not answered within {BILATERAL_ANSWER_S} s") from None
            taken = True
            answered = ok.instance
            if remote_id is None:
                remote_id = ok.cluster_id
                existing = self.links.get(remote_id) if self._live(remote_id) is None else None
                if remote_id not in self._dialling:  # unlink_clusters of it now says LLM_PROCESSING_LINK
                    learned = self._dialling[remote_id] = asyncio.current_task()  # type: ignore[assignment]
            elif ok.cluster_id != remote_id:
                raise LLMException(f"peer is cluster {ok.cluster_id}, not {remote_id}",
                                   status_code=LLMStatusCode.LLM_LINK_FAILED)
            channels = ok.channels
            if channels > self.runtime.settings.data_channels:
                more = fd_budget.claim(2 * (channels - self.runtime.settings.data_channels), self._reserve())
            for index in range(2 * channels):
                sockets.append(await self.dial_data(address, ok.link_token, index, 0))
            if existing is not None:
                await existing.close("replaced: linked again")
                self.forget(existing)
            link = self._new_link(remote_id, ok.role, reader, writer, is_client=True,
                                  channels=channels, token=ok.link_token, remote_address=address)
            if not bilateral:
                link.peer_instance = ok.instance
            for index, sock in enumerate(sockets):
                link.install(index, sock, 0)
            link.setting_up = bilateral  # until it is set up, below
            crossed = None if bilateral else self._crossing(link, since)
            if crossed is not None:
                # Its dial crossed ours and ours is the one both ends keep: ours takes its place, then its link
                # goes (the peer is told, and drops its dial, as its end finds our link in its table). Ours is
                # registered before anything is awaited: a cancel from here on finds it and unlinks it.
                self.forget(crossed)
            if not self._register(link):
                # Finalized meanwhile, or a link from that cluster was accepted meanwhile: this one goes, and
                # the peer is told (it forgets its end).
                if crossed is not None:  # (finalized: out of the table, it goes too)
                    self._close_replaced(crossed)
                link.send_unlink(link.new_req_id())
                await link.close()
                if self.closing:
                    return LLMStatusCode.LLM_LINK_FAILED
                return LLMStatusCode.LLM_ALREADY_LINK
            if crossed is not None:
                await settle(self._close_replaced(crossed), SET_UP_CLOSE_S)
            await self._share_with(link, ok)
            await self._nixl_with(link, deadline)
            await self._require_transport(link)
            if link.down:  # the peer went away while the link was set up
                why = "it was unlinked" if link.broken is None else str(link.broken)
                raise _WentDown(f"link to cluster {remote_id} went down before it was up: {why}",
                                status_code=LLMStatusCode.LLM_LINK_FAILED)
            if bilateral:
                link.send(Msg.PING, 0)  # set up here: the peer's link() may check its transport (Link.peer_set_up)
                link.setting_up = False
            link.announce("dialled")
            return SUCCESS
        except BaseException as exc:
            if link is None:
                for sock in sockets:
                    sock.close()
                if taken and not writer.is_closing():
                    # The peer registered its end before its LINK_OK: it forgets it on our UNLINK (else it kept a
                    # failed link that we never had). Written now, it is in the socket before the close (under TLS
                    # too: the record is handed to the socket as it is written, and the abort drops only what it
                    # did not take); a peer that misses it forgets a link whose data channels never all came
                    # (``LinkTable._opened``).
                    writer.write(wire.encode(Msg.UNLINK, 0))
                if writer.get_extra_info("ssl_object") is not None:
                    writer.transport.abort()
                else:
                    writer.close()
            elif self.links.get(link.remote_cluster_id) is link:
                # Registered, but not set up (the caller's time ran out, or a step failed): it goes, and the
                # peer is told (it forgets its end), so no link is left behind a call that did not link.
                self.forget(link)
                if not link.down:
                    link.send_unlink(link.new_req_id())
                await settle(asyncio.ensure_future(link.close("not set up")), SET_UP_CLOSE_S)
            if (answered is not None and not bilateral and isinstance(exc, Exception) and remote_id is not None
                    and self._crossed_by(remote_id, answered, since) is not None):
                # Our dial crossed the peer's, and the peer keeps its own (our end of it is in the table): the
                # peer cut ours while we set it up. The pair is linked, by the peer's dial.
                raise LLMException(f"cluster {remote_id} is already linked (its dial crossed ours, and both "
                                   "ends keep its dial)", status_code=LLMStatusCode.LLM_ALREADY_LINK) from exc
            if bilateral and taken and isinstance(exc, Exception) and not isinstance(exc, _WentDown):
                # The peer's link() took its one dial: dialling again would only be refused until the link time
                # ran out, while the peer's comm failed already.
                code = exc.status_code if isinstance(exc, LLMException) else LLMStatusCode.LLM_LINK_FAILED
                raise _WentDown(f"link to cluster {remote_id} failed after the peer took the dial: {exc}",
                                status_code=code) from exc
            raise
        finally:
            if more is not None:
                more.release()
            if learned is not None and remote_id is not None and self._dialling.get(remote_id) is learned:
                del self._dialling[remote_id]

    # -- bilateral links (LLMDataDist.link) ---------------------------------

    def start_bilateral(self, remote_id: int, address: tuple[str, int], *, dial: bool,
                        deadline: float) -> asyncio.Task[Link | LLMStatusCode]:
        """Start making the link to ``remote_id`` that both ends of a ``link()`` ask for.

        With ``dial`` this end dials ``address`` again and again (backing off
        from :data:`BILATERAL_RETRY_FIRST_S` to :data:`BILATERAL_RETRY_MAX_S`)
        until the peer takes the dial, which it does only while its own
        ``link()`` waits for it; without, it waits for that dial. Either way
        until ``deadline`` (loop time). The task's result is the link, once it
        is in this table, else the status saying why not (``LLM_TIMEOUT`` when
        the time ran out, ``LLM_ALREADY_LINK`` when another link to the
        cluster came up meanwhile, ...); it never raises but when cancelled,
        as :meth:`close` does.
        """
        work = (self._dial_bilateral(remote_id, address, deadline) if dial
                else self._await_bilateral(remote_id, deadline))
        task = asyncio.get_running_loop().create_task(work)
        self._bilateral.add(task)
        task.add_done_callback(self._bilateral.discard)
        return task

    def _awaits(self, remote_id: int) -> bool:
        waiter = self._awaited.get(remote_id)
        return waiter is not None and not waiter.done()

    async def _await_bilateral(self, remote_id: int, deadline: float) -> Link | LLMStatusCode:
        if self._awaits(remote_id):
            return LLMStatusCode.LLM_ALREADY_LINK  # the caller lets one link() per pair wait; never here
        waiter: asyncio.Future[Link] = asyncio.get_running_loop().create_future()
        self._awaited[remote_id] = waiter
        try:
            async with asyncio.timeout_at(deadline):
                link = await waiter
                # Up as the dialler's is: its share attached, NIXL set up or declined (it says so once it is),
                # and the transport we require met.
                assert link.peer_set_up is not None
                await link.peer_set_up
                await self._require_transport(link)
                link.setting_up = False
                link.announce("accepted")
                return link
        except TimeoutError:
            log.warning("link(): cluster %s did not link within the link time", remote_id)
            status = LLMStatusCode.LLM_TIMEOUT
        except LLMException as exc:  # linked otherwise, went down while set up, or not the transport required
            log.warning("link(): cluster %s: %s", remote_id, exc)
            status = exc.status_code
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                # Taken before this attempt was stopped (its comm unlinked or failed): the link is the comm's,
                # and what stopped us closes it (Comm.made) and tells the peer.
                return waiter.result()
            raise
        finally:
            if self._awaited.get(remote_id) is waiter:
                del self._awaited[remote_id]
        if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
            link = waiter.result()
            if self.links.get(remote_id) is link and not link.down:
                # Taken, not set up within the link time: it goes, the peer told (one that went down is closed
                # or kept as any other).
                self.forget(link)
                link.send_unlink(link.new_req_id())
                await settle(self._close_forgotten(link, "not set up"), SET_UP_CLOSE_S)
        return status

    async def _dial_bilateral(self, remote_id: int, address: tuple[str, int],
                              deadline: float) -> Link | LLMStatusCode:
        loop = asyncio.get_running_loop()
        delay = BILATERAL_RETRY_FIRST_S
        why: object = "no attempt"
        while True:
            if self.closing:
                return LLMStatusCode.LLM_LINK_FAILED
            if self._live(remote_id) is not None:
                return LLMStatusCode.LLM_ALREADY_LINK
            other = self._dialling.get(remote_id)  # a link_clusters dial of the same cluster: its turn first
            if other is not None:
                await asyncio.wait([other], timeout=max(0.0, deadline - loop.time()))
            else:
                status = await self._dial_once(remote_id, address, deadline)
                if status == SUCCESS:
                    link = self._live(remote_id)  # None: it went down while its share or NIXL was set up
                    return LLMStatusCode.LLM_LINK_FAILED if link is None else link
                if isinstance(status, LLMStatusCode):
                    return status
                why = status
            left = deadline - loop.time()
            if left <= 0:
                log.warning("link(): no link to cluster %s at %s:%s within the link time (last: %s)",
                            remote_id, *address, why)
                return LLMStatusCode.LLM_TIMEOUT
            await asyncio.sleep(min(delay, left))
            delay = min(2 * delay, BILATERAL_RETRY_MAX_S)

    async def _dial_once(self, remote_id: int, address: tuple[str, int],
                         deadline: float) -> LLMStatusCode | BaseException:
        """One bilateral dial: a final status, or the error to try again after (the peer is not
        listening yet, its link() is not waiting yet, ...)."""
        try:
            claim = self._claim()
        except LLMException as exc:
            log.warning("link(): link to cluster %s refused here: %s", remote_id, exc)
            return exc.status_code
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._handshake(remote_id, address, self.links.get(remote_id), deadline,
                                                bilateral=True))
        self._dialling[remote_id] = task
        try:
            async with asyncio.timeout_at(deadline):
                return await task  # success, or another link to the cluster came up meanwhile
        except TimeoutError:
            if task.done() and not task.cancelled() and task.exception() is None:
                return task.result()  # it ended in the loop pass the time ran out: the link is up, and stays
            return LLMStatusCode.LLM_TIMEOUT
        except _WentDown as exc:
            log.warning("link(): %s", exc)
            return exc.status_code
        except (OSError, ConnectionError, asyncio.IncompleteReadError, ProtocolError, LLMException) as exc:
            log.debug("link(): dial of cluster %s at %s:%s: %r; trying again", remote_id, *address, exc)
            return exc
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.done() and not task.cancelled() and task.exception() is None:
                # It ended in the loop pass this attempt was stopped (its comm unlinked, or finalize): whatever
                # link it made is the comm's, which that unlink closes (Comm.made), telling the peer.
                return task.result()
            if task.cancelled() and self.closing and (current is None or not current.cancelling()):
                return LLMStatusCode.LLM_LINK_FAILED
            raise
        finally:
            claim.release()
            if self._dialling.get(remote_id) is task:
                del self._dialling[remote_id]

    # -- setting a dialled link up -----------------------------------------

    async def _share_with(self, link: Link, ok: handshake.Linked) -> None:
        """Attach the same-host share channel when the peer runs on this kernel."""
        name = ok.local_name[:1] + ok.local_name[1:].rstrip(b"\0")
        if not self.shares_memory or not name.startswith(b"\0") or ok.boot_id != boot_id():
            return
        try:
            async with asyncio.timeout(SHARE_AUTH_S):
                sock = await connect_share(name, link.token, self.secret)
        except (OSError, TimeoutError) as exc:
            link.log.info("link %s to cluster %s: same-host sharing unavailable (%s); using TCP", link.link_id,
                          link.remote_cluster_id, exc)
            return
        link.attach_local(sock)
        share = link.local
        if share is None:  # lost as it started (the peer closed its end, or it failed a record)
            link.log.info("link %s to cluster %s: same-host sharing lost as it attached; using TCP", link.link_id,
                          link.remote_cluster_id)
            return
        # The peer's caches are mapped before link_clusters returns.
        await asyncio.wait([share.ready], timeout=SHARE_AUTH_S)
        if not share.ready.done() or share.ready.cancelled():
            if link.local is share:
                share.close()
                link.local = None
            link.log.info("link %s to cluster %s: the peer did not finish sharing; using TCP", link.link_id,
                          link.remote_cluster_id)

    async def _require_transport(self, link: Link) -> None:
        """Drop a link that negotiated a slower transport than ``aio.RequireTransport`` names: unlink it and
        raise ``LLM_LINK_FAILED`` saying what it negotiated."""
        required = self.runtime.settings.require_transport
        if meets(link.transport, required):
            return
        why = (f"aio.RequireTransport={required} but the link to cluster {link.remote_cluster_id} negotiated "
               f"{link.transport}")
        link.send_unlink(link.new_req_id())
        self.forget(link)
        await link.close(why)
        raise LLMException(why, status_code=LLMStatusCode.LLM_LINK_FAILED)

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


def _check_attached(reply: bytes, index: int) -> None:
    magic, status = wire.ATTACH_OK.unpack(reply)
    if magic == wire.ATTACH_MAGIC and status == LLMStatusCode.LLM_NOT_YET_LINK:
        raise LLMException(f"peer refused data channel {index}: it is unlinking the link",
                           status_code=LLMStatusCode.LLM_NOT_YET_LINK)
    if magic != wire.ATTACH_MAGIC or status != SUCCESS:
        raise LLMException(f"peer refused data channel {index}", status_code=LLMStatusCode.LLM_LINK_FAILED)
