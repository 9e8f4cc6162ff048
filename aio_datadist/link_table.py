"""The link table of one LLMDataDist: its links by cluster id, taking links, unlinking.

:class:`LinkTable` keeps one :class:`~aio_datadist.links.Link` per remote
cluster. It dials peers through its base :class:`~aio_datadist.link_dials.LinkDials`
(``connect``; the bilateral ``link()`` dials of ``start_bilateral``; the
client side of the handshake and of the data channels). Its
:class:`~aio_datadist.listener.Listener` accepts incoming connections and
asks the table whether to take each link (``refusal``, ``take``). The table
also feeds newly registered caches to the same-host shares and the NIXL plane
of its links. A link is made only when its fds fit under ``RLIMIT_NOFILE``
(``fd_budget.py``). There is at most one link per remote cluster id: a second
attempt for an id waits for the first, and a link that finds the id taken is
closed, never left behind.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import ssl
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aio_datadist import fd_budget, handshake, link_dials
from aio_datadist._checks import param_invalid
from aio_datadist._settle import settle
from aio_datadist.admission import ARRIVAL_FACTOR, Pending
from aio_datadist.control_reader import ControlReader
from aio_datadist.link_dials import LinkDials
from aio_datadist.links import SUCCESS, ZERO32, Link, tune
from aio_datadist.listener import Listener, Refusal, RefusalLog
from aio_datadist.own_dials import OwnDials
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.transport.base import ABORT_ACK_S, meets
from aio_datadist.transport.ledger import Ledger
from aio_datadist.transport.local import MAX_TENSORS
from aio_datadist.transport.nixl_agent import NixlAgent
from aio_datadist.types import LLMRole
from aio_datadist.wire import Msg

if TYPE_CHECKING:
    from aio_datadist.runtime import Runtime

#: Serves one request a peer sent over a link (``owner.handle_request``, injected from above).
RequestHandler = Callable[[Link, Msg, int, Any], None]

__all__ = ["LinkTable"]

log = logging.getLogger("aio_datadist.links")

#: How long finalize waits for peers to acknowledge UNLINK (so they have let the link go when it returns).
UNLINK_WAIT_S = 1.0
#: The most failed links that peers made to us (accepted) the table keeps, so that ``check_link_status`` and
#: ``unlink_clusters`` still name them; past it the oldest are forgotten. Peers that link and then crash (a
#: decoder restarted under a new cluster id, a process that opens links and drops them) otherwise left one
#: entry each for the endpoint's life: this side never unlinks them, and may not know their ids.
MAX_FAILED_ACCEPTED = 256
_NOT_AWAITED = "link() for this pair is not waiting here (not called yet, or given up)"


class _Opening:
    """The fds of an accepted link that are not open yet: its claim, less what is open, held until its data
    channels (and its share socket, where one may come) are attached or the link ends (``end``, a watch)."""

    __slots__ = ("claim", "channels", "share", "end")

    def __init__(self, claim: fd_budget.Claim, channels: int, share: bool, end: asyncio.Future) -> None:
        self.claim = claim
        self.channels = set(range(2 * channels))  # the data channels not attached yet
        self.share = share
        self.end = end


class LinkTable(LinkDials):
    """The links and the listener of one LLMDataDist (its dials are its base's, :class:`LinkDials`).

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
        self._dialling: dict[int, asyncio.Task] = {}
        self._anonymous: set[asyncio.Task] = set()  # connect dials with no remote cluster id (learned in the handshake)
        #: HELLO nonces of our dials in their handshake: our listener answers none of them (a link to ourselves,
        #: or our handshake handed back by whoever we dialled).
        self.own_dials = OwnDials()
        self._bilateral: set[asyncio.Task] = set()  # link() attempts (start_bilateral)
        self._awaited: dict[int, asyncio.Future] = {}  # remote id -> the link() that waits for its dial
        #: Links ``disconnect`` took out of the table and has not closed yet -> their UNLINK_ACK once the peer
        #: was told (None before): ``close`` closes them too.
        self._leaving: dict[Link, asyncio.Future | None] = {}
        #: Held while the listener may move: by ``switch_role`` from its checks through its listen, and by
        #: ``link()`` while it starts a comm (and its listener), so neither opens a listener the other does not
        #: see, and no comm starts under a role that is changing.
        self.listening = asyncio.Lock()
        self.closing = False
        self._opening: dict[Link, _Opening] = {}  # accepted links whose fds are not all open yet
        self._forgotten: set[asyncio.Task] = set()  # closes of links out of the table (_close_forgotten)
        #: Links out of the table (forgotten, replaced, unlinked by the peer), while anything holds them: one whose
        #: own close the loop's shutdown cut short (its cancel of every task) is closed by ``close``.
        self._dropped: weakref.WeakSet[Link] = weakref.WeakSet()
        #: The links an unlink of ours (``disconnect``) tears down, each with what is done once the peer's pushes it
        #: serves there stopped, and once that unlink ended.
        self._teardowns: dict[Link, tuple[asyncio.Future[None], asyncio.Future[None]]] = {}
        #: The links ``close`` closes, each with the answer to the UNLINK it sent, kept until closed: a ``close``
        #: the loop's shutdown cut short (its cancel of every task) is finished by the next (``close``).
        self._closing: dict[Link, asyncio.Future | None] = {}
        #: This endpoint's instance, random: told in every handshake, so that two ends whose link_clusters
        #: dials crossed agree which of the two links they keep (:meth:`_crossing`).
        self.instance = os.urandom(32)
        self._accepted = 0  # links accepted so far: each accepted link's ``accepted_seq``
        self._over_budget = RefusalLog()  # links refused for their fds
        fd_budget.raise_soft_limit()
        self.on_request = on_request
        self.listener = Listener(runtime, cluster_id, role, self, link_dials.HANDSHAKE_LIMIT_S)
        self.nixl = NixlAgent(runtime, cluster_id) if runtime.settings.transport == "nixl" else None
        runtime.registry.on_add = self._shared
        runtime.registry.check_add = self._check_add
        runtime.registry.on_free = self._unshared
        self._ledger: Ledger | None = None  # the read ledger (transport/ledger.py), made last: nothing fails after
        if self.shares_memory and meets("local", runtime.settings.require_transport):
            try:
                self._ledger = Ledger()
            except (OSError, MemoryError) as exc:
                log.info("no read ledger (%s): same-host peers ask for every pull", exc)

    @property
    def shares_memory(self) -> bool:
        """Whether same-host links may share cache memory (``aio.Transport`` auto or local)."""
        return self.runtime.settings.transport in ("auto", "local")

    def _check_add(self) -> None:
        """NIXL registers a cache through futures of the endpoint's loop: a cache is allocated or registered on it
        (``LLM_FAILED`` elsewhere, before anything is registered). Before, with no running loop the registration
        raised a bare ``RuntimeError`` after the cache had been added, which the caller never got to free.
        Without NIXL, from another thread while that loop runs (its links' same-host offers go out there)."""
        if self.nixl is None:
            self.runtime.on_home_thread("allocating or registering a cache")
            return
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not self.runtime.loop:
            raise LLMException("with aio.Transport=nixl a cache is allocated or registered on the event loop the "
                               "LLMDataDist was initialised on (NIXL registers it there)",
                               status_code=LLMStatusCode.LLM_FAILED)

    def _shared(self, cache: Any) -> None:
        if self.nixl is not None:
            self.nixl.register(cache)
        if not self.runtime.settings.remote_cache_accessible:
            return
        self._list(cache)
        for link in self.links.values():
            if link.local is not None:
                link.local.offer(cache)

    def _unshared(self, cache: Any) -> None:
        if self._ledger is not None:
            self._ledger.retract(cache.cache_id)  # before anything else: from now on peers ask
        if self.nixl is not None:
            self.nixl.unregister(cache)
        for link in self.links.values():
            if link.local is not None:
                link.local.withdraw(cache.cache_id)

    def _list(self, cache: Any) -> None:
        """Publish ``cache`` in the read ledger if it is an allocated blocks cache in shareable memory, bound to a
        blocks key."""
        if self._ledger is None:
            return
        model_id = self.runtime.registry.blocks_key_of(cache.cache_id)
        if (model_id is not None and cache.region is not None and not cache.on_device
                and cache.layout.num_tensors <= MAX_TENSORS):  # a larger one is never shared
            self._ledger.publish(cache.cache_id, model_id)

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """The address this table listens on, or None while it does not listen."""
        return self.listener.address

    @property
    def secret(self) -> bytes | None:
        return self.runtime.settings.shared_secret

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
        if link.setting_up:
            raise LLMException(f"cluster {cluster_id}: its link() link is still being set up; transfer once "
                               "query_register_mem_status returns OK", status_code=LLMStatusCode.LLM_NOT_YET_LINK)
        return link

    def forget(self, link: Link) -> None:
        if self.links.get(link.remote_cluster_id) is link:
            del self.links[link.remote_cluster_id]
            self._dropped.add(link)

    def _new_link(self, remote_id: int, remote_role: LLMRole, reader: ControlReader,
                  writer: asyncio.StreamWriter, *, is_client: bool, channels: int, token: bytes,
                  remote_address: tuple[str, int]) -> Link:
        """A link that redials its data channels, forgets itself and finds the NIXL plane through this table."""
        return Link(self.runtime, remote_id, remote_role, reader, writer, is_client=is_client, channels=channels,
                    token=token, remote_address=remote_address,
                    redial=lambda *args: self.dial_data(*args),  # looked up per call: tests may wrap dial_data
                    forget=self.forget, nixl_agent=self.nixl, ledger=self._ledger, cluster_id=self.cluster_id)

    def _live(self, remote_id: int) -> Link | None:
        link = self.links.get(remote_id)
        return link if link is not None and not link.down else None

    def live(self, remote_id: int) -> Link | None:
        """The link to ``remote_id`` if it is up (neither broken nor closed), else None."""
        return self._live(remote_id)

    def _register(self, link: Link, *, start: bool = True, awaited: bool = False) -> bool:
        """Make ``link`` the link to its cluster, unless another live one is (or the table closes); ``start``
        it reading (the accepting side starts it once ``LINK_OK`` is written: see :meth:`take`). Unless it is
        the dial a ``link()`` here waits for (``awaited``), that ``link()`` fails: it can take no dial now."""
        if self.closing or self._live(link.remote_cluster_id) is not None:
            return False
        link.on_request = self.on_request
        self.links[link.remote_cluster_id] = link
        waiter = self._awaited.get(link.remote_cluster_id)
        if not awaited and waiter is not None and not waiter.done():
            waiter.set_exception(LLMException(f"cluster {link.remote_cluster_id} was linked otherwise meanwhile "
                                              "(link_clusters)", status_code=LLMStatusCode.LLM_ALREADY_LINK))
        if start:
            link.start()
        if not link.is_client:
            self._forget_failed_accepted()
        return True

    def _crossing(self, link: Link, since: int) -> Link | None:
        """The accepted link that ``link``, our dial now set up, crossed and replaces, if any.

        Two endpoints that call ``link_clusters`` for each other at once each take the other's dial while
        their own still sets up, so each dial finds the cluster linked when it is ready. Both ends keep the
        link dialled by the endpoint of the lower instance: that endpoint's dial replaces the link of the
        other's, and the other endpoint drops its dial, as any dial that finds its cluster linked does. Only
        the link of the endpoint our dial reached counts (the same instance), and only one accepted while
        our dial ran (``since``: the accepted count when it began): one of another endpoint using the cluster
        id (an old instance of it, another process claiming it) is kept, and our dial dropped, and so is a link
        that was up before (without a secret an instance can be learned and claimed: a dial without a cluster
        id reaching such a claimant must not displace a link that did not cross it).
        """
        if self.instance >= link.peer_instance:
            return None
        return self._crossed_by(link.remote_cluster_id, link.peer_instance, since)

    @property
    def authenticates(self) -> bool:
        """Whether only peers that prove the shared secret link: their instances are then theirs. Without one
        (TLS alone may admit any client), any process that links can learn an endpoint's instance (its
        ``LINK_OK`` says it) and claim it: one at an address we dial (a stale one it took over) could then have
        our dial replace an honest link that crossed it, so crossing dials are not told apart there (both are
        dropped, as two dials that find their cluster linked)."""
        return self.secret is not None

    def _close_replaced(self, crossed: Link) -> asyncio.Task:
        """Unlink ``crossed``, taken out of the table for a dial of ours that crossed it."""
        crossed.send_unlink(crossed.new_req_id())
        return self._close_forgotten(crossed, "replaced: the peer's dial crossed ours")

    def _close_forgotten(self, link: Link, why: str) -> asyncio.Task:
        """Close ``link``, out of the table (nothing else finds it to close it); finalize waits for the close."""
        closing = asyncio.get_running_loop().create_task(link.close(why))
        link.close_task = closing
        self._dropped.add(link)
        self._forgotten.add(closing)
        closing.add_done_callback(self._forgotten.discard)
        return closing

    def _crossed_by(self, remote_id: int, answered: bytes, since: int) -> Link | None:
        """The link now registered for ``remote_id`` if the endpoint of instance ``answered`` (the one our dial
        reached) dialled it while our dial ran (``since``), between peers that prove the secret: our dial crossed
        it. (Which of the two both ends keep is :meth:`_crossing`'s.)"""
        other = self._live(remote_id)
        if (not self.authenticates or other is None or other.is_client or other.accepted_seq <= since
                or answered == ZERO32 or other.peer_instance != answered):
            return None
        return other

    def _forget_failed_accepted(self) -> None:
        """Keep at most :data:`MAX_FAILED_ACCEPTED` failed accepted links, forgetting the oldest first."""
        failed = [lk for lk in self.links.values() if not lk.is_client and lk.broken is not None]
        for lk in failed[:max(0, len(failed) - MAX_FAILED_ACCEPTED)]:
            self.forget(lk)
            lk.log.debug("link %s to cluster %s: forgotten (failed, and %d newer failed links are kept)",
                         lk.link_id, lk.remote_cluster_id, MAX_FAILED_ACCEPTED)
            # Closed here: nothing finds it any more (finalize, unlink, a comm's unlink look in the table).
            self._close_forgotten(lk, "forgotten")

    def _reserve(self) -> int:
        """fds kept free besides links (see ``fd_budget``): the connections in their handshake that are open
        already are counted as open, not again here."""
        admission = self.listener.admission
        if admission is None:
            return fd_budget.RESERVE
        pending = (1 + ARRIVAL_FACTOR) * self.runtime.settings.max_pending_handshakes
        return fd_budget.RESERVE + max(0, pending - len(admission.arriving) - len(admission.handshaking))

    def _claim(self, opened: int = 0) -> fd_budget.Claim:
        """Claim the fds of a link, less the ``opened`` ones already open (an accepted control connection)."""
        per_link = fd_budget.per_link(self.runtime.settings.data_channels, self.shares_memory)
        return fd_budget.claim(per_link - opened, self._reserve())

    def _hold(self, link: Link, claim: fd_budget.Claim) -> None:
        """Keep the claim of an accepted, registered ``link`` for the fds it has not opened yet: its data
        channels attach after ``LINK_OK``, so handshakes that run ahead of them would all fit otherwise."""
        share = self.shares_memory and self.listener.local_listener is not None
        if self.shares_memory and not share:
            claim.less(1)  # no share socket can come
        end = link.watch()
        if end.done():
            claim.release()
            return
        self._opening[link] = _Opening(claim, link.nchannels, share, end)
        end.add_done_callback(lambda _: self._opened(link))

    def _opened(self, link: Link) -> None:
        """``link``'s fds are all open, or it ended: nothing is claimed for it any more."""
        opening = self._opening.pop(link, None)
        if opening is not None:
            opening.claim.release()
            opening.end.cancel()
            if opening.channels and link.down and not self.closing and self.links.get(link.remote_cluster_id) is link:
                # It ended before its dialler had dialled its data channels: the dialler never registered it (its
                # call was cut there: a cancel, its time-out; or a dial failed), so it holds no link and will not
                # unlink this one; a failed link kept here would refuse switch_role and read LLM_LINK_FAILED.
                self.forget(link)
                self._close_forgotten(link, "ended before its dialler set it up")

    def attached(self, link: Link, index: int) -> None:
        """Data channel ``index`` of ``link`` was installed by the listener: its fd is open now."""
        opening = self._opening.get(link)
        if opening is None or index not in opening.channels:
            return
        opening.channels.discard(index)
        opening.claim.less(1)
        if not opening.channels and not opening.share:
            self._opened(link)

    def _attach_share(self, link: Link, sock: socket.socket) -> None:
        link.attach_share(sock)
        opening = self._opening.get(link)
        if opening is not None and opening.share:
            opening.share = False
            opening.claim.less(1)
            if not opening.channels:
                self._opened(link)

    # -- taking incoming links (for the listener) ---------------------------

    async def listen(self, ip: str, port: int) -> None:
        """Listen for peers on ``ip:port`` (see :class:`~aio_datadist.listener.Listener`); ``LLM_ENGINE_FINALIZED``
        once :meth:`close` began (a listener opened then would outlive finalize)."""
        if self.closing:
            raise LLMException("LLMDataDist was finalized", status_code=LLMStatusCode.LLM_ENGINE_FINALIZED)
        await self.listener.listen(ip, port)

    async def stop_listening(self) -> None:
        """Stop listening; connections accepted already finish their handshakes (or time out), but a link not
        authenticated yet is refused (its data channels would find no listener)."""
        await self.listener.stop()

    def linking(self) -> bool:
        """Whether a link is being made: a dial in its handshake (``connect``, ``link()``) or an accepted
        handshake the table is taking (``switch_role`` counts it as a link)."""
        return (any(not t.done() for t in (*self._dialling.values(), *self._anonymous, *self._bilateral))
                or self.listener.taking > 0)

    def refusal(self, remote_id: int, peer_id: int, bilateral: bool) -> Refusal | None:
        """Why an authenticated link from ``remote_id`` (that asked for ``peer_id``) is refused at once, or None."""
        own_id = self.cluster_id
        if peer_id not in (own_id, handshake.ANY_PEER):
            return LLMStatusCode.LLM_LINK_FAILED, f"this endpoint is cluster {own_id}, not {peer_id}"
        # Blocks layouts are checked per request (owner.serve_plan), so peers holding different caches link.
        if self.closing:
            return LLMStatusCode.LLM_LINK_FAILED, "this endpoint is being finalized"
        if self._live(remote_id) is not None:
            return LLMStatusCode.LLM_ALREADY_LINK, f"cluster {remote_id} is already linked"
        if bilateral and not self._awaits(remote_id):
            return LLMStatusCode.LLM_NOT_YET_LINK, _NOT_AWAITED
        return None

    async def take(self, remote_id: int, remote_role: LLMRole, bilateral: bool, reader: ControlReader,
                   writer: asyncio.StreamWriter, pending: Pending, through: Callable[[], None],
                   instance: bytes) -> Link | Refusal:
        """Make and register the link of an accepted handshake (``instance``: the dialling endpoint's), or say
        why not.

        ``through`` is called once the link no longer waits on the peer (its
        connection leaves the admission gate); ``pending`` is that connection.
        The caller starts the link (:meth:`Link.start`) once it has written
        ``LINK_OK``: a peer that sent messages right behind its ``AUTH`` gets
        no answer before the handshake's last record.
        """
        try:
            claim = self._claim(opened=1)  # the control connection is open
        except LLMException as exc:
            self._over_budget.note("refused a link from cluster %s: %s", remote_id, exc)
            return exc.status_code, str(exc)
        held = False  # the claim stays with the link until its fds are open (_hold)
        try:
            existing = self.links.get(remote_id)
            if existing is not None:
                with pending.working():
                    await existing.close("replaced: the cluster linked again")
                self.forget(existing)
                if self._live(remote_id) is not None:  # another handshake linked it meanwhile
                    return LLMStatusCode.LLM_ALREADY_LINK, f"cluster {remote_id} is already linked"
            token = os.urandom(32)
            channels = self.runtime.settings.data_channels
            tune(writer.get_extra_info("socket"))
            peer = writer.get_extra_info("peername")
            through()  # never dropped as stalled from here on
            if bilateral and not self._awaits(remote_id):  # that link() gave up meanwhile
                return LLMStatusCode.LLM_NOT_YET_LINK, _NOT_AWAITED
            link = self._new_link(remote_id, remote_role, reader, writer, is_client=False,
                                  channels=channels, token=token, remote_address=(peer[0], peer[1]))
            if not bilateral:  # (a bilateral pair never crosses: one end dials, the other waits)
                link.peer_instance = instance
            self._accepted += 1
            link.accepted_seq = self._accepted
            link.setting_up = bilateral  # until the dialler's PING and our transport check (_await_bilateral)
            if not self._register(link, start=False, awaited=bilateral):
                return LLMStatusCode.LLM_ALREADY_LINK, f"cluster {remote_id} is already linked"
            self._hold(link, claim)
            held = True
            if not bilateral:  # a bilateral link is up once set up (_await_bilateral announces it)
                link.announce("accepted")
            if bilateral:
                link.peer_set_up = link.watch()  # before the link reads: see _await_bilateral
                self._awaited.pop(remote_id).set_result(link)
            return link
        finally:
            if not held:
                claim.release()

    def share_candidates(self) -> list[tuple[bytes, Callable[[socket.socket], None]]]:
        """The links a same-host peer may attach its share to now: live, sharing nothing yet, and accepted, not
        dialled. The dialler attaches its share itself, at the peer's socket (``_share_with``); offered here,
        a dialled link let the dialled peer attach one at ours first, in place of the one we dial."""
        return [(lk.token, functools.partial(self._attach_share, lk)) for lk in self.links.values()
                if not lk.is_client and not lk.down and lk.local is None]

    async def disconnect(self, remote_id: int, timeout_ms: int, force: bool) -> LLMStatusCode:
        link = self.links.get(remote_id)
        if link is None:
            dialling = self._dialling.get(remote_id)
            if dialling is not None and not dialling.done():  # its link may come up yet: the caller retries
                return LLMStatusCode.LLM_PROCESSING_LINK
            if force:
                # Nothing of this end to tear down (never linked, or the peer's unlink or finalize closed it
                # first): done, as LLM-DataDist's forced unlink, which destroys the local end if there is one
                # and succeeds either way. A survivor's forced unlink before it links again must not fail
                # because the peer that went away said so first. A link of that cluster still being torn down
                # is waited for until the peer's pushes into our caches stopped, none of which may land after
                # this call returned: the peer's UNLINK until our answer's close (its settle of them, then the
                # close's 1 s at most); another unlink of ours until its settle of them (SERVED_SETTLE_S at most),
                # then, as a forced unlink's own, min(timeout, ABORT_ACK_S) at most for the rest of it: the
                # peer's answer, which it sends once its NIXL WRITEs into our caches stopped (row 176).
                settling: list[asyncio.Future] = []
                closing: list[asyncio.Future] = []
                for lk in list(self._dropped):
                    if lk.remote_cluster_id == remote_id:
                        teardown = self._teardowns.get(lk)
                        if teardown is not None:
                            settling.append(teardown[0])
                            closing.append(teardown[1])
                        elif lk.close_task is not None:
                            settling.append(lk.close_task)
                if not settling:
                    log.info("forced unlink of cluster %s: no link to it, nothing to tear down", remote_id)
                if any(not done.done() for done in settling):
                    await asyncio.wait(settling)  # a cancel of ours stops none of them
                if any(not done.done() for done in closing):
                    await asyncio.wait(closing, timeout=min(timeout_ms / 1000, ABORT_ACK_S))
                return SUCCESS
            return LLMStatusCode.LLM_NOT_YET_LINK
        self.forget(link)
        self._leaving[link] = None
        loop = asyncio.get_running_loop()
        settled, closed = self._teardowns[link] = (loop.create_future(), loop.create_future())
        status = SUCCESS
        try:
            if link.broken is None:
                # The peer's pushes we serve stop, and have ended, before it hears that the link ends: they
                # then fail with nothing of them landing here after our unlink (or they) returned, and
                # no same-host copy of ours reads its memory after its push returned.
                await link.settle_served(pushes_only=True, forced=force)
                if link.broken is not None and not force:  # it failed meanwhile: the peer was never told
                    status = LLMStatusCode.LLM_NOTIFY_PROMPT_UNLINK_FAILED
            settled.set_result(None)  # what a forced unlink of the cluster meanwhile waits for first
            # A forced unlink tells the peer too while pushes of ours are in flight: their bytes on the way
            # would land there after the pushes returned, unless the peer closes its end first (as for a
            # non-forced unlink: it answers, then closes), for ABORT_ACK_S at most, as an aborted push waits.
            # So it does while pulls we answered wait for the peer's DONE (pull_acks): a pull whose DONE left
            # before the answer has its key consumed here, one that had not sent it fails there (row 177).
            if link.broken is None and (not force or link.counters.in_flight("push") or link.pull_acks):
                fut = self._leaving.get(link)
                if fut is None:  # else close() told the peer meanwhile
                    req_id = link.new_req_id()
                    fut = self._leaving[link] = link.expect(req_id, Msg.UNLINK_ACK)
                    link.send_unlink(req_id)
                try:
                    async with asyncio.timeout(min(timeout_ms / 1000, ABORT_ACK_S) if force else timeout_ms / 1000):
                        await fut
                except (TimeoutError, LLMException):
                    if not force:
                        status = LLMStatusCode.LLM_NOTIFY_PROMPT_UNLINK_FAILED
        finally:
            # Out of the table already: closed here even when the caller is cancelled while the peer has
            # not answered, or nothing would close it but close() (Link.close is bounded).
            try:
                await settle(asyncio.ensure_future(link.close()), None)
            finally:
                self._leaving.pop(link, None)
                self._teardowns.pop(link, None)
                for done in (settled, closed):  # (settled too: its settle raised or was cancelled)
                    if not done.done():
                        done.set_result(None)
        return status

    def leaving_links(self) -> list[Link]:
        """The links we are unlinking (out of the table, not closed yet)."""
        return [link for link in self._leaving if not link.closed]

    async def probe(self, remote_id: int, timeout_ms: int) -> None:
        link = self.get(remote_id)
        req_id = link.new_req_id()
        fut = link.expect(req_id, Msg.PROBE_ACK)
        link.send(Msg.PROBE, req_id)
        try:
            async with asyncio.timeout(timeout_ms / 1000):
                await fut
        except TimeoutError:
            raise LLMException(f"link to cluster {remote_id}: no answer within {timeout_ms} ms",
                               status_code=LLMStatusCode.LLM_TIMEOUT) from None
        finally:
            if not fut.done() or fut.cancelled():  # timed out or cancelled: nobody waits for the answer any more
                link.unexpect(req_id)

    async def close(self) -> None:
        """Stop listening, stop every link attempt, and unlink every link (peers acknowledge within
        :data:`UNLINK_WAIT_S`, so they have let the link go when this returns). A close cut short (the loop's
        shutdown cancels every task, this one's among them) is finished by calling it again: each step is
        done once, or again where it is not done yet."""
        self.closing = True
        await self.stop_listening()
        attempts = [*self.listener.handshakes, *self._dialling.values(), *self._anonymous, *self._bilateral]
        for task in attempts:
            task.cancel()
        if attempts:
            await asyncio.wait(attempts)
        # With the links an unlink took out of the table and still waits on, and those out of the table that no
        # close has closed (one cut short, or never started: a task cancelled before its first step): finalize
        # closes them too. A close under way is left to end (_forgotten is waited for; one answering the peer's
        # UNLINK ends by itself, as before; one without its answer to wait for is closed at its first step).
        cut = [link for link in self._dropped
               if not link.closed and (link.close_task is None or link.close_task.done())]
        for link in (*self.links.values(), *self._leaving, *cut):
            self._closing.setdefault(link, None)
        self.links.clear()
        links = list(self._closing)
        await asyncio.gather(*(link.settle_served(pushes_only=True) for link in links
                               if not link.down and self._closing[link] is None and self._leaving.get(link) is None))
        acks = []
        for link in links:
            if not link.down:
                ack = self._closing[link] or self._leaving.get(link)  # ours or the unlink's, if the peer was told
                if ack is None and link.unlinking:
                    continue  # an UNLINK of ours left already (a link not set up): no second one, it is closed below
                if ack is None:
                    req_id = link.new_req_id()
                    ack = link.expect(req_id, Msg.UNLINK_ACK)
                    if link in self._leaving:
                        self._leaving[link] = ack
                    link.send_unlink(req_id)
                self._closing[link] = ack
                acks.append(ack)
        live_acks = [ack for ack in acks if not ack.get_loop().is_closed()]  # (a cut close's, on a loop closed since)
        if live_acks:
            await asyncio.wait(live_acks, timeout=UNLINK_WAIT_S)
        for ack in acks:
            if ack.done() and not ack.cancelled():
                ack.exception()  # a link that failed meanwhile: nothing to wait for
        await asyncio.gather(*(link.close() for link in links), *self._forgotten, return_exceptions=True)
        self._closing.clear()
        if self.nixl is not None:
            await self.nixl.aclose()
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None
