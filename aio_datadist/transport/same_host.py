"""The same-host plane: copies against a same-host peer's sealed, read-only shared caches.

A pull is one native copy by the requester out of the owner's region it
mapped read-only (``transport/local.py``), then ``DONE``; a pull of a blocks
cache the owner's read ledger lists (``transport/ledger.py``) does not ask
first, and tells the owner afterwards (``READ``). A push is
``PUSH_LOCAL``: the owner copies the rows out of the pusher's region itself
and answers once its copy is over, so no peer ever writes our memory. A copy
that is given up is stopped and waited for before the call returns.
"""

from __future__ import annotations

import array
import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from aio_datadist import _core, _trace
from aio_datadist._env import env_int
from aio_datadist.layers import one_side_span
from aio_datadist.stats import Outcome
from aio_datadist.status import LLMException, LLMStatusCode, code_to_status
from aio_datadist.transport import plane
from aio_datadist.transport.base import (
    UNLINKING,
    InPlacePlane,
    LinkPort,
    Refusal,
    Request,
    Served,
    abort_acknowledged,
    meets,
    push_torn,
    serve_timeout_ms,
    stop_status,
)
from aio_datadist.transport.fit import fit
from aio_datadist.wire import NO_GENERATION, Msg, PushLocalReq, ReqFlag, Resp, Target, TransferReq

if TYPE_CHECKING:
    from aio_datadist.cache import KvCache
    from aio_datadist.plans import Plan
    from aio_datadist.runtime import Runtime
    from aio_datadist.transport.local import LocalShare, PeerRegion

__all__ = ["PLANE", "SameHostPlane", "USE_STREAM", "run_copy_job"]

log = logging.getLogger("aio_datadist.local")

#: How long a given-up same-host copy may take to stop (it stops between chunks of at most 1 MiB).
COPY_SETTLE_S = 5.0
#: How long unregistering a registered cache waits, on the loop's thread, for a cut owner's copy into it to stop
#: (``serve_copy``; it stops within 1 MiB of copying, well under 1 ms on a copy thread that runs).
CUT_WAIT_S = 1.0
#: Source rows a same-host push may name (they travel as one opaque field); larger pushes stream.
MAX_LOCAL_SRC_ROWS = 32768
#: RESP.cache_id of an owner that cannot read a same-host push's source: the pusher streams it instead.
USE_STREAM = -2


#: Copies up to this many bytes run on the loop's thread when the runtime's copy threads have no job (a
#: 2 MiB copy takes 0.1-0.3 ms; its hand-off to a copy thread and the completion back cost about as much),
#: larger ones, or any while the threads have work, on the copy threads. ``$AIO_DATADIST_INLINE_COPY_MAX``
#: (bytes) overrides it; 0 hands every copy to the threads (for comparisons: ``docs/transports.md``).
INLINE_COPY_MAX = env_int("AIO_DATADIST_INLINE_COPY_MAX", 2 << 20)
#: Host copies of this many bytes or more in all (one pull's, one copy job's) write around the CPU caches
#: with streaming stores (``_core.set_stream_copy_min``; measured in ``benchmarks/RESULTS.md``, "streaming
#: stores"). ``$AIO_DATADIST_STREAM_COPY_MIN`` (bytes) overrides it; 18446744073709551615 turns them off (for
#: comparisons).
STREAM_COPY_MIN = env_int("AIO_DATADIST_STREAM_COPY_MIN", _core.stream_copy_min())
_core.set_stream_copy_min(STREAM_COPY_MIN)


class SameHostPlane(InPlacePlane):
    """Offered for pulls when the link shares memory; pushes go by :meth:`move_alone`."""

    name = "same-host"
    transport = "local"
    flag = ReqFlag.LOCAL

    async def prepare(self, rt: Runtime, link: LinkPort, plan: Plan, *, pull: bool, deadline: float) -> None:
        """Act on the owner's share records queued here before we ask: a cache it shared a moment ago is mapped
        and answered (``MAPPED``) ahead of our request, so the owner, which serves in place only what we mapped,
        reads our answer first. An answer the share socket did not take yet (the owner has not read our own
        records: a batch of caches we just allocated) is waited for only by a pull that must take this plane
        (``aio.RequireTransport=local``), at most ``local.ANSWERS_WAIT_S`` and half the time it has left: any
        other pull asks at once (the owner serves it over TCP if it has not heard our answer)."""
        share = link.local
        if share is None:
            return
        share.catch_up()
        if (share.answering and pull and self.can_carry(link, plan, pull=True)
                and not meets("tcp", rt.settings.require_transport)):
            left = deadline - asyncio.get_running_loop().time()
            await share.answers_left(left / 2)

    def can_carry(self, link: LinkPort, plan: Plan, *, pull: bool) -> bool:
        return pull and link.local is not None and not plan.by_address and not plan.local.on_device

    def reader(self, rt: Runtime, link: LinkPort, plan: Plan) -> Callable[[int, str], Awaitable[bool]] | None:
        """A pull of a blocks cache the owner's ledger lets us read without asking (``transport/ledger.py``),
        checked as the owner would check it; None for every other pull and whenever in doubt."""
        share, remote = link.local, plan.remote
        if (share is None or remote.target_kind != Target.BLOCKS_KEY or plan.local.on_device
                or not meets(self.transport, rt.settings.require_transport)):
            return None
        region = share.listed_region(remote.model_id)
        if region is None or region.geometry is None:
            return None
        try:
            rows, first, count = fit(region.geometry, remote, pull=True, row=None)
        except Refusal:
            return None  # the owner says why
        if count * len(rows) * remote.nbytes != plan.total:
            return None
        theirs = _core.segments(region.tensor_bases(first, count), array.array("q", rows), region.row_bytes,
                                remote.offset, remote.nbytes)
        return functools.partial(_read, rt, share, plan, region, _core.zip_segments(plan.local_pairs, theirs))

    async def carry(self, rt: Runtime, link: LinkPort, plan: Plan, answer: Resp, req: Request, *,
                    pull: bool) -> None:
        """One native copy out of the owner's mapped (read-only) cache, then ``DONE``."""
        share = link.local
        region = None if share is None else share.region(answer.cache_id)
        if region is None:
            if share is not None and not share.closed:
                # The owner withdrew it (its record's DEL, read before we got here): released after it answered,
                # as a hand-off's owner may. The link is fine; the cache is gone (as device IPC's, row 195).
                raise LLMException(f"cluster {link.remote_cluster_id} withdrew cache {answer.cache_id} (released: "
                                   "deallocated, unregistered or its last key gone) during the pull",
                                   status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
            raise LLMException(f"cluster {link.remote_cluster_id} shared cache {answer.cache_id} is not mapped",
                               status_code=LLMStatusCode.LLM_LINK_FAILED)
        remote = plan.remote
        first, count = one_side_span(len(region.offsets), (remote.layer_first, remote.layer_last),
                                     remote.tensor_num_per_layer, "src_layer_range")
        rows = list(remote.rows) or [answer.row]
        if (count != remote.tensor_count or not rows or min(rows) < 0 or max(rows) >= region.rows
                or remote.offset + remote.nbytes > region.row_bytes):
            raise LLMException(f"cluster {link.remote_cluster_id} shared a cache that does not fit the request",
                               status_code=LLMStatusCode.LLM_LINK_FAILED)
        theirs = _core.segments(region.tensor_bases(first, count), array.array("q", rows), region.row_bytes,
                                remote.offset, remote.nbytes)
        triples = _core.zip_segments(plan.local_pairs, theirs)
        assert share is not None, "the region is the share's"
        _check_halted(share)
        if _trace.ON:
            _trace.mark("job submitted")
        await copy_settled(rt, triples, plan.total, req.what, (plan.local, region), caches=(plan.local,), share=share)
        if _trace.ON:
            _trace.mark("job done")
        if req.cut:  # the destination was released (after the copy ended): fail, and the owner keeps a key
            raise LLMException(f"{req.what}: the cache was unregistered during the transfer",
                               status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
        await req.finish()  # DONE (a key's pull: now; else once we returned, ahead of what we send next)

    async def move_alone(self, rt: Runtime, link: LinkPort, plan: Plan, timeout_ms: int, what: str, *,
                         queue_ms: int | None = None) -> bool:
        """A same-host push: the owner copies the rows out of our shared (read-only) region itself.

        Returns False when the push must take the stream path instead (no
        share, a source whose record has not left, raw addresses, more
        source rows than one ``PUSH_LOCAL`` names; an owner that cannot map
        the source answers ``USE_STREAM``).
        A push that
        is given up (timeout, cancel) sends ``ABORT`` and returns once the
        owner answered that its copy stopped, at most ``ABORT_ACK_S`` later;
        an owner silent past that loses the link, so nothing it does
        afterwards is ours to wait for.
        """
        share = link.local
        if (share is None or plan.local.on_device or not share.offered(plan.local) or plan.by_address
                or len(plan.local_rows) > MAX_LOCAL_SRC_ROWS):
            return False  # device caches: the device IPC plane's move_alone
        return await push_local(link, plan, timeout_ms, what, queue_ms=queue_ms)

    def serves(self, link: LinkPort, msg: Msg, req: TransferReq, served: Served) -> bool:
        cache = served.cache
        return msg is Msg.PULL_REQ and cache is not None and link.local is not None and link.local.shared(cache)

    def serve_alone(self, rt: Runtime, link: LinkPort, req_id: int, req: Any, served: Served) -> None:
        """The owner's half of a same-host push: copy the pusher's rows out of its shared region into ours.

        The answer (``RESP``) is sent once the copy is over, never before: on
        success the rows are recorded as arrived; after an ``ABORT`` or a
        failure the copy has stopped by the time the pusher reads the answer.
        A push into a device cache is the device IPC plane's.
        """
        cache = served.cache
        if cache is not None and cache.on_device:
            plane("device-ipc").serve_alone(rt, link, req_id, req, served)
            return

        def answer(status: LLMStatusCode, text: str, cache_id: int = -1, total: int = 0) -> None:
            link.send(Msg.RESP, req_id, status=status, total=total, cache_id=cache_id, row=-1, text=text)

        try:
            source = _local_source(link, req, len(served.tensors), served.total)
        except Refusal as refusal:
            link.counters.refused("served_push", self.transport, refusal.code)
            answer(refusal.code, refusal.text)
            return
        if source is None:
            answer(LLMStatusCode.LLM_SUCCESS, "", cache_id=USE_STREAM)
            return
        assert cache is not None, "PUSH_LOCAL names a registered cache"
        src_pairs, region = source
        triples = _core.zip_segments(served.pairs, src_pairs)
        inline = (functools.partial(_core.copy_now, triples)
                  if copies_inline(rt, served.total) and _inline_this_pass(rt, served.total) else None)
        serve_copy(rt, link, req_id, req, served, lambda t: rt.copier.submit(t, triples), rt.copier.cancel,
                   (cache, region), self.transport, inline, rt.copier.wait)


def serve_copy(rt: Runtime, link: LinkPort, req_id: int, req: Any, served: Served, submit: Any, cancel: Any,
               keepalive: Any, transport: str, inline: Callable[[], Any] | None = None,
               wait: Callable[[int, float], bool] | None = None) -> None:
    """Run the owner's copy of a same-host push and answer ``RESP`` once it is over (never before); ``inline``,
    when given, is the copy run here and now instead of a job.

    ``wait(token, timeout)``, when given, blocks until the job ``token`` no longer writes: unregistering a
    registered (caller-owned) cache the copy writes then cancels it and waits for it before returning
    (``CacheRegistry.serving``), and the pusher is answered ``LLM_KV_CACHE_NOT_EXIST``."""
    cache = served.cache
    assert cache is not None, "PUSH_LOCAL names a registered cache"

    def answer(status: LLMStatusCode, text: str, cache_id: int = -1, total: int = 0) -> None:
        link.send(Msg.RESP, req_id, status=status, total=total, cache_id=cache_id, row=-1, text=text)

    counters, started = link.counters, link.counters.begin("served_push")

    def landed() -> None:
        counters.end("served_push", transport, served.total, started, Outcome.OK, LLMStatusCode.LLM_SUCCESS)
        for target, rows_tensors, rows in served.landed:
            rt.arrivals.record(target, rows_tensors, rows)
        answer(LLMStatusCode.LLM_SUCCESS, "", cache_id=cache.cache_id, total=served.total)

    if inline is not None:
        inline()
        landed()
        return
    settled = asyncio.get_running_loop().create_future()
    tokens: list[int] = []

    def submitted(token: int) -> Any:
        tokens.append(token)
        return submit(token)

    try:
        moved = rt.completions.start(submitted, cancel, timeout_ms=serve_timeout_ms(req),
                                     what=f"serving PUSH_LOCAL {req_id}", keepalive=keepalive, settled=settled)
    except LLMException as exc:
        counters.end("served_push", transport, served.total, started, Outcome.FAILED, exc.status_code)
        answer(exc.status_code, str(exc))
        return
    stopped: list[LLMStatusCode] = []  # how it counts, taken when the link stopped the copy (``stop_status``)

    def abort() -> None:
        stopped.append(stop_status(link))
        moved.cancel()

    link.serving[req_id] = abort
    link.local_pushes[req_id] = settled  # awaited by an unlink before the peer hears it (settle_served)
    told: list[str] = []  # why the copy was cut, when the caller unregistered the cache it writes (``cut``)

    def cut() -> None:
        # The caller unregistered the (registered) cache this copy writes: the memory is the caller's again
        # once we return, so the copy is stopped and waited for here and now. Its record comes later and
        # ``over`` then tells the pusher why.
        if settled.done() or (moved.done() and not moved.cancelled() and moved.exception() is None):
            return  # every byte moved (``over`` reports it), or the copy is over already
        told.append("the cache was unregistered while the request was served")
        for token in tokens:
            cancel(token)
            if wait is not None and not wait(token, CUT_WAIT_S):
                log.error("serving PUSH_LOCAL %d: the copy into an unregistered cache did not stop within %.1f s",
                          req_id, CUT_WAIT_S)
        moved.cancel()

    unwatch = rt.registry.serving([cache], cut) if wait is not None else None

    def over(_: asyncio.Future) -> None:
        if link.local_pushes.get(req_id) is settled:  # not a later push under this id (the peer may reuse it)
            del link.local_pushes[req_id]
        if unwatch is not None:
            unwatch()
        if link.serving.get(req_id) is abort:
            del link.serving[req_id]
        if moved.done() and not moved.cancelled() and moved.exception() is None:
            landed()
            return
        unlinking = not told and moved.cancelled() and link.ending  # stopped because the link ends
        failure = None if moved.cancelled() or not moved.done() else moved.exception()
        status = (LLMStatusCode.LLM_KV_CACHE_NOT_EXIST if told else
                  LLMStatusCode.LLM_NOT_YET_LINK if unlinking else
                  stopped[0] if moved.cancelled() and stopped else
                  failure.status_code if isinstance(failure, LLMException)
                  and failure.status_code != LLMStatusCode.LLM_SUCCESS else LLMStatusCode.LLM_FAILED)
        counters.end("served_push", transport, served.total, started, Outcome.FAILED, status)
        if not moved.done():
            moved.cancel()
        if served.landed:
            push_torn(rt, link, served, LLMException(told[0], status_code=status) if told else
                      "the push was aborted" if moved.cancelled() else moved.exception())
        if told:
            answer(status, told[0])
        else:
            answer(status, UNLINKING if unlinking else
                   "the push was aborted" if moved.cancelled() else str(moved.exception()))

    settled.add_done_callback(over)


async def push_local(link: LinkPort, plan: Plan, timeout_ms: int, what: str, *, queue_ms: int | None = None) -> bool:
    """Send ``PUSH_LOCAL`` for ``plan`` and wait for the owner's answer (see :meth:`SameHostPlane.move_alone`);
    False when the owner wants it streamed.

    ``queue_ms``: the push may wait that much more behind the owner's earlier copies (a layer-wise transfer's
    layers released at once queue on the owner's copy threads, as they queue for the data channels over TCP).
    The requester cannot see when the owner's copy starts, so the two bound the whole push, here and at the
    owner (the request's time-out)."""
    link.check()
    timeout_ms = min(timeout_ms + (queue_ms or 0), 0xFFFFFFFF)  # the request's u32
    share = link.local
    if share is None:
        return False
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_ms / 1000
    try:
        async with asyncio.timeout(timeout_ms / 1000):
            await share.pushes.acquire()  # the owner runs no more of ours at once (its bound: it would stream them)
    except TimeoutError:
        raise LLMException(f"{what} timed out after {timeout_ms} ms behind the link's other same-host pushes",
                           status_code=LLMStatusCode.LLM_TIMEOUT) from None
    try:
        return await _push_local(link, plan, max(1, int((deadline - loop.time()) * 1000)), what)
    finally:
        share.pushes.release()


async def _push_local(link: LinkPort, plan: Plan, timeout_ms: int, what: str) -> bool:
    req_id = link.new_req_id()
    answered = link.expect(req_id)
    fields = {name: getattr(plan.remote, name) for name in TransferReq.__dataclass_fields__}
    fields.update(channel=0, timeout_ms=timeout_ms)
    link.send_record(Msg.PUSH_LOCAL, req_id, PushLocalReq(
        **fields, src_cache_id=plan.local.cache_id, src_first=plan.local_first, src_nbytes=plan.local_nbytes,
        src_offset=plan.local_offset, src_rows=array.array("Q", plan.local_rows).tobytes()))
    try:
        async with asyncio.timeout(timeout_ms / 1000):
            answer = await asyncio.shield(answered)
    except BaseException as exc:
        cancelled: list[asyncio.CancelledError] = []
        if not answered.done():
            link.send(Msg.ABORT, req_id, channel=0, generation=NO_GENERATION)
            await abort_acknowledged(link, answered, what, cancelled)
        link.pending.pop(req_id, None)
        if cancelled:
            raise cancelled[0] from None
        if isinstance(exc, TimeoutError):
            raise LLMException(f"{what} timed out after {timeout_ms} ms",
                               status_code=LLMStatusCode.LLM_TIMEOUT) from None
        raise
    if isinstance(answer, Resp) and answer.cache_id == USE_STREAM:
        return False
    if answer.status != LLMStatusCode.LLM_SUCCESS:
        raise LLMException(f"cluster {link.remote_cluster_id}: {answer.text}",
                           status_code=code_to_status(answer.status))
    if not isinstance(answer, Resp):  # a DONE: the owner answers PUSH_LOCAL with RESP
        raise LLMException(f"cluster {link.remote_cluster_id} confirmed request {req_id} with DONE, not RESP",
                           status_code=LLMStatusCode.LLM_LINK_FAILED)
    return True


async def _read(rt: Runtime, share: LocalShare, plan: Plan, region: PeerRegion, triples: Any, timeout_ms: int,
                what: str) -> bool:
    """Copy a pull out of the owner's region without asking; the owner hears of it once we returned. False when
    the owner must be asked after all: the share ended, or the ledger no longer lists the cache.

    The loop turns once before the copy, so that a loop of small pulls (each copied at once) lets other tasks
    run and a cancellation lands before any byte; then the share's queued records are read (a peer that
    withdrew the cache, or that is gone) and the ledger is read again."""
    started = time.perf_counter()
    await asyncio.sleep(0)
    share.catch_up()
    if not plan.local.alive:  # released meanwhile (its memory may be the caller's again): copy nothing into it
        raise LLMException(f"{what}: the destination cache was released",
                           status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    _check_halted(share)
    if share.closed or share.listed_region(region.model_id) is not region:
        return False
    if _trace.ON:
        _trace.mark("job submitted")
    try:
        async with asyncio.timeout(timeout_ms / 1000):
            await copy_settled(rt, triples, plan.total, what, (plan.local, region), caches=(plan.local,),
                               share=share)
    except TimeoutError:
        raise LLMException(f"{what} timed out after {timeout_ms} ms", status_code=LLMStatusCode.LLM_TIMEOUT) from None
    if _trace.ON:
        _trace.mark("job done")
    share.tell_read(region.cache_id, plan.total, time.perf_counter() - started)  # sent after we returned
    return True


def copies_inline(rt: Runtime, nbytes: int) -> bool:
    """Whether a host copy of ``nbytes`` runs on the loop's thread (``INLINE_COPY_MAX``, the copy threads idle)."""
    return nbytes <= INLINE_COPY_MAX and not rt.copier.pending()


def _inline_this_pass(rt: Runtime, nbytes: int) -> bool:
    """Whether the owner may copy a peer's push of ``nbytes`` on the loop's thread in this pass of the loop: one
    chunk of a peer's control bytes holds hundreds of small ``PUSH_LOCAL`` requests, all served in one callback,
    so at most ``INLINE_COPY_MAX`` bytes of them (or the first) are copied inline a pass; the rest go to the copy
    threads (``MAX_LOCAL_PUSHES_SERVED`` of them, then the pusher is told to stream). Before, a peer's flood held
    the loop 0.3 s at a time (row 98's bound is 0.15 s)."""
    if rt.inline_spent == 0:
        asyncio.get_running_loop().call_soon(_new_pass, rt)
    elif rt.inline_spent + nbytes > INLINE_COPY_MAX:
        return False
    rt.inline_spent += max(nbytes, 1)
    return True


def _new_pass(rt: Runtime) -> None:
    rt.inline_spent = 0


def _check_halted(share: LocalShare) -> None:
    """Fail a copy out of the peer's regions about to start on a link being unlinked (``LocalShare.halt_copies``)."""
    if share.halted is not None:
        raise LLMException(str(share.halted), status_code=share.halted.status_code)


async def copy_settled(rt: Runtime, triples: Any, nbytes: int, what: str, keepalive: Any,
                       caches: Sequence[KvCache] = (), share: LocalShare | None = None) -> None:
    """Run one host copy job of ``nbytes``; if the caller gives up, the job is stopped and waited for first
    (and if a registered cache of ``caches`` is released: :func:`run_copy_job`).

    A small one while the copy threads have no job runs here and now (``INLINE_COPY_MAX``): nothing
    can give it up part-way, and it is over before this returns."""
    if copies_inline(rt, nbytes):
        _core.copy_now(triples)
        return
    await run_copy_job(rt, triples, what, keepalive, caches=caches, share=share)


def stop_host_copies(copier: Any, tokens: Iterable[int], what: str) -> None:
    """Cancel the host copy jobs ``tokens`` and block until no copy thread writes for them (``CUT_WAIT_S`` each at
    most; one still copying past it is logged): for a call that returns memory to its caller."""
    for token in tokens:
        copier.cancel(token)
        if not copier.wait(token, CUT_WAIT_S):
            log.error("%s: the copy of a released cache did not stop within %.1f s", what, CUT_WAIT_S)


async def run_copy_job(rt: Runtime, triples: Any, what: str, keepalive: Any, timeout_ms: int | None = None,
                       caches: Sequence[KvCache] = (), share: LocalShare | None = None) -> None:
    """Run one host copy job on the copy threads. If the caller gives up (``timeout_ms``, a cancel), this returns
    only once no copy thread works on it any more (``COPY_SETTLE_S`` at most), so no byte of it lands afterwards.

    ``caches``: those of ours the job writes or reads. Releasing a registered one (memory the caller owns again
    once ``unregister_cache`` / ``deallocate_cache`` returned) stops the job and waits for it inside that call
    (``CacheRegistry.serving``, at most ``CUT_WAIT_S``); the job then fails ``LLM_KV_CACHE_NOT_EXIST``. One that
    had moved every byte before stays a success."""
    copier = rt.copier
    tokens: list[int] = []
    cut: list[bool] = []

    def submit(token: int) -> Any:
        tokens.append(token)
        return copier.submit(token, triples)

    def stop() -> None:
        cut.append(True)
        stop_host_copies(copier, tokens, what)

    halted: list[LLMException] = []

    def halt(error: LLMException) -> None:
        # ``share``'s link is being unlinked: the peer's memory is its own again once it hears of it
        halted.append(error)
        stop_host_copies(copier, tokens, what)

    forget = rt.registry.serving(caches, stop) if caches else None
    ident = object()
    if share is not None:
        share.copies[ident] = halt
    try:
        await rt.completions.run(submit, copier.cancel, timeout_ms=timeout_ms, what=what, keepalive=keepalive,
                                 settle_s=COPY_SETTLE_S)
    except LLMException:
        if cut:
            raise LLMException(f"{what}: the cache was released during the copy",
                               status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST) from None
        if halted:
            raise LLMException(str(halted[0]), status_code=halted[0].status_code) from None
        raise
    finally:
        if forget is not None:
            forget()
        if share is not None:
            share.copies.pop(ident, None)


def _local_source(link: LinkPort, req: PushLocalReq, count: int, total: int) -> Any:
    """The pusher's source rows in its region we mapped, as copy pairs; None when we have not mapped it
    (the pusher then streams). A source that does not fit what it declared is refused."""
    region = None if link.local is None else link.local.region(req.src_cache_id)
    if region is None:
        return None
    blob = req.src_rows
    first, nbytes, offset = req.src_first, req.src_nbytes, req.src_offset
    if len(blob) % 8:
        raise Refusal(LLMStatusCode.LLM_PARAM_INVALID, "PUSH_LOCAL source rows are malformed")
    rows = array.array("Q", blob)
    if (not rows or max(rows) >= region.rows or first + count > len(region.offsets) or not 0 < nbytes
            or nbytes > region.row_bytes or offset > region.row_bytes - nbytes or count * len(rows) * nbytes != total):
        raise Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                      f"the pushed source does not fit cache {req.src_cache_id} shared by the pusher")
    pairs = _core.segments(region.tensor_bases(first, count), array.array("q", rows), region.row_bytes, offset,
                           nbytes)
    return pairs, region


PLANE = SameHostPlane()
