"""Pipelined staging of cache rows through a bounded set of host chunk buffers.

Device memory cannot go to a socket (or to a host copy thread) directly: it
passes through page-locked host buffers. This module cuts a transfer into
chunks and moves them through a fixed pool of buffers so that both sides
overlap and memory stays bounded whatever the request size:

* sending (:func:`pipeline_out`): the device gather of chunk n+1 into one
  buffer runs while chunk n is consumed (sent) from another;
* receiving (:func:`pipeline_in`): chunk n+1 is received into one buffer
  while the device scatters chunk n from another.

The byte order of a transfer is the wire order everywhere in the library:
tensor-major, then the request's row order, then bytes within the row range
(``_core.segments``). A chunk is a contiguous range of that stream, described
as at most three rectangles (a tensor range x a row-index range x a byte
range), each of which is one batched device copy (``devices/copies.py``).

The planner and the pool/pipeline logic know nothing about devices: the
caller supplies the stage and consume/fill coroutines. :class:`DeviceStaging`
supplies the device stages (gather into / scatter from a chunk on the
backend's copy stream, completed through the StreamNotifier), and
:func:`swap_staged` uses it for host<->device swaps where the driver has no
batched copies.

Hook for the transfer layer (not wired here): for a device cache,

* the owner serving a pull calls ``staging.send(cache, first, count, rows,
  offset, nbytes, consume)`` with ``consume(chunk, view)`` = one
  ``SocketEngine.submit_send`` of ``[view address, len(view)]``;
* the puller calls ``staging.receive(cache, ..., fill)`` with ``fill`` = one
  ``submit_recv`` into the view; pushes are the same with the roles swapped.
"""

from __future__ import annotations

import asyncio
import functools
import traceback
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from aio_datadist import _core
from aio_datadist.cache import KvCache
from aio_datadist.devices.copies import buffer_side, cache_side, enqueue_rows
from aio_datadist.option_checks import DEFAULT_STAGING_BUFFERS
from aio_datadist.status import LLMException, LLMStatusCode

if TYPE_CHECKING:
    from aio_datadist._completion import Completions
    from aio_datadist.devices.backend import DeviceBackend

__all__ = ["Chunk", "DeviceStaging", "Rect", "StagingPool", "pipeline_in", "pipeline_out", "plan_chunks",
           "settle_all", "swap_staged", "DEFAULT_CHUNK_BYTES", "DEFAULT_BUFFERS"]

DEFAULT_CHUNK_BYTES = 16 << 20
DEFAULT_BUFFERS = DEFAULT_STAGING_BUFFERS  # aio.StagingBuffers
#: The most buffers one link holds at once, whatever the pool's size (its sends one fewer: a gather running ahead
#: of the chunk on the socket), so that a larger pool (``aio.StagingBuffers``) keeps room for the other links
#: while more links' peers stop taking their bytes, instead of letting each of those hold more.
LINK_SHARE = 3
#: What an allocator raises for want of memory (``torch.OutOfMemoryError`` since torch 2.5; CUDA's before).
_OUT_OF_MEMORY = (MemoryError, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))
MIN_CHUNK_BYTES = 4096
_ALIGN = 64


@dataclass(frozen=True)
class Rect:
    """Tensors ``[t0, t0+tensors)`` x row indices ``[r0, r1)`` x bytes ``[offset, offset+length)`` of each row."""

    t0: int
    tensors: int
    r0: int
    r1: int
    offset: int
    length: int

    @property
    def nbytes(self) -> int:
        return self.tensors * (self.r1 - self.r0) * self.length


@dataclass(frozen=True)
class Chunk:
    """A contiguous range of a transfer's byte stream, starting ``position`` bytes in."""

    index: int
    position: int
    rects: tuple[Rect, ...]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rects)


def plan_chunks(tensors: int, rows: int, nbytes: int, chunk_bytes: int) -> list[Chunk]:
    """Cut ``tensors x rows`` units of ``nbytes`` (wire order) into chunks of at most ``chunk_bytes``.

    Units up to ``chunk_bytes`` are never split: a chunk holds as many whole
    units as fit. A larger unit is split into equal pieces (64-byte
    multiples) of at most ``chunk_bytes``, one per chunk.
    """
    if tensors < 0 or rows < 0 or nbytes <= 0:
        raise ValueError("tensors and rows must be >= 0 and nbytes > 0")
    if chunk_bytes < MIN_CHUNK_BYTES or chunk_bytes % _ALIGN:
        raise ValueError(f"chunk_bytes must be a multiple of {_ALIGN} and at least {MIN_CHUNK_BYTES}")
    units = tensors * rows
    chunks: list[Chunk] = []
    position = 0
    if nbytes <= chunk_bytes:
        per = chunk_bytes // nbytes
        for u0 in range(0, units, per):
            rects = _unit_rects(u0, min(u0 + per, units), rows, nbytes)
            chunks.append(Chunk(len(chunks), position, rects))
            position += chunks[-1].nbytes
        return chunks
    parts = -(-nbytes // chunk_bytes)
    piece = _round_up(-(-nbytes // parts), _ALIGN)
    for u in range(units):
        t, r = divmod(u, rows)
        for off in range(0, nbytes, piece):
            rect = Rect(t, 1, r, r + 1, off, min(piece, nbytes - off))
            chunks.append(Chunk(len(chunks), position, (rect,)))
            position += rect.nbytes
    return chunks


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _unit_rects(u0: int, u1: int, rows: int, nbytes: int) -> tuple[Rect, ...]:
    t0, r0 = divmod(u0, rows)
    t1, r1 = divmod(u1, rows)
    if t0 == t1:
        return (Rect(t0, 1, r0, r1, 0, nbytes),)
    out = []
    if r0:
        out.append(Rect(t0, 1, r0, rows, 0, nbytes))
        t0 += 1
    if t1 > t0:
        out.append(Rect(t0, t1 - t0, 0, rows, 0, nbytes))
    if r1:
        out.append(Rect(t1, 1, 0, r1, 0, nbytes))
    return tuple(out)


class StagingPool:
    """At most ``buffers`` chunk buffers of ``chunk_bytes``, allocated on demand and reused.

    :meth:`acquire` waits while all of them are taken. A buffer that device
    or native work may still touch is :meth:`retire` d instead of released:
    it still counts against the bound until the last reference to it (held
    by that work's completion) goes, and is then replaced.

    The pool is the endpoint's, shared by every link. A ``holder`` (a link)
    holds at most ``share`` buffers at once (:data:`LINK_SHARE`, and all but
    one of a smaller pool, by default), so one link whose peer stops taking
    its bytes (a served pull it never reads, held up to the request's own
    timeout) cannot take every buffer from the other links' transfers, and a
    pool of ``B`` buffers stays open to them while fewer than ``B / 2``
    links' sends are held so. A sender asks with ``room=1`` and leaves one of
    its link's share to that link's receives: two ends that send and receive
    on one link at once do not each hold what the other's receive waits for.
    """

    def __init__(self, chunk_bytes: int, buffers: int,
                 allocate: Callable[[int], torch.Tensor] | None = None, share: int | None = None) -> None:
        if chunk_bytes < MIN_CHUNK_BYTES or chunk_bytes % _ALIGN:
            raise ValueError(f"chunk_bytes must be a multiple of {_ALIGN} and at least {MIN_CHUNK_BYTES}")
        if buffers < 1:
            raise ValueError("buffers must be >= 1")
        self.chunk_bytes = chunk_bytes
        self.buffers = buffers
        #: The most buffers one holder has at once.
        self.share = max(1, min(buffers - 1, LINK_SHARE)) if share is None else max(1, min(share, buffers))
        self._held: dict[Any, int] = {}  # holder -> buffers it has
        self._holder_of: dict[int, Any] = {}  # id(buffer) -> its holder, while held
        self._allocate = allocate or (lambda n: torch.empty(n, dtype=torch.uint8))
        self._free: list[torch.Tensor] = []
        self._live = 0
        self.peak = 0
        self._waiters: deque[tuple[asyncio.Future, Any, int]] = deque()  # (wakeup, holder, room)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def bound_bytes(self) -> int:
        """The most memory the pool ever holds."""
        return self.chunk_bytes * self.buffers

    @property
    def live(self) -> int:
        """Buffers that exist now (free, in use or retired)."""
        return self._live

    @property
    def idle(self) -> int:
        return len(self._free)

    def held(self, holder: Any) -> int:
        """Buffers ``holder`` has now."""
        return self._held.get(holder, 0)

    async def acquire(self, holder: Any = None, room: int = 0) -> torch.Tensor:
        """A buffer, waiting while none is free or ``holder`` has its share (less ``room``)."""
        self._loop = asyncio.get_running_loop()
        while True:
            if self._closed:
                raise LLMException("the staging pool is closed", status_code=LLMStatusCode.LLM_FAILED)
            # A buffer that cannot be made for want of memory fails here at once, also while other transfers hold
            # buffers: waiting for theirs deadlocks two ends that stage to each other (each end's send holds its
            # link's share and waits for the peer's receive, which waits the same way; found by a review).
            buf = self._take(holder, room)
            if buf is not None:
                return buf
            waiter = self._loop.create_future()
            entry = (waiter, holder, room)
            self._waiters.append(entry)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # woken, then given up before it ran: pass the wakeup on to the next waiter
                raise
            finally:
                if entry in self._waiters:
                    self._waiters.remove(entry)

    def try_acquire(self, holder: Any = None, room: int = 0) -> torch.Tensor | None:
        """A buffer if one is free or may be made now and ``holder`` is within its share (less ``room``), else
        None (never waits). Waiters that may take a buffer come first, also those woken that have not run yet.
        A new buffer that cannot be made for want of memory is None too: the caller goes on with what it holds
        (a pipelined send or receive), and only a transfer that holds none fails for it (:meth:`acquire`)."""
        if self._closed or any(self._within(h, r) for _, h, r in self._waiters):
            return None
        try:
            return self._take(holder, room)
        except LLMException as exc:
            if exc.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY:
                return None
            raise

    def _within(self, holder: Any, room: int) -> bool:
        """Whether ``holder`` may have one more buffer: below its share, less ``room`` (never below one)."""
        return holder is None or self._held.get(holder, 0) < max(1, self.share - room)

    def _take(self, holder: Any = None, room: int = 0) -> torch.Tensor | None:
        """A free buffer, or a new one within the bound, or None (also when ``holder`` has its share)."""
        if not self._within(holder, room):
            return None
        if self._free:
            buf = self._free.pop()
        elif self._live < self.buffers:
            try:
                buf = self._allocate(self.chunk_bytes)
            except (RuntimeError, MemoryError) as exc:
                # A shortage (which a requester may retry) only when it says so: torch's CPU allocator raises a plain
                # RuntimeError ("can't allocate memory"), CUDA's OutOfMemoryError; a device fault is a failure.
                short = isinstance(exc, _OUT_OF_MEMORY) or any(
                    words in str(exc) for words in ("can't allocate memory", "out of memory"))
                raise LLMException(f"a staging buffer of {self.chunk_bytes} bytes could not be allocated: {exc}",
                                   status_code=LLMStatusCode.LLM_OUT_OF_MEMORY if short
                                   else LLMStatusCode.LLM_FAILED) from None
            self._live += 1
            self.peak = max(self.peak, self._live)
            weakref.finalize(buf, self._gone)
        else:
            return None
        if holder is not None:
            self._held[holder] = self._held.get(holder, 0) + 1
            self._holder_of[id(buf)] = holder
        return buf

    def _let_go(self, buf: torch.Tensor) -> None:
        holder = self._holder_of.pop(id(buf), None)
        if holder is not None:
            left = self._held[holder] - 1
            if left:
                self._held[holder] = left
            else:
                del self._held[holder]

    def release(self, buf: torch.Tensor) -> None:
        """Give back a buffer nothing touches any more."""
        self._let_go(buf)
        if self._closed:
            return
        self._free.append(buf)
        self._wake()

    def retire(self, buf: torch.Tensor) -> None:
        """Give up a buffer that pending work may still touch (it is replaced once it is gone: once the
        completions holding it let it go, so its holders must drop their own references, including those
        of frames an exception's traceback keeps). Its holder's share is back at once."""
        self._let_go(buf)
        self._wake()

    def close(self) -> None:
        self._closed = True
        self._free.clear()
        for waiter, _, _ in self._waiters:
            if not waiter.done():
                # Woken, not cancelled: its acquire raises LLM_FAILED "closed". A cancel reached the caller as a
                # CancelledError it never asked for, which asyncio takes for a cancellation (row 290).
                waiter.set_result(None)

    def _gone(self) -> None:
        self._live -= 1
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._wake()
        else:
            loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        # Every waiter looks again, oldest first: one that has its share waits on, and a later one may take the
        # buffer (waking only the oldest left a buffer free behind a waiter at its share). They stay listed until
        # they ran (``acquire`` takes itself off), so ``try_acquire`` does not take the buffer before them.
        for waiter, _, _ in self._waiters:
            if not waiter.done():
                waiter.set_result(None)


Stage = Callable[[Chunk, torch.Tensor], Awaitable[Any]]
Use = Callable[[Chunk, torch.Tensor], Awaitable[Any]]


class _StageWatch:
    """A pipeline's first failed stage, which cuts the socket job the pipeline waits on meanwhile: a fill or
    consume that waits on a slow peer would hide the device's failure until the peer's next chunk, or until
    the transfer timed out and said so instead."""

    def __init__(self) -> None:
        self.failure: BaseException | None = None
        self._job: asyncio.Future | None = None
        task = asyncio.current_task()  # not kept: a failure's traceback would tie it to its exception in a cycle
        self._cancelling = task.cancelling() if task is not None else 0  # a task in its cleanup may be at 1

    def staged(self, fut: asyncio.Future) -> None:
        """A stage's done-callback."""
        if self.failure is None and not fut.cancelled() and fut.exception() is not None:
            self.failure = fut.exception()
            if self._job is not None:
                self._job.cancel()

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    async def run(self, job: Awaitable[Any]) -> None:
        """Await ``job``; if a stage fails meanwhile, cancel it, and once it is over raise that failure (a
        cancel of our own task still goes on as one)."""
        self._job = fut = asyncio.ensure_future(job)
        try:
            await fut
        except (Exception, asyncio.CancelledError):
            task = asyncio.current_task()
            if self.failure is None or (task is not None and task.cancelling() > self._cancelling):
                raise
        finally:
            self._job = None
        self.check()


async def pipeline_out(chunks: Sequence[Chunk], pool: StagingPool, stage: Stage, consume: Use,
                       holder: Any = None) -> None:
    """Stage every chunk into a buffer, then consume it, overlapping the two.

    ``stage(chunk, buf)`` fills ``buf`` (a device gather) and must keep
    ``buf`` referenced by its native completion; ``consume(chunk, view)``
    uses the ``chunk.nbytes`` bytes (sends them). Up to ``pool.buffers``
    stages run ahead of the consumer, as far as ``holder``'s share allows. On
    any failure or cancellation the pending stages are cancelled and their
    buffers retired; a stage that fails while ``consume`` runs cancels it.
    """
    pending: deque[tuple[Chunk, torch.Tensor, asyncio.Future]] = deque()
    watch = _StageWatch()
    nxt = 0
    buf: torch.Tensor | None = None
    try:
        while nxt < len(chunks) or pending:
            while nxt < len(chunks) and len(pending) < pool.buffers:
                # Wait for a buffer only while holding none: the pool is shared by every transfer of the
                # endpoint, and senders that each held some and waited for more would wait for each other.
                # A send leaves one of its link's share to that link's receives (``room``).
                buf = pool.try_acquire(holder, 1) if pending else await pool.acquire(holder, 1)
                if buf is None:
                    break
                try:
                    staging = asyncio.ensure_future(stage(chunks[nxt], buf))
                except BaseException:  # refused before it was queued (may have queued part): held by nobody
                    pool.retire(buf)
                    raise
                staging.add_done_callback(watch.staged)
                pending.append((chunks[nxt], buf, staging))
                nxt += 1
            chunk, buf, fut = pending.popleft()
            try:
                await fut
                watch.check()  # a later stage failed while we waited for this one: no send to wait on the peer for
                await watch.run(consume(chunk, buf[:chunk.nbytes]))
            except BaseException as exc:
                pool.retire(buf)
                _forget_frames(exc)
                raise
            pool.release(buf)
    finally:
        while pending:
            _, buf, fut = pending.popleft()
            _abandon(fut)
            pool.retire(buf)
        buf = None  # the traceback of a failure keeps this frame: it must not keep a retired buffer too


async def pipeline_in(chunks: Sequence[Chunk], pool: StagingPool, fill: Use, stage: Stage,
                      holder: Any = None) -> None:
    """Fill a buffer with each chunk, then stage it out, overlapping the two.

    ``fill(chunk, view)`` writes the chunk's bytes (receives them);
    ``stage(chunk, buf)`` moves them on (a device scatter) and must keep
    ``buf`` referenced by its native completion. A buffer goes back to the
    pool when its stage succeeded, and is retired otherwise. Returns once
    every stage finished; the first failure cancels the rest, and the fill
    running then.
    """
    staged: deque[asyncio.Future] = deque()
    watch = _StageWatch()

    def settle(buf: torch.Tensor, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            pool.retire(buf)
        else:
            pool.release(buf)

    buf: torch.Tensor | None = None
    try:
        for chunk in chunks:
            watch.check()
            # While its stages hold buffers, a receive takes another only if one is there to take (a buffer that
            # cannot be made for want of memory included): else it waits for its own oldest stage, which gives
            # one back; only a receive that holds none waits in (or fails out of) the pool.
            buf = pool.try_acquire(holder) if staged else None
            while buf is None and staged:
                await staged[0]
                staged.popleft().result()
                buf = pool.try_acquire(holder) if staged else None
            if buf is None:
                buf = await pool.acquire(holder)
            try:
                watch.check()  # a stage failed while we waited for a buffer: no fill to wait on the peer for
                await watch.run(fill(chunk, buf[:chunk.nbytes]))
            except BaseException as exc:
                pool.retire(buf)
                _forget_frames(exc)
                raise
            try:
                fut = asyncio.ensure_future(stage(chunk, buf))
            except BaseException:  # refused before it was queued (may have queued part): held by nobody
                pool.retire(buf)
                raise
            fut.add_done_callback(functools.partial(settle, buf))
            fut.add_done_callback(watch.staged)
            staged.append(fut)
            buf = None
            while staged and staged[0].done():
                staged.popleft().result()
        while staged:
            await staged[0]
            staged.popleft()
    finally:
        buf = None  # the traceback of a failure keeps this frame: it must not keep a retired buffer too
        while staged:
            _abandon(staged.popleft())


async def settle_all(futures: Sequence[asyncio.Future]) -> None:
    """Wait until every future in ``futures`` (each set once a native job reported over) is done,
    through cancellations, which are raised again afterwards."""
    cancelled: asyncio.CancelledError | None = None
    for fut in futures:
        while not fut.done():
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError as exc:
                cancelled = exc
    if cancelled is not None:
        raise cancelled


def _forget_frames(exc: BaseException) -> None:
    """Clear the locals of the frames ``exc`` passed through below this one (the consume or fill and what it
    awaited, all over by now): they hold views of a buffer just retired, which a caller keeping the error (a list
    of failures, ``gather(return_exceptions=True)``) would otherwise keep counted against the pool for ever."""
    tb = exc.__traceback__
    if tb is not None:
        traceback.clear_frames(tb.tb_next)


def _abandon(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.cancel()
    else:
        # Retrieve it so an error already raised elsewhere is not reported twice.
        fut.cancelled() or fut.exception()


class DeviceStaging:
    """Device stages for the pipelines: gather rows into a chunk buffer, scatter them back.

    Buffers are page-locked where the backend can (CUDA), so the device
    copies into and out of them are asynchronous. Each stage is one
    completion on the backend's copy stream, awaited through ``completions``
    (the endpoint's :class:`~aio_datadist._completion.Completions`).
    """

    def __init__(self, completions: Completions, backend: DeviceBackend, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 buffers: int = DEFAULT_BUFFERS, method: str | None = None) -> None:
        self.completions = completions
        self.backend = backend
        self.method = method or ("batch" if backend.batch_copies else "torch")
        pin = backend.pins_tables
        self.pool = StagingPool(chunk_bytes, buffers,
                                lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=pin))

    def plan(self, count: int, rows: int, nbytes: int) -> list[Chunk]:
        return plan_chunks(count, rows, nbytes, self.pool.chunk_bytes)

    def _stage(self, chunk: Chunk, buf: torch.Tensor, cache: KvCache, first: int, rows: Sequence[int],
               offset: int, to_device: bool, what: str, settles: list[asyncio.Future]) -> asyncio.Future:
        pairs = []
        pos = 0
        for rect in chunk.rects:
            dev = cache_side(cache, rows[rect.r0:rect.r1], offset + rect.offset, rect.length,
                             first + rect.t0, rect.tensors)
            host = buffer_side(buf, pos, rect.tensors, rect.r1 - rect.r0, rect.length)
            pos += rect.nbytes
            pairs.append(((dev, host) if to_device else (host, dev), rect.length))
        backend, method, keep = self.backend, self.method, [buf, cache]
        settled = asyncio.get_running_loop().create_future()
        settles.append(settled)

        def enqueue() -> None:
            for (dst, src), length in pairs:
                enqueue_rows(backend, dst, src, length, method, keep)

        def submit(token: int) -> None:
            # Some rectangles may be enqueued when one fails: the backend holds ``keep`` (the chunk
            # buffer among it) until its stream drained, so the buffer is not reused under the copy.
            backend.enqueue_and_notify(token, enqueue, chunk.nbytes, keep, what)

        try:
            return self.completions.start(submit, backend.cancel, timeout_ms=None, what=what, keepalive=keep,
                                          settled=settled)
        except BaseException:
            # Refused before anything was queued (the engine closed: finalize), or after what it queued drained
            # (``Completions.start`` set ``settled`` then): nothing of it is left to wait for (``settle_all``
            # waited for it for ever, found by a hunt, 2026-12-07).
            if not settled.done():
                settled.set_result(None)
            raise

    async def send(self, cache: KvCache, first: int, count: int, rows: Sequence[int], offset: int, nbytes: int,
                   consume: Use, what: str = "staged send", holder: Any = None) -> None:
        """Gather rows of tensors ``[first, first+count)`` chunk by chunk and hand each to ``consume``, with
        ``holder``'s share of the pool's buffers (its link's).

        Returns or raises only once every gather it enqueued is done on the
        stream (a cancelled one included)."""
        rows = list(rows)
        chunks = self.plan(count, len(rows), nbytes)
        settles: list[asyncio.Future] = []
        try:
            await pipeline_out(chunks, self.pool,
                               lambda c, b: self._stage(c, b, cache, first, rows, offset, False, what, settles),
                               consume, holder)
        finally:
            await settle_all(settles)

    async def receive(self, cache: KvCache, first: int, count: int, rows: Sequence[int], offset: int,
                      nbytes: int, fill: Use, what: str = "staged receive", holder: Any = None) -> None:
        """Take each chunk from ``fill`` and scatter it into rows of tensors ``[first, first+count)``, with
        ``holder``'s share of the pool's buffers.

        Returns or raises only once every scatter it enqueued is done on the
        stream (a cancelled one included): no byte lands in ``cache`` after."""
        rows = list(rows)
        chunks = self.plan(count, len(rows), nbytes)
        settles: list[asyncio.Future] = []
        try:
            await pipeline_in(chunks, self.pool, fill,
                              lambda c, b: self._stage(c, b, cache, first, rows, offset, True, what, settles),
                              holder)
        finally:
            await settle_all(settles)

    def close(self) -> None:
        self.pool.close()


def host_chunk_triples(cache: KvCache, first: int, rows: Sequence[int], offset: int, chunk: Chunk,
                       view: torch.Tensor, to_cache: bool) -> Any:
    """Host copy triples between ``chunk``'s rows of a host ``cache`` and the packed ``view``."""
    pairs = [cache.layout.segments(first + r.t0, r.tensors, list(rows[r.r0:r.r1]), offset + r.offset, r.length)
             for r in chunk.rects]
    mine = pairs[0]
    for more in pairs[1:]:
        mine.extend(more)
    packed = _core.segments(_u64([view.data_ptr()]), _i64([0]), 0, 0, chunk.nbytes)
    return _core.zip_segments(mine, packed) if to_cache else _core.zip_segments(packed, mine)


def _u64(values: list[int]) -> Any:
    import array

    return array.array("Q", values)


def _i64(values: list[int]) -> Any:
    import array

    return array.array("q", values)


async def swap_staged(staging: DeviceStaging, copier: _core.HostCopyEngine, dst: KvCache, dst_rows: Sequence[int],
                      src: KvCache, src_rows: Sequence[int], offset: int, nbytes: int, what: str,
                      host_jobs: set[int] | None = None) -> int:
    """Host<->device rows through the staging pipeline; the host side runs on ``copier``.

    Exactly one of ``dst``/``src`` is on the device. Returns the bytes moved. ``host_jobs``, when given, holds
    the tokens of the host copies running now (a caller that must stop them at once cancels and waits them).
    """
    count = dst.cache_desc.num_tensors

    async def host_copy(triples: Any, keep: Any) -> None:
        # Given up (a timeout, a cancel), the copy is stopped and waited for: a running chunk stops within
        # 1 MiB, and none of it may land in the caller's host cache after the swap returned.
        tokens: list[int] = []

        def submit(token: int) -> Any:
            tokens.append(token)
            if host_jobs is not None:
                host_jobs.add(token)
            return copier.submit(token, triples)

        try:
            await staging.completions.run(submit, copier.cancel, timeout_ms=None, what=what, keepalive=keep)
        finally:
            if host_jobs is not None:
                host_jobs.difference_update(tokens)

    if src.on_device:
        async def consume(chunk: Chunk, view: torch.Tensor) -> None:
            await host_copy(host_chunk_triples(dst, 0, dst_rows, offset, chunk, view, True), (view, dst))

        await staging.send(src, 0, count, src_rows, offset, nbytes, consume, what)
    else:
        async def fill(chunk: Chunk, view: torch.Tensor) -> None:
            await host_copy(host_chunk_triples(src, 0, src_rows, offset, chunk, view, False), (view, src))

        await staging.receive(dst, 0, count, dst_rows, offset, nbytes, fill, what)
    return count * len(dst_rows) * nbytes
