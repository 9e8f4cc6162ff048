"""One link between LLMDataDist endpoints: control messages, data channels, heartbeat.

A link is one control connection (asyncio streams, framed messages) plus
``2 * aio.DataChannels`` data connections that carry bulk bytes only. The
client (the side that called ``link_clusters``) dials all of them. Data
channels ``[0, N)`` carry requests the client makes, ``[N, 2N)`` requests the
server makes, so the two ends never contend for a channel. The bytes on a data
channel are moved by the core's :class:`~aio_datadist._core.SocketEngine`
straight from and into cache memory. A transfer that stops part-way leaves its
channel's byte stream out of step, so that channel is closed on both ends and
the client dials it again.

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
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

from aio_datadist import _core, protocol, wire
from aio_datadist._core import LoopJob
from aio_datadist._env import env_int
from aio_datadist.control_reader import ControlReader
from aio_datadist.loop_io import LoopIo
from aio_datadist.stats import LinkCounters, LinkStats
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.transport import base as transport_base
from aio_datadist.transport import tls
from aio_datadist.transport.local import LocalShare
from aio_datadist.transport.nixl import READY as NIXL_READY
from aio_datadist.transport.nixl import NixlPeer, link_tag
from aio_datadist.transport.nixl_agent import NixlAgent
from aio_datadist.types import LLMRole
from aio_datadist.wire import Msg, ProtocolError

if TYPE_CHECKING:
    from aio_datadist.runtime import Runtime
    from aio_datadist.transport.ledger import Ledger

__all__ = ["DataConn", "Link", "tune"]

log = logging.getLogger("aio_datadist.links")

HEARTBEAT_MISSES = 5
#: What a link still sends once it sent ``UNLINK`` (``Link._mute``): the answer to the peer's own ``UNLINK``.
_AFTER_UNLINK = frozenset({Msg.UNLINK_ACK})
#: The answers a transfer of ours waits for (``Link.expect``); ``PROBE_ACK`` and ``UNLINK_ACK`` answer only
#: the PROBE or UNLINK that asked for them.
TRANSFER_REPLIES = frozenset({Msg.RESP, Msg.DONE})
#: A control connection's chunk at least this big makes the link skip one turn of the loop before it reads
#: that connection again. uvloop (libuv) reads a readable connection up to 32 times in one turn, each read
#: acted on at once: a peer that floods its control connection would hold the loop for seconds' worth of
#: messages per turn (asyncio's loop reads each connection once per turn, at most 256 KiB).
CONTROL_TURN_BYTES = 64 * 1024
#: The most bytes a control connection may have waiting to be sent before the link stops reading it: a peer
#: that sends requests (or PROBEs) and never reads the answers must not make us buffer them without bound.
#: Reading resumes once the peer took them; a peer that never does is not heard any more, and the heartbeat
#: fails its link. Honest control traffic stays far below this (requests wait for data channels).
CONTROL_WRITE_LIMIT = 4 << 20
#: Jobs on plain data channels up to this size are driven by the event loop itself (``loop_io``), larger
#: ones by the native SocketEngine's thread. ``$AIO_DATADIST_LOOP_IO_MAX`` (bytes) overrides it; 0 sends
#: every job through the engine thread (for comparisons: ``docs/transports.md``).
LOOP_IO_MAX = env_int("AIO_DATADIST_LOOP_IO_MAX", 16 << 20)
#: How long answering a peer's ``UNLINK`` waits for the jobs we served it to end after they were stopped: a
#: staged job (a device cache) ends only once the device copies it queued are done, and the peer's unlink
#: returns on our answer, so nothing of its pushes may land after it. Milliseconds on a device that runs.
SERVED_SETTLE_S = 1.0
#: A receive the event loop drives asks the kernel to wake it only once this many of its remaining bytes (or
#: all of them, when fewer are left) can be read (``SO_RCVLOWAT``, see ``_core.LoopJob.step``): a 2 MiB pull
#: then wakes the loop two or three times instead of at every few hundred KiB that arrive, on both ends of the
#: loopback. The bound keeps bytes landing as they come on a slow path and the copy after the last byte
#: short. ``$AIO_DATADIST_LOOP_LOWAT_MAX`` (bytes) overrides it; 0 leaves the socket's default (wake at
#: every arrival).
LOOP_LOWAT_MAX = min(env_int("AIO_DATADIST_LOOP_LOWAT_MAX", 1 << 20), 1 << 30)
#: The most requests of the peer's that we serve at once on one of its data channels (a job each, answering it
#: on that channel: its bytes, or a refusal there). A request past it is refused with ``RESP`` and nothing
#: of it is planned. Without a bound a peer that never reads its channel queued one job per request (a job
#: list of 16 bytes per row and tensor, rows repeated as often as ``wire.MAX_ROWS``, so about 160 MiB from a
#: 512 KiB request of 160 tensors) for up to ``MAX_SERVE_TIMEOUT_MS``. An honest requester sends a request on
#: a channel only once its last one there ended on its side: the owner's earlier jobs there have then sent
#: everything, though their end may not have reached our loop yet; two at once (docs/reliability.md row 88)
#: are served.
MAX_SERVED_PER_CHANNEL = 4
#: The most same-host pushes (``PUSH_LOCAL``) of the peer's whose copies we run at once (a job each on our copy
#: threads). No data channel bounds them, so without it a peer's pushes, each planned into a job list that a
#: large request makes large (above), queued for as long as their timeouts let them. A push past it is answered
#: "stream it" (``USE_STREAM``) before it is planned: the pusher sends it on a data channel, which
#: ``MAX_SERVED_PER_CHANNEL`` bounds. An honest pusher has one in flight per push it runs on the link at once.
MAX_LOCAL_PUSHES_SERVED = 64
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


#: A data channel's connection: a socket the native engine drives, or a TLS channel.
DataConn = socket.socket | tls.TlsChannel


class _Channel:
    __slots__ = ("index", "sock", "generation", "attached", "loop_jobs", "answering", "queued")

    def __init__(self, index: int) -> None:
        self.index = index
        self.sock: DataConn | None = None
        self.generation = 0
        self.attached = False
        # An own channel is in ``Link.free`` at most once (``queued``). A transfer holds one generation of it
        # (``Link.acquire``, then ``release(index, generation)``): a channel reset while queued (the peer's
        # ABORT of an idle channel) keeps its one place for its redialled connection, one reset while held is
        # queued by its redial, and the holder of the old generation gives back nothing, so no two transfers
        # ever share it.
        self.queued = False
        self.loop_jobs: set[LoopIo] = set()  # jobs the loop drives on this socket (stopped before it closes)
        self.answering: set[asyncio.Future] = set()  # our jobs answering the peer's requests here (see answers)


#: Dials data channel ``index`` of a link again: ``(address, token, index, generation) -> connection``.
Redial = Callable[[tuple[str, int], bytes, int, int], Awaitable[DataConn]]


class Link:
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
        self._probe_id = 0  # the id of the heartbeat PROBE in flight, and when it left
        self._probe_sent = 0.0
        self._redial_data = redial
        self._forget = forget
        self.nixl_agent = nixl_agent
        self.ledger = ledger
        self.remote_cluster_id = remote_cluster_id
        self.remote_role = remote_role
        self.reader = reader
        self.writer = writer
        self._soon: list[bytes] = []  # records send_soon holds until the next write or the end of this loop pass
        self.is_client = is_client
        self.token = token
        self.remote_address = remote_address
        #: The peer endpoint's instance (``LinkTable.instance``), as its handshake said: which endpoint dialled
        #: an accepted link, which one answered a dialled one (zero for a bilateral ``link()``'s).
        self.peer_instance = ZERO32
        self.accepted_seq = 0  # the link table's count of accepted links when it accepted this one (0: dialled)
        self.nchannels = channels
        self.channels = [_Channel(i) for i in range(2 * channels)]
        self.own = range(0, channels) if is_client else range(channels, 2 * channels)
        self.free: asyncio.Queue[int] = asyncio.Queue()
        self.pending: dict[int, asyncio.Future] = {}
        self._acks: dict[int, Msg] = {}  # requests of ours in pending answered by PROBE_ACK or UNLINK_ACK (expect)
        #: The waiter for a request's reply after its answer, and the kind that reply may be (expect).
        self._then: dict[int, tuple[asyncio.Future, Msg | None]] = {}
        self._watches: set[asyncio.Future] = set()  # futures only the link's end completes (watch)
        self._resets: dict[tuple[int, int], asyncio.Future] = {}  # (channel, generation): see peer_reset
        self._peer_reset_to: dict[int, int] = {}  # channel -> the newest generation of it the peer ABORTed
        #: A watch that the peer's PING completes too: on an accepted ``link()`` link, the dialler's word that it
        #: set the link up (``LinkTable._await_bilateral``). Nothing else sends a PING.
        self.peer_set_up: asyncio.Future | None = None
        self.serving: dict[int, Callable[[], Any]] = {}
        #: The peer's same-host pushes whose copy we run (MAX_LOCAL_PUSHES_SERVED), each with its future that is
        #: done once the copy no longer touches memory.
        self.local_pushes: dict[int, asyncio.Future] = {}
        #: The peer's pushes we receive on a data channel (stream and staged planes), each with its job.
        self.served_pushes: dict[int, asyncio.Future] = {}
        self.pull_acks: dict[int, tuple[Callable[[], None], Callable[[], None]]] = {}
        self.broken: LLMException | None = None
        self.closed = False
        self._next_req = 1 if is_client else 2
        self.last_heard = 0.0
        self._tasks: set[asyncio.Task] = set()
        self.on_request: Callable[[Link, Msg, int, Any], None] | None = None
        self.local: LocalShare | None = None
        self.nixl: NixlPeer | None = None
        self.redialling: dict[int, asyncio.Future] = {}
        #: The close that ends the link out of its table (the peer's UNLINK answered, a link forgotten): one the
        #: loop's shutdown cut short is finished by the table's close (``LinkTable.close``).
        self.close_task: asyncio.Task | None = None
        self._redial_to: dict[int, int] = {}  # the generation each channel in ``redialling`` is dialled at
        self._stale_redials: set[int] = set()  # ... which the peer reset before we installed it (its ABORT)
        # Peer requests waiting for a channel we redial, by request id: the channel; and per channel how many
        # such waits are under way (a request the peer aborted meanwhile still waits, and is then dropped).
        # At most MAX_SERVED_PER_CHANNEL per channel, and one per request id; another request is served at once,
        # that is refused (its channel is down), so a peer cannot have us hold its requests' rows without bound
        # while it delays the redial's ATTACH_OK.
        self.deferred: dict[int, asyncio.Task] = {}
        self._deferring: dict[int, int] = {}
        self._protocol = protocol.LinkProtocol(is_client)
        self._turn_skipped = False  # the control connection is not read until the loop's next turn
        self._write_blocked = False  # nor until the peer took what we have for it (CONTROL_WRITE_LIMIT)
        self._read_paused = False  # whether we paused reading it (for either reason)
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

    # -- ids, channels -----------------------------------------------------

    def new_req_id(self) -> int:
        rid = self._next_req
        self._next_req += 2
        return rid

    def is_mine(self, req_id: int) -> bool:
        """Whether ``req_id`` names a request of ours (the protocol's parity rule)."""
        return self._protocol.is_mine(req_id)

    def peer_channel_ok(self, index: int) -> bool:
        return index < 2 * self.nchannels and index not in self.own and self.channels[index].sock is not None

    def answers(self, index: int) -> int:
        """How many requests of the peer's we answer on its channel ``index`` now (:data:`MAX_SERVED_PER_CHANNEL`)."""
        if index >= len(self.channels):
            return 0
        return sum(1 for job in self.channels[index].answering if not job.done())

    def answering(self, index: int, job: asyncio.Future) -> None:
        """``job`` answers a request of the peer's on its channel ``index`` (counted by :meth:`answers` until done)."""
        jobs = self.channels[index].answering
        if not job.done():
            jobs.add(job)
            job.add_done_callback(jobs.discard)

    def install(self, index: int, sock: DataConn, generation: int) -> None:
        ch = self.channels[index]
        self._drop_socket(ch)
        ch.sock = sock
        ch.generation = generation
        ch.attached = True
        if index in self.own:
            self._put_free(ch)

    def _put_free(self, ch: _Channel) -> None:
        if not ch.queued and ch.sock is not None and not self.closed:
            ch.queued = True
            self.free.put_nowait(ch.index)

    def _drop_socket(self, ch: _Channel, *, reset: bool = False) -> None:
        """Stop the channel's jobs and close its socket; ``reset``: with a TCP reset (a plain socket, or the one
        under a TLS channel), so that the kernel drops what it has not sent yet instead of delivering it after
        our transfer gave up."""
        if ch.sock is not None:
            for job in list(ch.loop_jobs):
                job.stop(LLMException(f"data channel {ch.index} to cluster {self.remote_cluster_id} was closed",
                                      status_code=LLMStatusCode.LLM_FAILED))
            ch.loop_jobs.clear()
            if isinstance(ch.sock, socket.socket):
                if reset:
                    tls.reset_on_close(ch.sock)
                self.runtime.sockets.detach(ch.sock.fileno())
                ch.sock.close()
            else:
                ch.sock.close(reset=reset)
            ch.sock = None

    async def acquire(self) -> int:
        """A free channel of ours; waits while all are busy or being redialled."""
        while True:
            self.check()
            self._refuse_after_unlink()
            index = await self.free.get()
            if index < 0:  # the link went down: pass the news on to the next waiter
                self.free.put_nowait(index)
                self.check()
                raise LLMException(f"link to cluster {self.remote_cluster_id} is down",
                                   status_code=LLMStatusCode.LLM_LINK_FAILED)
            ch = self.channels[index]
            ch.queued = False
            if self.unlinking:
                # We sent UNLINK while this waited: no request leaves any more (see expect); the channel goes
                # back untouched (a request refused after it took one reset it and redialled into the peer,
                # which had let the link go and refused: the link failed under the unlink).
                self._put_free(ch)
                self._refuse_after_unlink()
            if ch.sock is not None:  # else it was reset while queued: its redial queues it again
                return index

    def attach_advances(self, index: int, generation: int) -> bool:
        """Whether a data connection for ``index`` at ``generation`` is new: a channel is attached once per
        generation and generations only grow (the client redials a reset channel at the next one)."""
        if index >= 2 * self.nchannels:
            return False
        ch = self.channels[index]
        return generation > ch.generation or (generation == ch.generation and not ch.attached)

    def release(self, index: int, generation: int) -> None:
        """Give back channel ``index`` taken at ``generation``; one replaced since is not ours to give."""
        ch = self.channels[index]
        if ch.generation == generation:
            self._put_free(ch)

    def reset_channel(self, index: int, tell_peer: bool, req_id: int = 0) -> None:
        """Close a channel whose byte stream is out of step; the client redials it.

        With ``tell_peer`` the peer also stops serving ``req_id``, even when
        the channel was already reset (then only the request is named). The
        native job on the channel is over when this returns (the engine
        detaches the fd first), and the socket (plain or under TLS) is closed
        with a reset, so the kernel drops what it had not sent yet instead of
        delivering it to a peer that is about to discard it.
        """
        ch = self.channels[index]
        if self.closed:
            return
        tell_peer = tell_peer and not self.unlinking  # after our UNLINK the peer ends all it serves us (see expect)
        if ch.sock is None:
            if tell_peer and req_id:
                self.send(Msg.ABORT, req_id, channel=index, generation=wire.NO_GENERATION)
            return  # already reset; its redial is under way
        generation = ch.generation
        self._drop_socket(ch, reset=True)
        if tell_peer:
            self.send(Msg.ABORT, req_id, channel=index, generation=generation)
        if self.is_client and not self.unlinking:  # (after our UNLINK the peer takes no connection of the link)
            done = asyncio.get_running_loop().create_future()
            self.redialling[index] = done
            task = self.spawn(self._redial(index, generation + 1, done))
            task.add_done_callback(functools.partial(self._redial_end, index, done))

    async def _redial(self, index: int, generation: int, done: asyncio.Future) -> None:
        try:
            while True:
                if self.unlinking:
                    return  # we sent UNLINK: the peer takes no connection of the link any more
                self._redial_to[index] = generation
                try:
                    sock = await self._redial_data(self.remote_address, self.token, index, generation)
                except (OSError, LLMException, TimeoutError) as exc:
                    if self.unlinking or (isinstance(exc, LLMException)
                                          and exc.status_code == LLMStatusCode.LLM_NOT_YET_LINK):
                        return  # the link goes by an unlink (ours, or the peer's, whose UNLINK follows): no failure
                    self.fail(LLMException(f"could not redial data channel {index}: {exc}",
                                           status_code=LLMStatusCode.LLM_LINK_FAILED))
                    return
                if self.down or self.unlinking:  # the link's teardown ran already (or goes): nothing uses it
                    sock.close()
                    return
                if index in self._stale_redials:
                    # The peer took this connection, then reset the channel (its ABORT of this generation came
                    # before our install): it waits for the next one, which only we can dial.
                    self._stale_redials.discard(index)
                    sock.close()
                    generation += 1
                    continue
                self.install(index, sock, generation)
                return
        finally:
            self._redial_end(index, done)

    def _redial_end(self, index: int, done: asyncio.Future, _task: Any = None) -> None:
        """A redial is over: run by ``_redial`` itself, and again as its task's done-callback for a task the
        link's close cancelled before it started (its ``finally`` never ran)."""
        if done.done():
            return
        self._redial_to.pop(index, None)
        self._stale_redials.discard(index)
        if self.redialling.get(index) is done:
            del self.redialling[index]
        done.set_result(None)

    def _defer(self, msg: Msg, req_id: int, record: Any) -> bool:
        """Keep a request of the peer's for its channel that we are redialling, within the bounds of
        ``deferred``; whether it was kept."""
        index = record.channel
        redial = self.redialling.get(index)
        if (redial is None or req_id in self.deferred
                or self._deferring.get(index, 0) >= MAX_SERVED_PER_CHANNEL):
            return False
        self._deferring[index] = self._deferring.get(index, 0) + 1
        task = self.deferred[req_id] = self.spawn(self._request_after_redial(redial, msg, req_id, record))
        # Counted off by a done-callback: one the link's close cancels before it started runs no ``finally``.
        task.add_done_callback(functools.partial(self._deferred_end, index, req_id))
        return True

    def _deferred_end(self, index: int, req_id: int, task: asyncio.Task) -> None:
        left = self._deferring.pop(index, 1) - 1
        if left:
            self._deferring[index] = left
        if self.deferred.get(req_id) is task:
            del self.deferred[req_id]

    async def _request_after_redial(self, redial: asyncio.Future, msg: Msg, req_id: int, fields: Any) -> None:
        """Serve a request on a channel we are still redialling once it is back (unless the peer aborted it
        meanwhile: it is no longer in ``deferred``).

        The peer may use its channel as soon as it accepted our redial, and its
        request can overtake the acknowledgement our redial is waiting for.
        """
        await asyncio.shield(redial)  # the link closing cancels this wait, never the redial's own future
        if self.deferred.get(req_id) is not asyncio.current_task():
            return
        del self.deferred[req_id]
        if self.on_request is not None and not self.down:
            self.on_request(self, msg, req_id, fields)

    def posts(self, index: int) -> bool:
        """Whether a receive can be posted on channel ``index`` ahead of its request (``ReqFlag.POSTED``):
        a plain socket, which the native engine reads with a gated receive."""
        return isinstance(self.channels[index].sock, socket.socket)

    def move(self, index: int, pairs: Any, *, send: bool, timeout_ms: int | None, what: str,
             keepalive: Any, settled: asyncio.Future | None = None, gated: int = 0) -> asyncio.Future:
        """Start sending from (or receiving into) the ``[addr, nbytes, ...]`` runs ``pairs`` on data
        channel ``index``: the future of the bytes moved. Cancelling it stops the job; the channel is
        then out of step and must be reset. Plain channels run on the native SocketEngine, TLS ones
        on their :class:`~aio_datadist.transport.tls.TlsChannel`.

        ``settled``, when given, gets a result once the job can no longer touch ``pairs``: when the
        engine reported it over (also after a cancel), or, on TLS, once the job's future is done (the
        channel stops filling a job's memory the moment its future is done).

        ``gated`` (a request id; plain sockets only, see :meth:`posts`): a receive whose first run is the
        answer header (``wire.ANSWER``) to that request, checked before anything else is read
        (``SocketEngine.submit_recv_gated``)."""
        conn = self.channels[index].sock
        if conn is None:
            raise LLMException(f"data channel {index} to cluster {self.remote_cluster_id} is down",
                               status_code=LLMStatusCode.LLM_LINK_FAILED)
        if isinstance(conn, tls.TlsChannel):
            fut = conn.start(pairs, send=send, timeout_ms=timeout_ms, what=what, keepalive=keepalive)
            if settled is not None:
                def settle_job(_: asyncio.Future, settled: asyncio.Future = settled) -> None:
                    if not settled.done():
                        settled.set_result(None)

                fut.add_done_callback(settle_job)
            return fut
        fd = conn.fileno()
        job = LoopJob(fd, send, pairs, gated, bool(gated), LOOP_LOWAT_MAX)
        ch = self.channels[index]
        # One loop watcher per socket and direction: a second job that way (only a peer that sends two
        # requests on one channel makes one) queues on the engine instead.
        if job.total <= LOOP_IO_MAX and not any(other.sending == send for other in ch.loop_jobs):
            return self._loop_move(ch, fd, job, what, keepalive, timeout_ms, settled)
        engine = self.runtime.sockets
        if send:
            def submit(t: int) -> Any:
                return engine.submit_send(t, fd, pairs)
        elif gated:
            def submit(t: int) -> Any:
                return engine.submit_recv_gated(t, fd, pairs, gated)
        else:
            def submit(t: int) -> Any:
                return engine.submit_recv(t, fd, pairs)
        return self.runtime.completions.start(submit, engine.cancel, timeout_ms=timeout_ms, what=what,
                                              keepalive=keepalive, settled=settled)

    @staticmethod
    def _loop_move(ch: _Channel, fd: int, job: LoopJob, what: str, keepalive: Any, timeout_ms: int | None,
                   settled: asyncio.Future | None) -> asyncio.Future:
        io = LoopIo(fd, job, what=what, keepalive=keepalive, timeout_ms=timeout_ms, settled=settled)
        if not io.future.done():
            ch.loop_jobs.add(io)
            io.future.add_done_callback(lambda _: ch.loop_jobs.discard(io))
        return io.future

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
            raise LLMException(f"link to cluster {self.remote_cluster_id} was unlinked",
                               status_code=LLMStatusCode.LLM_NOT_YET_LINK)

    def check_heard(self) -> None:
        """Raise unless a word sent now (a pull's ``DONE``) surely reaches the peer while it still serves our
        requests: not once we sent ``UNLINK`` (the peer ends what it serves us once it reads it, so a word that
        follows may find nothing to act on), nor once the control connection is closing or closed under the
        link (a transport closes on a reset a callback or two before the link hears: over TLS its TCP
        connection first), which one peek at its socket tells."""
        self.check()
        if self.unlinking:
            raise LLMException(f"link to cluster {self.remote_cluster_id}: {transport_base.UNLINKING}",
                               status_code=LLMStatusCode.LLM_NOT_YET_LINK)
        fd = self._control_fd()
        if self.writer.is_closing() or fd is None or _core.peer_closed(fd):  # a closed fd (-1) peeks as closed
            raise LLMException(f"link to cluster {self.remote_cluster_id}: the control connection is closing",
                               status_code=LLMStatusCode.LLM_LINK_FAILED)

    def _control_fd(self) -> int | None:
        """The fd of the control connection's socket (under TLS, its TCP one), for a peek; None once the
        transport let go of it."""
        sock = self.writer.transport.get_extra_info("socket")
        return None if sock is None else sock.fileno()

    def _mute(self, msg: Msg) -> bool:
        """Whether ``msg`` is not to be sent: nothing once the link is closing, and after our ``UNLINK`` only
        an ``UNLINK_ACK`` (the peer reads nothing after our ``UNLINK``: see :meth:`expect`)."""
        return self.closed or self.writer.is_closing() or (self.unlinking and msg not in _AFTER_UNLINK)

    def send(self, msg: Msg, req_id: int, **fields: Any) -> None:
        """Send ``msg`` with its record's ``fields`` (see :meth:`_mute`)."""
        if self._mute(msg):
            return
        self._write(wire.encode(msg, req_id, **fields))

    def send_record(self, msg: Msg, req_id: int, record: wire.Record, **changes: Any) -> None:
        """Send ``msg`` carrying ``record`` with ``changes`` to its fields (see :meth:`_mute`)."""
        if self._mute(msg):
            return
        self._write(wire.encode_record(msg, req_id, record, **changes))

    def send_soon(self, msg: Msg, req_id: int, **fields: Any) -> None:
        """Send ``msg`` at the end of this loop pass, or with the next record sent before then (one write for
        both, in order): for a word the peer needs soon and our caller need not wait for, a pull's ``DONE``.
        Each write to the control connection wakes the peer's process, which on the hosts measured costs the
        writer about 100 us; this takes that off the pull's return."""
        if self._mute(msg):
            return
        if not self._soon:
            asyncio.get_running_loop().call_soon(self._flush_soon)
        self._soon.append(wire.encode(msg, req_id, **fields))

    def _write(self, data: bytes) -> None:
        if self._soon:
            data = b"".join((*self._soon, data))
            self._soon.clear()
        if self.writer.is_closing():
            return
        try:
            self.writer.write(data)
        except RuntimeError:  # uvloop: a transport whose loop was closed (without finalize) is closed under us
            pass  # nothing goes out any more; the link's close does not wait on it past its bound

    def _flush_soon(self) -> None:
        if not self._soon:
            return
        data = b"".join(self._soon)
        self._soon.clear()
        if not self.closed and not self.writer.is_closing():
            self.writer.write(data)

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

    def expect(self, req_id: int, answer: Msg | None = None, *, then: asyncio.Future | None = None,
               then_answer: Msg | None = None) -> asyncio.Future:
        """The future of the peer's answer to our request ``req_id``: ``RESP`` or ``DONE`` (a transfer's), or
        the ``answer`` named (``PROBE_ACK``, ``UNLINK_ACK``). An answer of another kind is a protocol error
        that fails the link, and with it the future.

        ``then``: the waiter for the peer's next reply to ``req_id`` (a transfer's ``DONE``, or a ``RESP``
        saying why the owner stopped part-way), made the waiter as the answer is read, before the task that
        awaits the answer resumes: a reply the peer sends right after its answer is not dropped meanwhile.
        ``then_answer``: the one kind that reply may be (a push's ``DONE``; None: ``RESP`` or ``DONE``).

        Once we sent ``UNLINK`` no request leaves any more (``LLM_NOT_YET_LINK``, raised here, before it is
        sent): the peer reads nothing after our ``UNLINK``, and bytes it left unread as it closed made its
        kernel reset the connection, dropping its ``UNLINK_ACK`` (the unlink then read as unanswered)."""
        if answer is not Msg.UNLINK_ACK:
            self._refuse_after_unlink()
        fut = asyncio.get_running_loop().create_future()
        self.pending[req_id] = fut
        if answer is not None:
            self._acks[req_id] = answer
        if then is not None:
            self._then[req_id] = (then, then_answer)
        return fut

    def _crossed_unlink(self) -> None:
        """The peer's ``UNLINK`` came while ours waits for its answer: the peer let the link go as we did, which
        is the answer (its ``UNLINK_ACK`` may never come: it tears the link down as ours does)."""
        for req_id, answer in list(self._acks.items()):
            fut = self.pending.get(req_id)
            if answer is Msg.UNLINK_ACK and fut is not None and not fut.done():
                fut.set_result(None)
                self.unexpect(req_id)

    def _refuse_after_unlink(self) -> None:
        """``LLM_NOT_YET_LINK`` once we sent ``UNLINK``: no request of ours leaves any more (see :meth:`expect`)."""
        if self.unlinking:
            raise LLMException(f"link to cluster {self.remote_cluster_id}: {transport_base.UNLINKING}",
                               status_code=LLMStatusCode.LLM_NOT_YET_LINK)

    def unexpect(self, req_id: int) -> None:
        """Stop waiting for the answer to ``req_id`` (one that comes later is dropped)."""
        self.pending.pop(req_id, None)
        self._acks.pop(req_id, None)
        self._then.pop(req_id, None)

    def watch(self) -> asyncio.Future:
        """A future that the link's end fails (broken or unlinked, as every waiter), and that nothing the peer
        sends can complete: how a caller with no request in flight learns that the link went. Cancel it
        once done with it."""
        fut = asyncio.get_running_loop().create_future()
        try:
            self.check()  # a link that is down already fails no future any more
        except LLMException as exc:
            fut.set_exception(exc)
            fut.exception()
            return fut
        self._watches.add(fut)
        fut.add_done_callback(self._watches.discard)
        return fut

    def peer_reset(self, index: int, generation: int) -> asyncio.Future:
        """A future done once the peer's ``ABORT`` of data channel ``index`` at ``generation`` (or a later one)
        was acted on (the peer reset the channel; a word it had for the request it served there came before it,
        on this connection), at once if it was already, and when the link goes down. Not by the channel's
        generation here: a peer that dials our channels redials one it reset, which may be installed before
        its word is read. Drop it with :meth:`drop_peer_reset`."""
        fut = asyncio.get_running_loop().create_future()
        if self.down or self._peer_reset_to.get(index, -1) >= generation:
            fut.set_result(None)
        else:
            self._resets[(index, generation)] = fut
        return fut

    def _peer_resets(self, index: int, generation: int) -> None:
        # Not an ABORT of the request alone (NO_GENERATION: it resets no channel), nor of a generation the
        # channel cannot have reached (a buggy or hostile peer's): either would end every later wait at once.
        if (not 0 <= index < len(self.channels) or generation == wire.NO_GENERATION
                or generation > self.channels[index].generation + 1):
            return
        if generation > self._peer_reset_to.get(index, -1):
            self._peer_reset_to[index] = generation
        for (channel, waited), fut in list(self._resets.items()):
            if channel == index and waited <= generation:
                del self._resets[(channel, waited)]
                if not fut.done():
                    fut.set_result(None)

    def drop_peer_reset(self, index: int, generation: int, fut: asyncio.Future) -> None:
        if self._resets.get((index, generation)) is fut:
            del self._resets[(index, generation)]

    def spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def start(self) -> None:
        self.last_heard = asyncio.get_running_loop().time()
        self.reader.feed_to(self._control_data, self._control_end)
        self.spawn(self._heartbeat(self.runtime.settings.heartbeat_interval_ms / 1000))

    async def _heartbeat(self, interval: float) -> None:
        """PROBE every interval; a peer silent for HEARTBEAT_MISSES intervals, and for one more after a
        last PROBE, is lost.

        This catches peers that stopped (SIGSTOP, a hung host, a cut cable)
        without closing their sockets, which no read would ever notice. A
        PROBE is answered, so a live peer is heard from every interval of
        ours whatever its own heartbeat interval is (a plain PING was not
        answered: a peer configured with a longer interval was dropped).

        Silence is judged only once we asked: a loop held by a long blocking
        call (or a stopped process) sent no PROBE meanwhile and, on uvloop,
        runs its timers before it reads what arrived; so a link silent past
        the bound gets one last PROBE and an interval to answer it (and one
        turn of the loop to read the answer) before it is failed. A peer that
        stopped is still caught however often the loop is held: within the
        bound plus two intervals and the time held.
        """
        loop = asyncio.get_running_loop()
        while not self.down:
            await asyncio.sleep(interval)
            if loop.time() - self.last_heard <= HEARTBEAT_MISSES * interval:
                self._probe()
                continue
            asked = loop.time()
            self._probe()  # the last one
            await asyncio.sleep(interval)
            await asyncio.sleep(0)  # a turn that reads what came (uvloop runs timers before reading)
            if self.down:
                return
            if self.last_heard < asked:
                silent = loop.time() - self.last_heard
                self.log.warning("link %s to cluster %s: heartbeat lost (nothing heard for %.1f s)", self.link_id,
                                 self.remote_cluster_id, silent)
                self.fail(LLMException(f"no heartbeat for {silent:.1f} s", status_code=LLMStatusCode.LLM_LINK_FAILED))
                return

    def _probe(self) -> None:
        """Send a PROBE (none after our UNLINK: see :meth:`expect`). An id of ours, so that the answer (a Reply)
        gives the round trip; a PROBE_ACK nobody waits for is dropped, as peers have always done with the id-0
        probes of older versions."""
        if self.unlinking:
            return
        self._probe_id = self.new_req_id()
        self._probe_sent = time.perf_counter()
        self.send(Msg.PROBE, self._probe_id)

    def _control_data(self, data: bytes) -> None:
        """A chunk of the control connection, straight from its protocol's callback: act on each
        complete message in it, in order."""
        if self.down:
            return
        try:
            heard = False
            held: list[protocol.PeerRequest] = []
            for event in self._protocol.events(data):  # parsed one at a time (see ``LinkProtocol.events``)
                if not heard:
                    heard = True
                    self.last_heard = asyncio.get_running_loop().time()
                if self.down:
                    return  # an earlier message of this chunk ended the link: the rest is not acted on
                if isinstance(event, protocol.PeerRequest) and event.msg is Msg.PUSH_LOCAL:
                    held.append(event)  # served after the chunk: see _serve_held
                    continue
                if held and isinstance(event, protocol.Abort) and event.peers_request:
                    held = [h for h in held if h.req_id != event.req_id]  # given up before we read it
                self._dispatch(event)
            if held:
                self._serve_held(held)
            if self._protocol.error is not None:  # a bad frame after the complete ones just dispatched
                raise self._protocol.error
            if not self.down:
                if len(data) >= CONTROL_TURN_BYTES and not self._turn_skipped:
                    self._turn_skipped = True
                    asyncio.get_running_loop().call_soon(self._next_turn)
                if not self._write_blocked and self.writer.transport.get_write_buffer_size() > CONTROL_WRITE_LIMIT:
                    self._write_blocked = True
                    self.spawn(self._read_once_drained())
                self._pace_reading()
        except ProtocolError as exc:
            self.log.warning("link %s to cluster %s: protocol error: %s", self.link_id, self.remote_cluster_id, exc)
            self.fail(LLMException(f"protocol error: {exc}", status_code=LLMStatusCode.LLM_LINK_FAILED))
        except Exception as exc:  # a bug of ours: the link cannot be trusted to be in step any more
            self.log.exception("link %s to cluster %s: acting on a control message failed", self.link_id,
                               self.remote_cluster_id)
            self.fail(LLMException(f"internal error on the control connection ({type(exc).__name__}: {exc})",
                                   status_code=LLMStatusCode.LLM_LINK_FAILED))

    def _serve_held(self, held: list[protocol.PeerRequest]) -> None:
        """Serve the same-host pushes of a chunk once all of it was read. Our copies of them write our
        memory, and a pusher that gives up waits for our word only ``ABORT_ACK_S``: one whose request we
        read late (our loop stood still) may have returned already. Its ``ABORT`` then follows the request
        in the same chunk, so the request is never served; a pusher that failed the link instead closed the
        connection, and its end, seen here before any copy starts, fails the link."""
        if self.down:
            return
        fd = self._control_fd()
        if fd is not None and _core.peer_closed(fd):
            self._peer_closed("the peer closed it")
            return
        for event in held:
            if self.down:
                return
            self._dispatch(event)

    def _next_turn(self) -> None:
        """Read the control connection again (see :data:`CONTROL_TURN_BYTES`)."""
        self._turn_skipped = False
        self._pace_reading()

    async def _read_once_drained(self) -> None:
        """Read the control connection again once the peer took what we had for it (:data:`CONTROL_WRITE_LIMIT`)."""
        try:
            await self.writer.drain()
        except (ConnectionError, OSError):
            return  # the connection went: its end fails the link
        self._write_blocked = False
        self._pace_reading()

    def _pace_reading(self) -> None:
        """Pause or resume reading the control connection as :data:`CONTROL_TURN_BYTES` and
        :data:`CONTROL_WRITE_LIMIT` say."""
        if self.down:
            return
        paused = self._turn_skipped or self._write_blocked
        if paused != self._read_paused:
            self._read_paused = paused
            transport = cast(asyncio.Transport, self.writer.transport)  # a TCP connection's: it reads too
            if paused:
                transport.pause_reading()
            else:
                transport.resume_reading()

    def _control_end(self, exc: BaseException | None) -> None:
        """The control connection ended (``None``: the peer closed it)."""
        self._peer_closed("IncompleteReadError" if exc is None else type(exc).__name__)  # as a short read said

    def _peer_closed(self, what: str) -> None:
        """The peer's end of the control connection is gone: the link failed, unless we sent UNLINK. The peer
        answers that and closes its end, which we can see before our unlink gets to close() (our reader's end
        of stream, or a held same-host push's check): that is the unlink going through, so what waits on the
        link reads "unlinked" (LLM_NOT_YET_LINK) and the data channels close gracefully, as close() does
        (row 275). (A peer that crashes instead of answering is then told apart by the unlink: no answer.)"""
        if self.unlinking and not self.down:
            self._unlinked_down("unlinked")
            return
        self.fail(LLMException(f"connection lost ({what})", status_code=LLMStatusCode.LLM_LINK_FAILED))

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

    def _wrong_answer(self, msg: Msg, req_id: int) -> str:
        """Why ``msg`` cannot answer our request ``req_id``, waited for in ``pending`` ("" when it can, or
        when nobody waits): a transfer waits for ``RESP`` or ``DONE`` (a status and a text), a ``PROBE`` or an
        ``UNLINK`` for its own answer (``expect``); another kind is a lie its waiter must not read. The waiter
        is looked up here, not by the caller, so that the error raised holds no frame that holds it (and the
        caches its transfer keeps alive) while the link's failure is logged."""
        fut = self.pending.get(req_id)
        if fut is None or fut.done():
            return ""
        wanted = self._acks.get(req_id)
        if msg is wanted or (wanted is None and msg in TRANSFER_REPLIES):
            return ""
        return f"{msg.name} answers request {req_id}, which waits for " \
               f"{wanted.name if wanted is not None else 'RESP or DONE'}"

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
        self._teardown(LLMException(f"link to cluster {self.remote_cluster_id} was unlinked",
                                    status_code=LLMStatusCode.LLM_NOT_YET_LINK))

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
        return self.counters.snapshot(self.remote_role, self.link_id, self.transport, off)

    async def settle_served(self, *, pushes_only: bool = False) -> None:
        """Before the peer hears that the link ends (our ``UNLINK``, or our answer to its own): serve no new
        request of its, stop the jobs we serve it and wait until they ended (at most
        :data:`SERVED_SETTLE_S`). A stream job ends at once; a same-host push's copy once its current piece is
        done; a staged one (a device cache) once the device copies it queued are done. The data channels stay
        up meanwhile, so the peer sees no reset before it hears from us. A peer's push we stopped fails there
        when it hears, with nothing of it landing here afterwards, nor its source read any more.

        ``pushes_only`` (our own unlink): only the jobs that write here or read the peer's memory, the peer's
        pushes we receive or copy; its pulls end with the link as before (a pull the peer copies itself, in
        place, is its own job, and stopping it here would give back a key its copy then takes)."""
        self.ending = True
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
            if ack:
                self._report_reads()
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
