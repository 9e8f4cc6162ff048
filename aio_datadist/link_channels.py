"""A link's data channels: the pool of our own, their redials, the peer's resets, the bytes moved on one.

A link (:class:`~aio_datadist.links.Link`) has ``2 * aio.DataChannels`` data
connections that carry bulk bytes only: channels ``[0, N)`` carry requests
the client makes, ``[N, 2N)`` requests the server makes. :class:`LinkChannels`,
the link's base class, holds them (one :class:`_Channel` each: its connection,
the generation it was attached at, the jobs on it). A transfer takes one of
our own channels (``acquire``) and gives it back (``release``); a channel
whose byte stream went out of step is closed on both ends (``reset_channel``),
and the client dials it again at the next generation (``_redial``) while the
peer's requests for it wait (``_defer``). ``move`` runs a job on a channel: on
the event loop (``loop_io``) up to :data:`LOOP_IO_MAX`, else on the core's
:class:`~aio_datadist._core.SocketEngine`, or on a TLS channel. What it needs
of the rest of the link (its state, sending a control message, failing it)
the link supplies.
"""

from __future__ import annotations

import asyncio
import functools
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aio_datadist import wire
from aio_datadist._core import LoopJob
from aio_datadist._env import env_int
from aio_datadist.loop_io import LoopIo
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.transport import tls
from aio_datadist.wire import Msg

if TYPE_CHECKING:
    from aio_datadist.runtime import Runtime

#: Jobs on plain data channels up to this size are driven by the event loop itself (``loop_io``), larger
#: ones by the native SocketEngine's thread. ``$AIO_DATADIST_LOOP_IO_MAX`` (bytes) overrides it; 0 sends
#: every job through the engine thread (for comparisons: ``docs/transports.md``).
LOOP_IO_MAX = env_int("AIO_DATADIST_LOOP_IO_MAX", 16 << 20)
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


class LinkChannels:
    """The data channels of a link (see the module's docstring); a base of :class:`~aio_datadist.links.Link`.

    ``channels``: how many each side's requests use (``aio.DataChannels``); ``redial`` dials a reset
    channel again (the client does).
    """

    if TYPE_CHECKING:  # what the link supplies (``links.Link``)
        runtime: Runtime
        remote_cluster_id: int
        remote_address: tuple[str, int]
        token: bytes
        is_client: bool
        closed: bool
        unlinking: bool
        on_request: Callable[[Any, Msg, int, Any], None] | None

        @property
        def down(self) -> bool: ...
        def check(self) -> None: ...
        def fail(self, exc: LLMException) -> None: ...
        def spawn(self, coro: Any) -> asyncio.Task: ...
        def send(self, msg: Msg, req_id: int, **fields: Any) -> None: ...
        def _refuse_after_unlink(self) -> None: ...

    def __init__(self, channels: int, *, is_client: bool, redial: Redial) -> None:
        self._redial_data = redial
        self.nchannels = channels
        self.channels = [_Channel(i) for i in range(2 * channels)]
        self.own = range(0, channels) if is_client else range(channels, 2 * channels)
        self.free: asyncio.Queue[int] = asyncio.Queue()
        self._resets: dict[tuple[int, int], asyncio.Future] = {}  # (channel, generation): see peer_reset
        self._peer_reset_to: dict[int, int] = {}  # channel -> the newest generation of it the peer ABORTed
        self.redialling: dict[int, asyncio.Future] = {}
        self._redial_to: dict[int, int] = {}  # the generation each channel in ``redialling`` is dialled at
        self._stale_redials: set[int] = set()  # ... which the peer reset before we installed it (its ABORT)
        # Peer requests waiting for a channel we redial, by request id: the channel; and per channel how many
        # such waits are under way (a request the peer aborted meanwhile still waits, and is then dropped).
        # At most MAX_SERVED_PER_CHANNEL per channel, and one per request id; another request is served at once,
        # that is refused (its channel is down), so a peer cannot have us hold its requests' rows without bound
        # while it delays the redial's ATTACH_OK.
        self.deferred: dict[int, asyncio.Task] = {}
        self._deferring: dict[int, int] = {}

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
