"""The NIXL plane: whole rows of registered caches moved by one NIXL READ (pull) or WRITE (push).

The owner answers ``RESP`` naming its cache, prepared for NIXL on the link
(``transport/nixl.py``). A READ ends with the requester's ``DONE``; a WRITE
carries a notification, and the owner confirms the push once that arrived. A
transfer that is given up posts no further piece and is waited for
(``base.nixl_settle``: ``NIXL_SETTLE_S``, longer while our worker still copies
a piece of it) before the owner hears of it, so the owner never recycles
memory that a WRITE of ours may still be filling. Loaded on first use, by
links that set up NIXL.

Device caches registered as VRAM move the same way, with the ordering the
staging plane and device IPC keep: NIXL touches a device cache only once
the endpoint's copy stream is past the work its current stream had enqueued
(a fence): the requester fences before it posts its READ or WRITE, the owner
before it answers. A device cache that is not registered (``vram_off``) is
not offered here: the staging plane moves it, and the link says why
(``LinkStats.nixl_vram_off``, set by the staging plane).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aio_datadist import _trace
from aio_datadist.cache import KvCache
from aio_datadist.layers import one_side_span
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.transport.base import InPlacePlane, LinkPort, Request, Served, meets, nixl_settle
from aio_datadist.transport.device_ipc import fence, serve_fenced
from aio_datadist.transport.fit import Refusal, fit
from aio_datadist.transport.nixl import Halting, NixlPeer, notif_for
from aio_datadist.transport.nixl_grants import CALLER_MEMORY, NUDGE_AFTER_S, NUDGE_HOLD_S, NUDGE_RATE
from aio_datadist.wire import Msg, ReqFlag, Resp, Target, TransferReq

if TYPE_CHECKING:
    from aio_datadist.cache import CacheRegistry
    from aio_datadist.plans import Plan
    from aio_datadist.runtime import Runtime
    from aio_datadist.transport.nixl import _RemoteCache

__all__ = ["PLANE", "NixlPlane"]


class NixlPlane(InPlacePlane):
    """Offered when the link's NIXL peer is usable and the plan moves whole rows of a registered cache."""

    name = "nixl"
    transport = "nixl"
    flag = ReqFlag.NIXL

    async def prepare(self, rt: Runtime, link: LinkPort, plan: Plan, *, pull: bool, deadline: float) -> None:
        # A cache allocated a moment ago may still be registering (not on a link that declined NIXL).
        if link.nixl is not None and link.nixl.usable():
            await link.nixl.agent.registered(plan.local)

    def can_carry(self, link: LinkPort, plan: Plan, *, pull: bool) -> bool:
        peer = link.nixl
        if peer is None or not peer.usable() or plan.by_address:
            return False
        row_bytes = plan.local.layout.row_bytes
        return (peer.agent.offered(plan.local) and plan.local_nbytes == row_bytes
                and plan.remote.nbytes == row_bytes and plan.remote.offset == 0)

    def reader(self, rt: Runtime, link: LinkPort, plan: Plan) -> Callable[[int, str], Awaitable[bool]] | None:
        """A pull of a host blocks cache by its blocks key that the owner granted (``transport/nixl_grants.py``),
        checked as the owner would check it; None for every other pull and whenever in doubt."""
        peer, remote = link.nixl, plan.remote
        if (peer is None or remote.target_kind != Target.BLOCKS_KEY or plan.local.on_device
                or not meets(self.transport, rt.settings.require_transport)
                or not self.can_carry(link, plan, pull=True)):
            return None
        grant = peer.grant_for(remote.model_id)
        if grant is None:
            return None
        region, geo, slot, word = grant
        try:
            rows, first, count = fit(geo, remote, pull=True, row=None)
        except Refusal:
            return None  # the owner says why
        if count != plan.local_count or count * len(rows) * remote.nbytes != plan.total:
            return None
        return functools.partial(_read, rt.registry, peer, plan, region, slot, word, first, rows, count)

    async def carry(self, rt: Runtime, link: LinkPort, plan: Plan, answer: Resp, req: Request, *,
                    pull: bool) -> None:
        peer = link.nixl
        remote = plan.remote
        req_id, what = req.req_id, req.what
        region = _answered_region(link, peer, answer.cache_id)
        assert peer is not None, "the region is the peer's"
        first, count = one_side_span(region.tensors, (remote.layer_first, remote.layer_last),
                                     remote.tensor_num_per_layer, "src_layer_range" if pull else "dst_layer_range")
        if count != plan.local_count:
            raise LLMException(f"cluster {link.remote_cluster_id} resolved a cache that does not fit the request",
                               status_code=LLMStatusCode.LLM_LINK_FAILED)
        rows = list(remote.rows) or [answer.row]
        if plan.local.on_device:  # NIXL reads or writes final rows only (the owner fenced before it answered)
            await fence(rt, None, what)
        req.check_owner()  # again after the fence's await: a WRITE the owner refused meanwhile is not posted
        if plan.local.on_device:  # and one it withdrew meanwhile (only an await lets its WITHDRAW in)
            region = _answered_region(link, peer, answer.cache_id)
        done = None if pull else req.then
        if _trace.ON:
            _trace.mark("job submitted")
        moved, settled, failure = peer.transfer("READ" if pull else "WRITE", plan.local, plan.local_first,
                                                plan.local_rows, region.cache_id, first, rows, count,
                                                b"" if pull else notif_for(peer.tag, req_id), what)
        req.settled, req.ack = settled, done
        try:
            await moved
        except BaseException as exc:
            moved.cancel()
            if isinstance(exc, LLMException) and exc.status_code == LLMStatusCode.LLM_FAILED:
                raise peer.failed(what, failure(exc)) from None  # NIXL failed a transfer it had accepted
            raise
        if _trace.ON:
            _trace.mark("job done")
        await req.finish()

    def serves(self, link: LinkPort, msg: Msg, req: TransferReq, served: Served) -> bool:
        peer = link.nixl
        cache = served.keepalive
        if not isinstance(cache, KvCache) or peer is None:
            return False
        return peer.serves(cache) and req.offset == 0 and req.nbytes == cache.layout.row_bytes

    def serve(self, rt: Runtime, link: LinkPort, msg: Msg, req_id: int, req: TransferReq, served: Served) -> None:
        """As every in-place plane; a device cache once our copy stream is past our current stream's work."""
        cache = served.cache
        if cache is not None and cache.on_device:
            serve_fenced(rt, link, msg, req_id, req, served,
                         lambda: InPlacePlane.serve(self, rt, link, msg, req_id, req, served))
            return
        InPlacePlane.serve(self, rt, link, msg, req_id, req, served)

    def _begin(self, link: LinkPort, cache: KvCache) -> Callable[[], None]:
        assert link.nixl is not None, "serves() saw the link's NIXL peer"
        agent, cache_id = link.nixl.agent, cache.cache_id
        agent.serve_begin(cache_id)  # the agent keeps the registration until serve_end
        return lambda: agent.serve_end(cache_id)

    def _arrival(self, link: LinkPort, req_id: int) -> asyncio.Future | None:
        assert link.nixl is not None
        return link.nixl.expect_push(req_id, f"NIXL push {req_id}")


async def _read(registry: CacheRegistry, peer: NixlPeer, plan: Plan, region: _RemoteCache, slot: int, word: int,
                first: int, rows: list[int], count: int, timeout_ms: int, what: str) -> bool:
    """Read the owner's ledger word for its granted cache, then READ the pull out of the cache without asking;
    the owner hears of it once we returned. False when the owner must be asked after all: the grant is gone, or
    the word no longer names the cache (unbound, withdrawn or freed), with nothing written; or, for a cache the
    owner's caller registered (``CALLER_MEMORY``), the word could not be read again after the rows (changed: the
    caller may have written its memory after it released the cache, so what the rows hold is not the cache's;
    NIXL given up on the link, or no scratch word free, meanwhile): the rows are written then.

    As the same-host read ledger's: the word is read before any byte moves, and the owner keeps a cache it
    revoked registered until we said no read of it is in flight (``REVOKED``). The loop turns once first, so
    that a loop of small pulls lets other tasks run and a cancellation lands before any byte. A READ given up
    returns once NIXL let go of it (``base.nixl_settle``). A registered destination released while the READ is
    posted stops it before the release returns (``nixl.Halting.halt``): the pull fails ``LLM_KV_CACHE_NOT_EXIST``."""
    started = time.perf_counter()
    cache_id = region.cache_id
    await asyncio.sleep(0)
    if not peer.read_started(cache_id):
        return False
    # No timer unless a READ is left in progress (NIXL usually finishes one inside the posting call).
    deadline = asyncio.get_running_loop().time() + timeout_ms / 1000
    cancelled: list[asyncio.CancelledError] = []
    posted = None
    released: list[bool] = []

    def cut() -> None:
        # The caller released the destination, its memory again once this returns: the READ posts no further
        # piece, and the piece our worker moves is waited for here.
        released.append(True)
        if posted is not None and isinstance(posted[1], Halting):
            peer.granted.nudge()  # a READ over UCX's TCP transport moves only while the owner makes progress
            posted[1].halt()

    unwatch = None
    try:
        if not await _word_holds(peer, slot, word, what, cancelled, deadline):
            return False
        if not plan.local.alive:  # released meanwhile (its memory may be the caller's again): read nothing into it
            raise _released(what)
        if peer.caches.get(cache_id) is not region:  # withdrawn (or offered anew) while the word was read
            return False
        unwatch = registry.serving([plan.local], cut)
        if _trace.ON:
            _trace.mark("job submitted")
        posted = peer.read_rows(plan.local, plan.local_first, plan.local_rows, cache_id, first, rows, count, what)
        if posted is not None:  # NIXL left it in progress
            await _settled(posted, peer, what, cancelled, plan.total, deadline)
        if word & CALLER_MEMORY and not await _word_holds(peer, slot, word, what, cancelled, deadline):
            return False  # released while its rows were read, or NIXL given up meanwhile: the owner's answer decides
        if _trace.ON:
            _trace.mark("job done")
    except TimeoutError:
        if cancelled:  # cancelled while a READ settled: the cancel wins
            raise cancelled[0] from None
        if released:  # the release's halt ran past our time: it cut the READ, not the clock
            raise _released(what) from None
        raise LLMException(f"{what} timed out after {timeout_ms} ms", status_code=LLMStatusCode.LLM_TIMEOUT) from None
    except LLMException as exc:
        if released and not cancelled:  # the READ cut by the release
            raise _released(what) from exc
        raise
    finally:
        if unwatch is not None:
            unwatch()
        if posted is not None and not posted[1].done():
            # Given up past NIXL_SETTLE_S with NIXL still holding the READ: it may still read the cache, so it
            # counts (the owner keeps a cache it revoked registered) until NIXL let go of it.
            posted[1].add_done_callback(lambda _: peer.granted.read_ended(cache_id))
        else:
            peer.granted.read_ended(cache_id)
    if cancelled:
        raise cancelled[0]
    if released or not plan.local.alive:  # its rows may have landed, but in memory the caller had back
        raise _released(what)
    peer.granted.tell_read(cache_id, plan.total, time.perf_counter() - started)  # sent after we returned
    return True


def _answered_region(link: LinkPort, peer: NixlPeer | None, cache_id: int) -> _RemoteCache:
    """The peer's cache an answer in place names, as our NIXL peer holds it. Gone: the link's own code when the
    link went meanwhile (``LLM_NOT_YET_LINK`` unlinked, ``LLM_LINK_FAILED`` broken); ``LLM_KV_CACHE_NOT_EXIST`` when
    the owner withdrew it since it answered (it released the cache: the link is fine, the cache is gone, as a
    same-host or device-IPC transfer reads it); else ``LLM_LINK_FAILED``."""
    region = None if peer is None else peer.caches.get(cache_id)
    if region is not None:
        return region
    if link.down:
        link.check()  # the link went meanwhile (while we fenced our device cache): unlinked or broken, as it says
    if peer is not None and not peer.closed and peer.declined is None:
        raise LLMException(f"cluster {link.remote_cluster_id} withdrew cache {cache_id} (released) during the "
                           "transfer", status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    raise LLMException(f"cluster {link.remote_cluster_id} cache {cache_id} is not prepared for NIXL",
                       status_code=LLMStatusCode.LLM_LINK_FAILED)


def _released(what: str) -> LLMException:
    return LLMException(f"{what}: the destination cache was released", status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)


async def _word_holds(peer: NixlPeer, slot: int, word: int, what: str, cancelled: list[asyncio.CancelledError],
                      deadline: float) -> bool:
    """Whether the owner's ledger word ``slot`` holds ``word`` now (False too when no word of ours is free, or
    NIXL was given up on the link: no ledger to read it from)."""
    if not peer.usable() or peer.ledger is None:
        return False
    index = peer.agent.take_scratch()
    if index is None:
        return False
    try:
        posted = peer.read_word(index, slot, what)
    except BaseException:
        peer.agent.give_scratch(index)  # nothing was posted
        raise
    try:
        if posted is not None:  # NIXL left it in progress
            await _settled(posted, peer, what, cancelled, 8, deadline)
    finally:
        if posted is None or posted[1].done():  # no READ may still write our word
            peer.agent.give_scratch(index)
        else:  # given up before NIXL let go of it: the word is ours again once it did
            posted[1].add_done_callback(lambda _: peer.agent.give_scratch(index))
    scratch = peer.agent.scratch
    assert scratch is not None, "read_word checked it"
    return int(scratch[index]) == word


async def _settled(posted: tuple[asyncio.Future, asyncio.Future, Callable[[BaseException], str]], peer: NixlPeer,
                   what: str, cancelled: list[asyncio.CancelledError], nbytes: int, deadline: float) -> None:
    """Wait for a posted READ until ``deadline`` (loop time; ``TimeoutError`` then), nudging the owner when it
    does not end soon (it may need the owner's progress); given up (cancel, timeout), cancel it and return only
    once NIXL let go of it."""
    moved, settled, failure = posted
    try:
        if not moved.done():
            loop = asyncio.get_running_loop()
            await asyncio.wait([moved], timeout=min(NUDGE_AFTER_S + nbytes / NUDGE_RATE,
                                                    max(deadline - loop.time(), 0.0)))
            # The owner makes progress for NUDGE_HOLD_S after a nudge; a READ that needs it longer (UCX over TCP
            # needs it for every byte) is nudged again before that runs out.
            while not moved.done() and loop.time() < deadline:
                peer.granted.nudge()
                await asyncio.wait([moved], timeout=min(NUDGE_HOLD_S / 2, max(deadline - loop.time(), 0.0)))
            if not moved.done():
                raise TimeoutError
        await moved
    except BaseException as exc:
        moved.cancel()
        if not settled.done():
            peer.granted.nudge()  # settling it may need the owner's progress too, for as long as it takes
        await nixl_settle(settled, cancelled, tick=peer.granted.nudge, every_s=NUDGE_HOLD_S / 2)
        if isinstance(exc, LLMException) and exc.status_code == LLMStatusCode.LLM_FAILED:
            raise peer.failed(what, failure(exc)) from None
        raise


PLANE = NixlPlane()
