"""A link's control connection: what we send on it, the answers we wait for, how we read it, the heartbeat.

:class:`LinkControl`, a base of :class:`~aio_datadist.links.Link`, holds the
link's control connection (asyncio streams, framed messages): the records we
send, at once or with the next write (``send_soon``); the waiters for the
peer's answers to our requests (``expect``) and for the link's end
(``watch``); the reading of it, each chunk handed to the link's
:class:`~aio_datadist.protocol.LinkProtocol` and paced so that a peer that
floods it or never reads its answers holds neither our loop nor our memory
(:data:`CONTROL_TURN_BYTES`, :data:`CONTROL_WRITE_LIMIT`); and the heartbeat
that fails the link of a peer gone silent. What each message means, and the
link's state and end, are the link's (``Link._dispatch``, ``Link.fail``).
"""

from __future__ import annotations

import asyncio
import select
import time
from typing import TYPE_CHECKING, Any, cast

from aio_datadist import _core, _trace, protocol, wire
from aio_datadist.control_reader import ControlReader
from aio_datadist.refusal_log import RefusalLog
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.transport import base as transport_base
from aio_datadist.wire import Msg, ProtocolError

#: Control connections broken by a peer's malformed bytes: a peer that links again and again (anyone, without a
#: shared secret) would have each write a WARNING (found by a hunt: 274 a second); paced, one with a count.
_PROTOCOL_ERRORS = RefusalLog(counted="more protocol errors")

if TYPE_CHECKING:
    import logging

    from aio_datadist.runtime import Runtime

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


def _hung_up(fd: int) -> bool:
    """Whether the peer of connected socket ``fd`` closed its end (or it failed), bytes still queued before the end
    or not (``POLLRDHUP``: the close peek sees only an empty queue's end). Never blocks."""
    poller = select.poll()
    poller.register(fd, select.POLLRDHUP)
    return any(events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, events in poller.poll(0))


class LinkControl:
    """The control connection of a link (see the module's docstring); a base of :class:`~aio_datadist.links.Link`.

    ``reader`` and ``writer`` are the connection's; ``is_client``: whether we dialled the link (our
    request ids are odd, the peer's even).
    """

    if TYPE_CHECKING:  # what the link supplies (``links.Link``)
        runtime: Runtime
        remote_cluster_id: int
        link_id: int
        log: logging.LoggerAdapter[logging.Logger]
        closed: bool
        unlinking: bool

        @property
        def down(self) -> bool: ...
        def check(self) -> None: ...
        def fail(self, exc: LLMException) -> None: ...
        def spawn(self, coro: Any) -> asyncio.Task: ...
        def _unlinked_down(self, why: str) -> None: ...
        def _dispatch(self, event: protocol.Event) -> None: ...

    def __init__(self, reader: ControlReader, writer: asyncio.StreamWriter, *, is_client: bool) -> None:
        self.reader = reader
        self.writer = writer
        self._soon: list[bytes] = []  # records send_soon holds until the next write or the end of this loop pass
        self._probe_id = 0  # the id of the heartbeat PROBE in flight, and when it left
        self._probe_sent = 0.0
        self.pending: dict[int, asyncio.Future] = {}
        self._acks: dict[int, Msg] = {}  # requests of ours in pending answered by PROBE_ACK or UNLINK_ACK (expect)
        #: The waiter for a request's reply after its answer, and the kind that reply may be (expect).
        self._then: dict[int, tuple[asyncio.Future, Msg | None]] = {}
        self._watches: set[asyncio.Future] = set()  # futures only the link's end completes (watch)
        self._next_req = 1 if is_client else 2
        self.last_heard = 0.0
        self._protocol = protocol.LinkProtocol(is_client)
        self._turn_skipped = False  # the control connection is not read until the loop's next turn
        self._write_blocked = False  # nor until the peer took what we have for it (CONTROL_WRITE_LIMIT)
        self._read_paused = False  # whether we paused reading it (for either reason)

    def new_req_id(self) -> int:
        rid = self._next_req
        self._next_req += 2
        return rid

    def is_mine(self, req_id: int) -> bool:
        """Whether ``req_id`` names a request of ours (the protocol's parity rule)."""
        return self._protocol.is_mine(req_id)

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
        if _trace.ON:
            _trace.mark("control: chunk read")
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
            _PROTOCOL_ERRORS.note("link %s to cluster %s: protocol error: %s", self.link_id, self.remote_cluster_id,
                                  exc, logger=self.log)  # (with the link's fields)
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
        connection, and its end, seen here before any copy starts, fails the link: also when more of the
        connection is still queued than the chunk held (a read takes at most 256 KiB, 64 KiB on uvloop), its end
        behind it (``_hung_up``: found by audit, a small push's request ending one chunk, the pusher's ``ABORT``
        and close in the next, was copied after the push had raised)."""
        if self.down:
            return
        fd = self._control_fd()
        if fd is not None and (_core.peer_closed(fd) or _hung_up(fd)):
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
