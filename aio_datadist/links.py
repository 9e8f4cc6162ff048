"""One link between LLMDataDist endpoints: what its messages do, its side transports, its life.

A link is one control connection (asyncio streams, framed messages) plus
``2 * aio.DataChannels`` data connections that carry bulk bytes only. The
client (the side that called ``link_clusters``) dials all of them. Data
channels ``[0, N)`` carry requests the client makes, ``[N, 2N)`` requests the
server makes, so the two ends never contend for a channel. The bytes on a data
channel are moved by the core's :class:`~aio_datadist._core.SocketEngine`
straight from and into cache memory. A transfer that stops part-way leaves its
channel's byte stream out of step, so that channel is closed on both ends and
the client dials it again.

:class:`Link` has two bases, each a module of its own: its control connection
(:class:`~aio_datadist.link_control.LinkControl`: what we send, the answers we
wait for, how we read it, the heartbeat) and its data channels
(:class:`~aio_datadist.link_channels.LinkChannels`). This module holds the
rest: what each control message does (``Link._dispatch``), the peer's requests
we serve, the same-host share and the NIXL peer a link may add, and the link's
life (announced, failed, unlinked, closed).

Links are made by the :class:`~aio_datadist.link_table.LinkTable`, whose
handshake (``handshake.py``) sends nothing identifying before the peer proved
the shared secret. With TLS (``aio.TlsServerContext`` /
``aio.TlsClientContext``) every connection of a link is TLS from its first
byte after a short preamble (``transport/tls.py``), and data channels are
:class:`~aio_datadist.transport.tls.TlsChannel` objects instead of sockets.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aio_datadist import protocol, wire
from aio_datadist.control_reader import ControlReader
from aio_datadist.link_channels import LOOP_IO_MAX as LOOP_IO_MAX  # these three: read as links.NAME too
from aio_datadist.link_channels import LOOP_LOWAT_MAX as LOOP_LOWAT_MAX
from aio_datadist.link_channels import MAX_SERVED_PER_CHANNEL as MAX_SERVED_PER_CHANNEL
from aio_datadist.link_channels import DataConn, LinkChannels, Redial
from aio_datadist.link_control import LinkControl
from aio_datadist.stats import LinkCounters, LinkStats
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.transport import base as transport_base
from aio_datadist.transport.local import MAX_LOCAL_PUSHES, LocalShare
from aio_datadist.transport.nixl import READY as NIXL_READY
from aio_datadist.transport.nixl import NixlPeer, link_tag
from aio_datadist.transport.nixl_agent import NixlAgent
from aio_datadist.transport.nixl_grants import NUDGE_HOLD_S
from aio_datadist.types import LLMRole
from aio_datadist.wire import Msg, ProtocolError

if TYPE_CHECKING:
    from aio_datadist.runtime import Runtime
    from aio_datadist.transport.ledger import Ledger

__all__ = ["DataConn", "Link", "tune"]

log = logging.getLogger("aio_datadist.links")

#: How long answering a peer's ``UNLINK`` waits for the jobs we served it to end after they were stopped: a
#: staged job (a device cache) ends only once the device copies it queued are done, and the peer's unlink
#: returns on our answer, so nothing of its pushes may land after it. Milliseconds on a device that runs.
SERVED_SETTLE_S = 1.0
#: The most same-host pushes (``PUSH_LOCAL``) of the peer's whose copies we run at once (a job each on our copy
#: threads). No data channel bounds them, so without it a peer's pushes, each planned into a job list that a
#: large request makes large (``MAX_SERVED_PER_CHANNEL``), queued for as long as their timeouts let them. A push
#: past it is answered "stream it" (``USE_STREAM``) before it is planned: the pusher sends it on a data channel,
#: which ``MAX_SERVED_PER_CHANNEL`` bounds. An honest pusher keeps no more in flight on the link
#: (``LocalShare.pushes``: a layer-wise transfer of 100 layers released at once met it and streamed the rest).
MAX_LOCAL_PUSHES_SERVED = MAX_LOCAL_PUSHES
#: The most requests of the peer's that we keep while waiting for its word that they are over (``pull_acks``:
#: requests served in place, which end with its ``DONE`` or a NIXL push's notification, and key pulls, whose
#: key stays claimed until its ``DONE``). A request past it is refused with ``RESP`` before it is planned.
#: In-place requests use no data channel once answered, so nothing else bounds them: a peer that never sent
#: ``DONE`` held about 3 KiB (the key it claimed, for a key) per request of about 170 bytes, for as long as the
#: link lived; each is now given up past its own timeout (``transport.base.DONE_GRACE_S``). An honest requester
#: has one such request per transfer it runs on the link at once, and ends each as soon as its bytes moved.
MAX_AWAITED_PER_LINK = 4096
#: At most one warning per link in this many seconds about requests given up for want of the peer's ``DONE``.
OVERDUE_WARN_EVERY_S = 60.0
ZERO32 = bytes(32)
SUCCESS = LLMStatusCode.LLM_SUCCESS
#: Link ids, unique in the process: the logs and ``LLMDataDist.stats()`` name links by them.
_LINK_IDS = itertools.count(1)


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Link(LinkControl, LinkChannels):
    """One established link to a peer endpoint.

    What a link needs of whoever made it comes in as callables: ``redial``
    dials a reset data channel again, ``forget`` drops the link from its table
    when the peer unlinks; ``nixl_agent`` is this endpoint's NIXL agent, ``ledger`` its read ledger
    (``transport/ledger.py``), if any.
    """

    def __init__(self, runtime: Runtime, remote_cluster_id: int, remote_role: LLMRole,
                 reader: ControlReader, writer: asyncio.StreamWriter, *, is_client: bool,
                 channels: int, token: bytes, remote_address: tuple[str, int], redial: Redial,
                 forget: Callable[[Link], None], nixl_agent: NixlAgent | None, ledger: Ledger | None = None,
                 cluster_id: int = 0) -> None:
        LinkControl.__init__(self, reader, writer, is_client=is_client)
        LinkChannels.__init__(self, channels, is_client=is_client, redial=redial)
        self.runtime = runtime
        self.link_id = next(_LINK_IDS)
        self.cluster_id = cluster_id
        self.counters = LinkCounters(cluster_id, remote_cluster_id, runtime.observers)
        self.log = logging.LoggerAdapter(log, {"cluster_id": cluster_id, "remote_cluster_id": remote_cluster_id,
                                               "link_id": self.link_id})
        self.unlinking = False  # we sent UNLINK: the peer closing the connection now is no failure
        self.unlinked = False  # torn down as unlinked (our UNLINK went through) before close() ran
        self.ending = False  # the link is being unlinked (by us or the peer): no new request of the peer is served
        self._announced = False  # whether the link's going up was logged and observed (so its going down is)
        self._forget = forget
        self.nixl_agent = nixl_agent
        self.ledger = ledger
        self.remote_cluster_id = remote_cluster_id
        self.remote_role = remote_role
        self.is_client = is_client
        self.token = token
        self.remote_address = remote_address
        #: The peer endpoint's instance (``LinkTable.instance``), as its handshake said: which endpoint dialled
        #: an accepted link, which one answered a dialled one (zero for a bilateral ``link()``'s).
        self.peer_instance = ZERO32
        self.accepted_seq = 0  # the link table's count of accepted links when it accepted this one (0: dialled)
        #: A watch that the peer's PING completes too: on an accepted ``link()`` link, the dialler's word that it
        #: set the link up (``LinkTable._await_bilateral``). Nothing else sends a PING.
        self.peer_set_up: asyncio.Future | None = None
        #: A bilateral ``link()``'s link in the table that its attempt is still setting up (its share, NIXL, the
        #: transport required; on the accepting end, until the dialler's PING): our own transfers on it wait
        #: for the comm's OK (``LinkTable.get``); the peer's requests are served.
        self.setting_up = False
        self.serving: dict[int, Callable[[], Any]] = {}
        #: The peer's same-host pushes whose copy we run (MAX_LOCAL_PUSHES_SERVED), each with its future that is
        #: done once the copy no longer touches memory.
        self.local_pushes: dict[int, asyncio.Future] = {}
        #: The peer's pushes we receive on a data channel (stream and staged planes), each with its job.
        self.served_pushes: dict[int, asyncio.Future] = {}
        self.pull_acks: dict[int, tuple[Callable[[], None], Callable[[], None]]] = {}
        self.broken: LLMException | None = None
        self.closed = False
        self._tasks: set[asyncio.Task] = set()
        self.on_request: Callable[[Link, Msg, int, Any], None] | None = None
        self.local: LocalShare | None = None
        self.nixl: NixlPeer | None = None
        #: The close that ends the link out of its table (the peer's UNLINK answered, a link forgotten): one the
        #: loop's shutdown cut short is finished by the table's close (``LinkTable.close``).
        self.close_task: asyncio.Task | None = None
        self._overdue_warned = -OVERDUE_WARN_EVERY_S  # when we last warned of a peer's missing DONE
        self._overdue_unsaid = 0  # requests given up for it since

    def done_overdue(self, req_id: int, timeout_ms: int) -> None:
        """The peer's request ``req_id`` was given up: its ``DONE`` did not come within its timeout plus the
        grace (``transport.base.await_done``). Warns once per :data:`OVERDUE_WARN_EVERY_S` on this link."""
        self._overdue_unsaid += 1
        now = time.monotonic()
        if now - self._overdue_warned < OVERDUE_WARN_EVERY_S:
            return
        self.log.warning("link %s to cluster %s: gave up %d request(s) of the peer's that it never said were over "
                         "(no DONE within its timeout plus %.1f s; the last: request %s, timeout %s ms): what they "
                         "held is released and the keys they pulled stay bound", self.link_id,
                         self.remote_cluster_id, self._overdue_unsaid, transport_base.DONE_GRACE_S, req_id, timeout_ms)
        self._overdue_warned, self._overdue_unsaid = now, 0

    # -- messages ----------------------------------------------------------

    @property
    def down(self) -> bool:
        """Closed, broken, or taken down as unlinked (its close to come): nothing more of it is acted on."""
        return self.closed or self.broken is not None or self.unlinked

    def check(self) -> None:
        if self.broken is not None:
            raise LLMException(f"link to cluster {self.remote_cluster_id} is broken: {self.broken}",
                               status_code=LLMStatusCode.LLM_LINK_FAILED)
        if self.closed or self.unlinked:
            raise self._unlinked_error()

    def _unlinked_error(self) -> LLMException:
        """What a transfer on this link fails with once it is unlinked (or being unlinked)."""
        return LLMException(f"link to cluster {self.remote_cluster_id} was unlinked",
                            status_code=LLMStatusCode.LLM_NOT_YET_LINK)

    def send_unlink(self, req_id: int) -> None:
        """Tell the peer we unlink (it acknowledges, then closes its end)."""
        self._report_reads()
        self.send(Msg.UNLINK, req_id)
        self.unlinking = True

    def _report_reads(self) -> None:
        # Our pulls without asking are reported to the owner in batches (REPORT_AFTER_S): the batch waiting
        # leaves before the word that ends the link (our UNLINK, our answer to the peer's), so the peer has it
        # when it lets the link go (a same-host share reads its queue then: LocalShare.finish).
        if self.local is not None:
            self.local.report_reads()
        if self.nixl is not None:
            self.nixl.report_reads()

    def spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _dispatch(self, event: protocol.Event) -> None:
        """Act on one event of the control connection (see ``protocol`` for what each is)."""
        match event:
            case protocol.Probe(req_id=req_id):
                self.send(Msg.PROBE_ACK, req_id)
            case protocol.Ping():
                # The peer is alive (the reader noted when it was heard); on a bilateral link, also set up.
                if self.peer_set_up is not None and not self.peer_set_up.done():
                    self.peer_set_up.set_result(None)
            case protocol.Unlink(req_id=req_id):
                # Answered once our end is down (``close``): the peer's unlink returns on the answer, so no
                # byte of its pushes may land here after it (a forced unlink under pushes waits for it).
                if self.unlinking:
                    self._crossed_unlink()
                self._forget(self)
                self.close_task = self.spawn(self.close(ack=req_id))
            case protocol.Abort(req_id=req_id, record=record, peers_request=peers_request):
                serving = None
                if peers_request:
                    self.deferred.pop(req_id, None)  # still waiting for its channel's redial: never serve it
                    serving = self.serving.pop(req_id, None)
                    if serving is not None:
                        serving()
                    ack = self.pull_acks.pop(req_id, None)  # sent everything, but the puller gave up
                    if ack is not None:
                        ack[1]()
                index = record.channel
                if index < len(self.channels) and self.channels[index].generation == record.generation:
                    self.reset_channel(index, tell_peer=False)
                elif self._redial_to.get(index) == record.generation:
                    self._stale_redials.add(index)  # the connection we are dialling: see _redial
                self._peer_resets(index, record.generation)
                if peers_request and serving is None:
                    # A pusher that gave up waits for our word that nothing of its request lands here any
                    # more; a request we serve answers once its job stopped (see owner.handle_request).
                    self.send(Msg.DONE, req_id, status=LLMStatusCode.LLM_FAILED, text="aborted")
            case protocol.Reply(msg=msg, req_id=req_id, record=record):
                if req_id and req_id == self._probe_id:
                    self.counters.rtt_s = time.perf_counter() - self._probe_sent
                    self._probe_id = 0
                    return
                wrong = self._wrong_answer(msg, req_id)  # looks the waiter up itself: see its docstring
                if wrong:
                    raise ProtocolError(wrong)  # the waiter stays in pending: the link's failure fails it
                fut = self.pending.get(req_id)
                then, then_answer = self._then.get(req_id, (None, None))
                self.unexpect(req_id)
                if then is not None and not then.done():
                    self.pending[req_id] = then  # the reply after this one (see expect)
                    if then_answer is not None:
                        self._acks[req_id] = then_answer
                if fut is not None and not fut.done():
                    fut.set_result(record)
            case protocol.Nixl(record=record):
                self._nixl_record(record)
            case protocol.PeerRequest(msg=msg, req_id=req_id, record=record):
                if msg in (Msg.PULL_REQ, Msg.PUSH_REQ) and self._defer(msg, req_id, record):
                    pass
                elif self.on_request is not None:
                    self.on_request(self, msg, req_id, record)

    def fail(self, exc: LLMException) -> None:
        """Mark the link broken: every waiter fails now, later calls fail fast."""
        if self.down:
            return
        self.broken = exc
        self._went_down("unlinked" if self.unlinking else f"failed: {exc}")
        self._teardown(exc)

    def _unlinked_down(self, why: str) -> None:
        """Take the link down as unlinked (not failed), once: what waits on it fails ``LLM_NOT_YET_LINK``."""
        self.unlinked = True
        self._went_down(why)
        self._teardown(self._unlinked_error())

    def attach_local(self, sock: Any) -> bool:
        """Start sharing caches with a same-host peer over ``sock``; False (``sock`` closed) if the link shares
        already: a second share would replace the first, which then leaked, and its loss dropped the first."""
        if self.local is not None:
            self.log.warning("link %s to cluster %s: refused a second same-host share", self.link_id,
                             self.remote_cluster_id)
            sock.close()
            return False
        share = self.local = LocalShare(sock, lambda: self._local_lost(share), self.runtime.devices,
                                        f"link {self.link_id} to cluster {self.remote_cluster_id}", self.ledger,
                                        functools.partial(self._read_by_peer, "local"))
        # Without llm.EnableRemoteCacheAccessible peers may not touch our caches at all.
        share.start(self.runtime.registry.caches() if self.runtime.settings.remote_cache_accessible else ())
        return True

    def _read_by_peer(self, transport: str, count: int, nbytes: int, seconds: float) -> None:
        """The peer pulled ``count`` times, ``nbytes`` in all, from a cache of ours without asking over
        ``transport`` (our read ledger let it): count each pull, with its share of the bytes and of the time."""
        self.counters.ended_many("served_pull", transport, count, nbytes, seconds)

    def attach_share(self, sock: Any) -> None:
        """The server's half: share with the peer whose share connection proved this link."""
        if self.attach_local(sock) and self.local is not None:
            self.local.announce_ready()
            self.log.info("link %s to cluster %s: transport local (the peer attached its same-host share)",
                          self.link_id, self.remote_cluster_id)

    def start_nixl(self) -> NixlPeer | None:
        """Begin the NIXL exchange with the peer (the client does, once linked)."""
        plane = self.nixl_agent
        if plane is None or self.nixl is not None:
            return self.nixl
        self.nixl = NixlPeer(plane, self._send_nixl, self.remote_cluster_id, link_tag(self.token),
                             functools.partial(self._read_by_peer, "nixl"), self.fail)
        self.nixl.hello()
        return self.nixl

    def _send_nixl(self, kind: int, cache_id: int, count: int, row_bytes: int, rows: tuple, blob: bytes) -> None:
        self.send(Msg.NIXL, 0, kind=kind, cache_id=cache_id, count=count, row_bytes=row_bytes, rows=rows, blob=blob)

    def _nixl_record(self, fields: wire.NixlRecord) -> None:
        if self.nixl is None:
            if self.nixl_agent is None:
                if fields.kind != NIXL_READY:
                    self._send_nixl(NIXL_READY, 0, 0, 0, (), b"")  # we do not speak NIXL: TCP it is
                return
            self.start_nixl()
        assert self.nixl is not None
        self.nixl.on_message(fields)

    def _local_lost(self, share: LocalShare) -> None:
        if self.local is not share:
            return  # not the link's share (any more): the link shares on, or the link went
        self.local = None
        if self.unlinking or self.down:
            return  # the link is going (the peer closes its share as it answers our UNLINK): no fall-back
        self.log.info("link %s to cluster %s: same-host sharing stopped; using %s", self.link_id,
                      self.remote_cluster_id, self.data_transport)

    # -- what the link is and did ---------------------------------------------

    @property
    def data_transport(self) -> str:
        """What the data channels are: ``"tls"`` or ``"tcp"``."""
        return "tls" if self.runtime.settings.tls else "tcp"

    @property
    def transport(self) -> str:
        """The transport the link negotiated: ``"nixl"``, ``"local"``, or its data channels' (``data_transport``)."""
        if self.nixl is not None and self.nixl.usable():
            return "nixl"
        if self.local is not None:
            return "local"
        return self.data_transport

    @property
    def up(self) -> bool:
        """Announced (linked, its transport settled and checked) and neither closed nor broken since: what
        ``stats().links`` lists."""
        return self._announced and not self.down

    def announce(self, how: str) -> None:
        """Log (once, at INFO) that the link is up and what it negotiated; tell the observers."""
        if self._announced or self.down:
            return
        self._announced = True
        self.counters.started = time.monotonic()  # up_seconds counts from the up event, not from the handshake
        self.runtime.links_up += 1
        transport = self.transport
        self.log.info("link %s to cluster %s (%s) up, %s: transport %s", self.link_id, self.remote_cluster_id,
                      self.remote_role.name, how, transport)
        self.counters.link_event(up=True)

    def _went_down(self, why: str) -> None:
        if not self._announced:
            return
        self._announced = False
        self.runtime.links_down += 1
        self.log.info("link %s to cluster %s down: %s", self.link_id, self.remote_cluster_id, why)
        self.counters.link_event(up=False)

    def stats(self) -> LinkStats:
        """A snapshot of the link's counters."""
        off = None
        if self.runtime.devices is not None:
            off = "the link shares no memory (no same-host share)" if self.local is None else self.local.ipc_off
        share = self.local
        unmapped = (0, 0) if share is None else (len(share.peer_refused), len(share.refused))
        return self.counters.snapshot(self.remote_role, self.link_id, self.transport, off, unmapped)

    async def settle_served(self, *, pushes_only: bool = False, forced: bool = False) -> None:
        """Before the peer hears that the link ends (our ``UNLINK``, or our answer to its own): serve no new
        request of its, stop the jobs we serve it and wait until they ended (at most
        :data:`SERVED_SETTLE_S`). A stream job ends at once; a same-host push's copy once its current piece is
        done; a staged one (a device cache) once the device copies it queued are done. The data channels stay
        up meanwhile, so the peer sees no reset before it hears from us. A peer's push we stopped fails there
        when it hears, with nothing of it landing here afterwards, nor its source read any more.

        ``pushes_only`` (our own unlink): only the jobs that write here or read the peer's memory, the peer's
        pushes we receive or copy; its pulls end with the link as before (a pull the peer copies itself, in
        place, is its own job, and stopping it here would give back a key its copy then takes).

        Either way, our own NIXL READs and WRITEs with the peer stop first, while the peer still makes progress
        on them: it cannot stop them itself, and what the unlink cuts fails ``LLM_NOT_YET_LINK`` by the unlink's
        return, as over the data channels (:meth:`_cut_own_nixl`). ``forced`` (our forced unlink, which the
        peer may never hear of): they are cut, and each returns once it settled, but the unlink waits only for
        our WRITEs into the peer's memory."""
        self.ending = True
        if self.local is not None:  # our same-host copies out of the peer's memory stop first (as NIXL's below)
            self.local.halt_copies(self._unlinked_error())
        if self.nixl is not None:
            await self._cut_own_nixl(self.nixl, reads_too=not forced)
        if pushes_only:
            for req_id in [*self.served_pushes, *self.local_pushes]:
                cancel = self.serving.pop(req_id, None)
                if cancel is not None:
                    cancel()
            served = [job for job in (*self.served_pushes.values(), *self.local_pushes.values()) if not job.done()]
        else:
            serving, self.serving = self.serving, {}
            for cancel in serving.values():
                cancel()
            served = [job for ch in self.channels for job in ch.answering if not job.done()]
            served += [copy for copy in self.local_pushes.values() if not copy.done()]
        if not served:
            return
        _, late = await asyncio.wait(served, timeout=SERVED_SETTLE_S)
        if late:
            self.log.error("link %s to cluster %s: %d job(s) served to the peer did not end within %.1f s of its "
                           "unlink (a device that does not get through its copies); answering it anyway",
                           self.link_id, self.remote_cluster_id, len(late), SERVED_SETTLE_S)

    async def _cut_own_nixl(self, peer: NixlPeer, *, reads_too: bool = True) -> None:
        """The link is being unlinked (by us or the peer): fail our NIXL transfers with the peer in flight
        (``LLM_NOT_YET_LINK``), start none, and wait until NIXL let go of each (``base.nixl_settle``: nudging the
        owner, whose progress a READ needs over UCX's TCP transport, and in one process; one that will not stop is
        forced off, its peer's agent let go) before the peer hears from us (our ``UNLINK``, or our answer to its
        own): no byte of ours reads or writes its memory once its unlink returned, and no pull of ours returns
        bytes it read after that. Their callers return once they settled (``reads_too`` False: this waits only
        for the WRITEs)."""
        cut = peer.cut_ours(self._unlinked_error(), for_good=True)
        left = [settled for settled, op in cut if reads_too or op == "WRITE"]
        if not left:
            return
        cancelled: list[asyncio.CancelledError] = []
        peer.granted.nudge()
        await asyncio.gather(*(transport_base.nixl_settle(settled, cancelled, tick=peer.granted.nudge,
                                                          every_s=NUDGE_HOLD_S / 2) for settled in left))
        if cancelled:
            raise cancelled[0]

    def _teardown(self, exc: LLMException) -> None:
        pending, self.pending = self.pending, {}
        self._acks.clear()
        self._then.clear()  # each is in pending already, or its request was never answered (nobody awaits it)
        watches, self._watches = self._watches, set()
        resets, self._resets = self._resets, {}
        for reset in resets.values():
            if not reset.done():
                reset.set_result(None)
        for fut in [*pending.values(), *watches]:
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
            # A failed link's pushes failed: what the kernel holds of them must not reach the peer now (row 178).
            self._drop_socket(ch, reset=self.broken is not None)
        if self.local is not None:
            self.local.finish()
            self.local = None
        if self.nixl is not None:
            self.nixl.cut_ours(exc)  # what waits on a NIXL transfer of ours fails with the link, as other waiters
            self.nixl.close()
            self.nixl = None
        if self.broken is not None and self.writer.transport.get_write_buffer_size():
            # Failed while the peer was not taking what we sent: a close would wait for it to read (and hold
            # the socket and the bytes for as long as it does not); what is left is moot now.
            self.writer.transport.abort()
        else:
            self._flush_soon()  # a DONE held for the end of this loop pass still reaches the peer
            self.writer.close()
        self.free.put_nowait(-1)

    async def close(self, why: str = "unlinked", *, ack: int = 0) -> None:
        """Close the link; ``ack``: the peer's ``UNLINK`` to answer, once the data channels are down (the
        answer leaves with the last flush before the control connection closes)."""
        if self.closed:
            return
        if ack and self.broken is None:
            await self.settle_served()
            if self.closed:
                return  # closed meanwhile (finalize): that close did the rest
        if self.broken is None and not self.unlinked:
            # Our reads without asking not reported yet leave before the end: with the answer to the peer's UNLINK,
            # or ahead of the close of a forced unlink of ours, which sends no UNLINK to carry them (found by audit).
            self._report_reads()
            # Answering: our pushes' WRITEs into the peer stop first, so none lands after its unlink returned. One
            # that would not stop (logged) gets no answer: the peer's unlink then fails, or, forced, returns on its
            # bound.
            if ack and (self.nixl is None or self.nixl.halt_writes()):
                self.send_soon(Msg.UNLINK_ACK, ack)  # written by _teardown after it dropped the data channels
            self._unlinked_down(why)
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
