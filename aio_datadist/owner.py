"""The owner's half of a transfer: check a peer's request, then let a plane serve it.

A request names its target (a key, an id and row, a blocks key, or raw
addresses for a push), the owner-side rows and layer range, and how many
bytes per row the requester expects. :func:`serve_plan` checks all of it
against what this endpoint registered before a byte moves and refuses with
a status code otherwise; :func:`handle_request` then claims the key a pull
consumes and hands the request to the first plane the requester offered
that serves it (``transport/base.py``), the stream plane last.
"""

from __future__ import annotations

import array
from typing import TYPE_CHECKING, Any

from aio_datadist import _core, _trace
from aio_datadist.cache import KeyBinding, KvCache
from aio_datadist.links import MAX_AWAITED_PER_LINK, MAX_LOCAL_PUSHES_SERVED, MAX_SERVED_PER_CHANNEL
from aio_datadist.stats import Outcome
from aio_datadist.status import LLMStatusCode
from aio_datadist.transport import plane, planes_for
from aio_datadist.transport.base import UNLINKING, Plane, Refusal, Served, meets
from aio_datadist.transport.fit import fit, geometry_of
from aio_datadist.transport.same_host import USE_STREAM
from aio_datadist.transport.stream import refuse_posted
from aio_datadist.types import UINT64_MAX
from aio_datadist.wire import Done, Msg, ReqFlag, Target, TransferReq

if TYPE_CHECKING:
    from aio_datadist.links import Link
    from aio_datadist.runtime import Runtime

__all__ = ["handle_request", "serve_plan"]


def handle_request(rt: Runtime, link: Link, msg: Msg, req_id: int, req: Any) -> None:
    """Serve a peer's PULL_REQ, PUSH_REQ or PUSH_LOCAL, or its DONE after a pull (from the link's reader)."""
    if msg is Msg.DONE:
        _done(link, req_id, req)
        return
    if msg not in (Msg.PULL_REQ, Msg.PUSH_REQ, Msg.PUSH_LOCAL):
        return
    if _trace.ON:
        _trace.mark("owner: request read")
    kind = "served_pull" if msg is Msg.PULL_REQ else "served_push"
    try:
        if link.ending:  # unlinking: what we served is being stopped, and nothing new starts
            raise Refusal(LLMStatusCode.LLM_NOT_YET_LINK, UNLINKING)
        if (req_id in link.serving or req_id in link.pull_acks or req_id in link.local_pushes
                or req_id in link.served_pushes):  # the last two: given up and still settling
            # What we hold for a request is kept by its id: a second one would take the first's place, and
            # the first's claim of its key would never be given back.
            raise Refusal(LLMStatusCode.LLM_PARAM_INVALID, f"request id {req_id} is in use by a request still served")
        if msg is not Msg.PUSH_LOCAL and link.answers(req.channel) >= MAX_SERVED_PER_CHANNEL:
            # Checked before anything is planned: a job list may be far larger than its request.
            raise Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                          f"data channel {req.channel} already carries {MAX_SERVED_PER_CHANNEL} requests of yours "
                          "that are being served (send one request per channel at a time)")
        if msg is Msg.PUSH_LOCAL and len(link.local_pushes) >= MAX_LOCAL_PUSHES_SERVED:
            # Nothing planned: the pusher streams it, on a data channel that MAX_SERVED_PER_CHANNEL bounds.
            link.send(Msg.RESP, req_id, status=LLMStatusCode.LLM_SUCCESS, total=0, cache_id=USE_STREAM, row=-1,
                      text="")
            return
        if msg is not Msg.PUSH_LOCAL and len(link.pull_acks) >= MAX_AWAITED_PER_LINK:
            raise Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                          f"{MAX_AWAITED_PER_LINK} requests of yours wait for your word that they are over (DONE)")
        served = serve_plan(rt, link, msg, req)
    except Refusal as refusal:
        link.counters.refused(kind, link.transport, refusal.code)
        _refuse(link, msg, req_id, req, refusal)
        return
    if msg is Msg.PUSH_LOCAL:  # the same-host plane's own request (its move_alone)
        plane("same-host").serve_alone(rt, link, req_id, req, served)
        return
    for candidate in planes_for(link):
        if (not candidate.flag or req.flags & candidate.flag) and candidate.serves(link, msg, req, served):
            _serve(rt, link, msg, req_id, req, served, candidate, kind)
            return
    raise AssertionError("the stream plane serves every request")  # pragma: no cover


def _serve(rt: Runtime, link: Link, msg: Msg, req_id: int, req: Any, served: Served, chosen: Plane,
           kind: str) -> None:
    """Let ``chosen`` serve ``served``, once the transport it is meets ``aio.RequireTransport`` and the key a
    pull consumes is ours; count it on the link."""
    transport = chosen.transport_on(link)
    refusal: Refusal | None = None
    required = rt.settings.require_transport
    if not meets(transport, required):
        refusal = Refusal(LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                          f"cluster {link.cluster_id} requires transport {required} (aio.RequireTransport); "
                          f"this request would take {transport}")
    key = served.key if msg is Msg.PULL_REQ else None
    if refusal is None and key is not None and not rt.registry.claim_key(key, served.tensors):
        refusal = Refusal(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, "the key is being pulled by another request")
    counters = link.counters
    if refusal is not None:
        counters.refused(kind, transport, refusal.code)
        _refuse(link, msg, req_id, req, refusal)
        return
    started = counters.begin(kind)
    total = served.total

    def report(ok: bool, status: LLMStatusCode) -> None:
        counters.end(kind, served.transport, total, started, Outcome.OK if ok else Outcome.FAILED,
                     LLMStatusCode.LLM_SUCCESS if ok else status)

    served.report = report
    served.transport = transport
    if _trace.ON:
        _trace.mark("owner: planned")
    chosen.serve(rt, link, msg, req_id, req, served)
    if _trace.ON:
        _trace.mark("owner: answered")


def _refuse(link: Link, msg: Msg, req_id: int, req: Any, refusal: Refusal) -> None:
    """Refuse with ``RESP``, or on its channel a pull whose receive is posted there."""
    # Not on a channel that is full already: a refusal there would be one more job queued on it.
    if (msg is Msg.PULL_REQ and req.flags & ReqFlag.POSTED and link.answers(req.channel) < MAX_SERVED_PER_CHANNEL
            and refuse_posted(link, req_id, req, refusal.code, refusal.text)):
        return
    link.send(Msg.RESP, req_id, status=refusal.code, total=0, cache_id=-1, row=-1, text=refusal.text)


def _done(link: Link, req_id: int, done: Done) -> None:
    """A requester's word that a transfer we serve in place is over (or was given up)."""
    ack = link.pull_acks.pop(req_id, None)
    failed = done.status != LLMStatusCode.LLM_SUCCESS
    if ack is not None:
        ack[1 if failed else 0]()
    if failed:
        # A requester that gave up a NIXL or same-host transfer waits for our word that nothing of
        # it is written or recorded here any more: the line above made sure of that.
        link.send(Msg.DONE, req_id, status=LLMStatusCode.LLM_FAILED, text="aborted")


def _resolve_target(rt: Runtime, req: TransferReq) -> tuple[KvCache, int | None, KeyBinding | None]:
    """The cache a request names, its row, and the key binding a pull of it claims and consumes
    (that binding only: a key removed and bound again meanwhile is another binding)."""
    kind = req.target_kind
    reg = rt.registry
    cache: KvCache | None
    if kind == Target.CACHE_KEY:
        req_valid = req.key_req_id != UINT64_MAX
        prefix_valid = req.prefix_id != UINT64_MAX
        if req_valid == prefix_valid:
            raise Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                           "invalid argument 'cache_key': exactly one of req_id and prefix_id must be set")
        ident = (req.key_req_id, req.prefix_id, req.model_id)
        found = reg.resolve_key(ident)
        if found is None:
            raise Refusal(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                           f"no cache is bound to key req_id={req.key_req_id} prefix_id={req.prefix_id} "
                           f"model_id={req.model_id} (never bound, removed, or already pulled)")
        cache, binding = found
        return cache, binding.row, binding
    if kind == Target.ID_INDEX:
        cache = reg.by_id(req.cache_id)
        if cache is None:
            raise Refusal(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache {req.cache_id} does not exist")
        return cache, req.batch_index, reg.key_at(cache.cache_id, req.batch_index)
    if kind == Target.BLOCKS_KEY:
        cache = reg.by_blocks_key(req.model_id)
        if cache is None:
            raise Refusal(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                           f"no blocks cache is bound to model_id {req.model_id}")
        return cache, None, None
    raise Refusal(LLMStatusCode.LLM_PARAM_INVALID, f"unknown target kind {kind}")


#: Addresses one raw-address push names: a layer's K and V, as ``transfer_cache_async`` sends each layer (the
#: plan is addresses x blocks runs, so a peer naming thousands of each would hold the loop and memory).
MAX_PUSHED_ADDRS = 2


def _find_tensor(rt: Runtime, start: int, end: int) -> tuple[KvCache, int] | None:
    # Not a cache deallocated and kept by its keys (a handed-off cache): reachable through its keys only.
    return rt.registry.holding(start, end)


def _serve_addrs(rt: Runtime, msg: Msg, req: TransferReq) -> tuple[list[KvCache], Any, int, list]:
    """Check raw destination addresses (TransferConfig) against registered memory."""
    if msg is not Msg.PUSH_REQ:
        raise Refusal(LLMStatusCode.LLM_PARAM_INVALID, "raw addresses can only be pushed to")
    count, rows = req.tensor_count, list(req.rows)
    if not 0 < count <= len(rows):
        raise Refusal(LLMStatusCode.LLM_PARAM_INVALID, "invalid argument 'dst_addrs': address count mismatch")
    if count > MAX_PUSHED_ADDRS:  # checked before a run is planned: the job list is addresses x blocks runs
        raise Refusal(LLMStatusCode.LLM_PARAM_INVALID, f"invalid argument 'dst_addrs': {count} addresses in one "
                       f"request, at most {MAX_PUSHED_ADDRS} (one layer's K and V)")
    addrs, blocks = rows[:count], rows[count:]
    stride, nbytes = req.offset, req.nbytes
    if bool(req.flags & ReqFlag.BLOCKS) != bool(blocks) or nbytes == 0 or (blocks and stride < nbytes):
        raise Refusal(LLMStatusCode.LLM_PARAM_INVALID, "invalid argument 'dst_block_indices': bad block geometry")
    extent = (max(blocks) * stride if blocks else 0) + nbytes
    caches, landed = [], []
    for i, addr in enumerate(addrs):
        found = None if addr + extent >= 1 << 64 else _find_tensor(rt, addr, addr + extent)
        if found is None:
            raise Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                           f"invalid argument 'dst_addrs': address {i} ({addr:#x}, {extent} bytes) lies outside "
                           "every cache registered on the destination")
        cache, t = found
        if cache.on_device:
            raise Refusal(LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                           f"invalid argument 'dst_addrs': address {i} ({addr:#x}) lies in a device cache; raw "
                           "addresses reach host memory only (name the cache by key or id instead)")
        caches.append(cache)
        lay = cache.layout
        offsets = [addr - lay.bases[t] + b * stride for b in (blocks or [0])]
        if all(off % lay.row_bytes == 0 for off in offsets) and nbytes <= lay.row_bytes:  # rows from byte 0
            landed.append(rt.arrivals.accepted(cache, range(t, t + 1), [off // lay.row_bytes for off in offsets]))
    pairs = _core.segments(array.array("Q", addrs), array.array("q", blocks or [0]), stride, 0, nbytes)
    return caches, pairs, count * max(len(blocks), 1) * nbytes, landed

def serve_plan(rt: Runtime, link: Link, msg: Msg, req: TransferReq) -> Served:
    """Check a peer's request against what we registered; what serving it moves, or :class:`Refusal`."""
    if not rt.settings.remote_cache_accessible:
        raise Refusal(LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                       "this endpoint's caches are not remotely accessible "
                       "(its option 'llm.EnableRemoteCacheAccessible' is '0')")
    if msg is not Msg.PUSH_LOCAL and not link.peer_channel_ok(req.channel):
        raise Refusal(LLMStatusCode.LLM_LINK_FAILED, f"data channel {req.channel} is not usable")
    if req.target_kind == Target.ADDRS:
        caches, pairs, total, landed = _serve_addrs(rt, msg, req)
        return Served(caches, pairs, total, None, range(0), landed)
    if req.target_kind == Target.CACHE_KEY and msg is not Msg.PULL_REQ:
        raise Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                       "invalid argument 'dst_cache_key': a push names its destination by cache id and index, "
                       "blocks key or addresses; a CacheKey is pulled, never pushed to")
    cache, row, ident = _resolve_target(rt, req)
    rows, first, count = fit(geometry_of(cache), req, pull=msg is Msg.PULL_REQ, row=row)
    lay, offset, nbytes = cache.layout, req.offset, req.nbytes
    pairs = lay.segments(first, count, rows, offset, nbytes)
    # A push counts for the rows it writes from their first byte, whole or not (fit keeps it within the row):
    # the last block of a cache pushed into blocks gets the rest of the row (layerwise._chunk_pieces).
    push = msg is not Msg.PULL_REQ and offset == 0
    landed = [rt.arrivals.accepted(cache, range(first, first + count), rows)] if push else []
    return Served(cache, pairs, count * len(rows) * nbytes, ident, range(first, first + count), landed, row)

