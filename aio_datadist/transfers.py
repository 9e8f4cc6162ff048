"""Moving cache bytes over a link: the requester's and the owner's halves.

A request names its target (a key, an id and row, or a blocks key), the
owner-side rows and layer range, and how many bytes per row the requester
expects. The owner checks all of it against what it registered before a byte
moves, answers ``RESP``, and both ends then run one native scatter/gather
job on the request's data channel (a TLS channel's own job with TLS, see
``Link.move``): the byte stream is tensor-major, then row order, identical
on both ends. A push completes when the owner confirms with
``DONE``; a pull acknowledges with ``DONE`` so the owner can consume keys.
"""

from __future__ import annotations

import array
import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from aio_datadist import _core
from aio_datadist._checks import param_invalid
from aio_datadist._settle import settle
from aio_datadist.cache import KeyBinding, KvCache
from aio_datadist.layers import check_spans, one_side_span
from aio_datadist.status import LLMException, LLMStatusCode, code_to_status
from aio_datadist.transport.nixl import notif_for
from aio_datadist.types import UINT64_MAX, BlocksCacheKey, CacheIndex, CacheKey, CacheKeyByIdAndIndex
from aio_datadist.wire import MAX_ROWS, Msg, ReqFlag, Target

if TYPE_CHECKING:
    from aio_datadist.links import Link
    from aio_datadist.runtime import Runtime

__all__ = ["Plan", "handle_request", "run_pull", "run_push", "target_fields"]

KIND_CACHE_KEY = Target.CACHE_KEY
KIND_ID_INDEX = Target.ID_INDEX
KIND_BLOCKS_KEY = Target.BLOCKS_KEY
KIND_ADDRS = Target.ADDRS

F_BLOCKS = ReqFlag.BLOCKS
F_CONTIG = ReqFlag.CONTIG
F_EXACT = ReqFlag.EXACT
F_LOCAL = ReqFlag.LOCAL
F_NIXL = ReqFlag.NIXL

MAX_SERVE_TIMEOUT_MS = 600_000
NIXL_SETTLE_S = 1.0
#: How long a given-up data-channel job may take to report itself over (the channel reset stops it at once).
JOB_SETTLE_S = 1.0
#: How long a given-up same-host copy may take to stop (it stops between chunks of at most 1 MiB).
COPY_SETTLE_S = 5.0
#: How long a pusher waits for the owner to confirm that an aborted same-host push stopped.
ABORT_ACK_S = 1.0
#: Source rows a same-host push may name (they travel as one opaque field); larger pushes stream.
MAX_LOCAL_SRC_ROWS = 32768
#: RESP.cache_id of an owner that cannot read a same-host push's source: the pusher streams it instead.
USE_STREAM = -2
NO_GENERATION = 0xFFFFFFFF


def target_fields(key: Any) -> dict[str, int]:
    """Wire fields naming a remote cache by key, id and row, or blocks key."""
    fields = dict(target_kind=0, cluster_id=0, cache_id=0, key_req_id=UINT64_MAX, prefix_id=UINT64_MAX,
                  model_id=0, batch_index=0)
    if isinstance(key, CacheKey):
        fields.update(target_kind=KIND_CACHE_KEY, cluster_id=key.cluster_id, key_req_id=key.req_id,
                      prefix_id=key.prefix_id, model_id=key.model_id)
    elif isinstance(key, (CacheKeyByIdAndIndex, CacheIndex)):
        fields.update(target_kind=KIND_ID_INDEX, cluster_id=key.cluster_id, cache_id=key.cache_id,
                      batch_index=key.batch_index)
    elif isinstance(key, BlocksCacheKey):
        fields.update(target_kind=KIND_BLOCKS_KEY, cluster_id=key.cluster_id, model_id=key.model_id)
    else:
        raise TypeError(type(key).__name__)
    return fields


@dataclasses.dataclass
class Plan:
    """A validated request: the local half and what to ask the owner."""

    local: KvCache
    local_pairs: Any
    total: int
    remote: dict[str, Any]
    local_first: int = 0
    local_count: int = 0
    local_rows: tuple[int, ...] = ()
    local_nbytes: int = 0


def build_plan(local: KvCache, local_layers: tuple[int, int], remote_layers: tuple[int, int],
               per_layer: int, local_rows: Sequence[int], local_nbytes: int, remote_rows: Sequence[int],
               remote_nbytes: int, flags: int, target: dict[str, int], local_arg: str) -> Plan:
    if len(remote_rows) > MAX_ROWS:
        raise param_invalid("src_blocks" if local_arg == "dst" else "dst_blocks",
                            f"{len(remote_rows)} blocks in one request; the protocol carries at most {MAX_ROWS}")
    check_spans(remote_layers, local_layers)
    first, count = one_side_span(local.cache_desc.num_tensors, local_layers, per_layer,
                                 "dst_layer_range" if local_arg == "dst" else "src_layer_range")
    pairs = local.layout.segments(first, count, list(local_rows), 0, local_nbytes)
    total = count * len(local_rows) * local_nbytes
    remote = dict(target, layer_first=remote_layers[0], layer_last=remote_layers[1],
                  tensor_num_per_layer=per_layer, tensor_count=count, data_type=local.cache_desc.data_type.value,
                  offset=0, nbytes=remote_nbytes,
                  flags=flags, rows=tuple(remote_rows))
    return Plan(local, pairs, total, remote, first, count, tuple(local_rows), local_nbytes)


async def _exchange(link: Link, msg: Msg, plan: Plan, timeout_ms: int, channel: int, req_id: int) -> dict:
    resp = link.expect(req_id)
    remote = dict(plan.remote)
    if _nixl_eligible(link, plan):
        remote["flags"] |= F_NIXL
    elif msg is Msg.PULL_REQ and link.local is not None and remote["target_kind"] != KIND_ADDRS:
        remote["flags"] |= F_LOCAL
    link.send(msg, req_id, channel=channel, timeout_ms=timeout_ms, **remote)
    answer = await resp
    if answer["status"] != LLMStatusCode.LLM_SUCCESS:
        raise _Refused(f"cluster {link.remote_cluster_id}: {answer['text']}",
                       status_code=code_to_status(answer["status"]))
    if answer["total"] != plan.total:
        raise LLMException(f"cluster {link.remote_cluster_id} offers {answer['total']} bytes, "
                           f"{plan.total} expected", status_code=LLMStatusCode.LLM_PARAM_INVALID)
    answer["via"] = remote["flags"] & (F_NIXL | F_LOCAL)  # how the owner may have chosen to share
    return answer


def _nixl_eligible(link: Link, plan: Plan) -> bool:
    """Whether NIXL can move ``plan``: whole rows of a registered cache, as many bytes per row on
    both ends (the owner checks its side again)."""
    peer = link.nixl
    if peer is None or not peer.usable() or plan.remote["target_kind"] == KIND_ADDRS:
        return False
    row_bytes = plan.local.layout.row_bytes
    return (peer.plane.offered(plan.local) and plan.local_nbytes == row_bytes
            and plan.remote["nbytes"] == row_bytes and plan.remote["offset"] == 0)


class _Refused(LLMException):
    """The owner refused the request before any byte moved."""


async def run_pull(rt: Runtime, link: Link, plan: Plan, timeout_ms: int, what: str) -> None:
    """Ask the owner for bytes and receive them straight into ``plan.local``."""
    await _run(rt, link, plan, timeout_ms, what, pull=True)


async def run_push(rt: Runtime, link: Link, plan: Plan, timeout_ms: int, what: str) -> None:
    """Send ``plan.local``'s bytes to the owner; returns once it confirmed."""
    if await _push_by_owner_read(link, plan, timeout_ms, what):
        return
    await _run(rt, link, plan, timeout_ms, what, pull=False)


class _Request:
    """One request of ours while it runs, and what giving it up must wait for.

    A request that is given up (timeout, error, cancellation) returns only
    once no byte of it can change its destination any more: our own job on
    the data channel (or NIXL) is over, and for a push whose bytes may be on
    their way, the owner answered that it stopped writing and discarded the
    rest (see :meth:`give_up`).
    """

    __slots__ = ("link", "what", "channel", "generation", "req_id", "local", "settled", "ack")

    def __init__(self, link: Link, what: str) -> None:
        self.link = link
        self.what = what
        self.channel = -1
        self.generation = -1
        self.req_id = 0
        self.local = False  # the owner chose NIXL or same-host sharing: no data channel
        self.settled: asyncio.Future | None = None  # done once our job can touch no byte any more
        self.ack: asyncio.Future | None = None  # a push's DONE from the owner, once bytes may be in flight

    async def give_up(self) -> None:
        """Abandon the request and wait, bounded and through cancellations (re-raised afterwards),
        until nothing of it can land: our job settled, then the owner's answer to the abort of a push
        (``ABORT_ACK_S``). An owner silent past that bound loses the link, and with it every data
        channel, so nothing more of ours reaches it."""
        link = self.link
        cancelled: list[asyncio.CancelledError] = []
        if self.local:
            if self.settled is not None:  # NIXL: let the cancelled transfer settle before the owner hears
                await _wait_out(self.settled, NIXL_SETTLE_S, cancelled)
            if self.req_id:
                link.send(Msg.DONE, self.req_id, status=LLMStatusCode.LLM_FAILED, text="abandoned")
        else:
            _abandon(link, self.channel, self.generation, self.req_id)
            if self.settled is not None:
                await _wait_out(self.settled, JOB_SETTLE_S, cancelled)
        if self.ack is not None:
            await _abort_acknowledged(link, self.ack, self.what, cancelled)
        if self.req_id:
            link.pending.pop(self.req_id, None)
        if cancelled:
            raise cancelled[0]


async def _abort_acknowledged(link: Link, ack: asyncio.Future, what: str,
                              cancelled: list[asyncio.CancelledError]) -> None:
    """Wait (``ABORT_ACK_S`` at most) for the owner's answer to an aborted push, which it sends once
    nothing more of the push can land; an owner silent past that loses the link."""
    if not ack.done() and not await _wait_out(ack, ABORT_ACK_S, cancelled):
        link.fail(LLMException(f"{what}: cluster {link.remote_cluster_id} did not confirm an aborted "
                               f"push within {ABORT_ACK_S} s", status_code=LLMStatusCode.LLM_LINK_FAILED))


async def _wait_out(future: asyncio.Future, bound_s: float, cancelled: list[asyncio.CancelledError]) -> bool:
    """``settle`` that keeps a cancellation in ``cancelled`` instead of raising it; whether ``future`` is done."""
    try:
        return await settle(future, bound_s)
    except asyncio.CancelledError as exc:
        cancelled.append(exc)
        return future.done()


async def _run(rt: Runtime, link: Link, plan: Plan, timeout_ms: int, what: str, *, pull: bool) -> None:
    req = _Request(link, what)
    try:
        async with asyncio.timeout(timeout_ms / 1000):
            # A cache allocated a moment ago may still be registering (not on a link that declined NIXL).
            if link.nixl is not None and link.nixl.usable():
                await link.nixl.plane.registered(plan.local)
            req.channel = channel = await link.acquire()
            req.generation = link.channels[channel].generation
            req.req_id = req_id = link.new_req_id()
            answer = await _exchange(link, Msg.PULL_REQ if pull else Msg.PUSH_REQ, plan, timeout_ms, channel, req_id)
            if answer["cache_id"] >= 0:
                req.local = True
                link.release(channel)
                req.channel = -1
                if answer["via"] == F_NIXL:
                    await _run_nixl(link, plan, answer, req, pull=pull)
                else:
                    await _run_local(rt, link, plan, answer, req_id, what)
                return
            done = None if pull else link.expect(req_id)
            settled = asyncio.get_running_loop().create_future()
            moving = link.move(channel, plan.local_pairs, send=not pull, timeout_ms=None, what=what,
                               keepalive=plan.local, settled=settled)
            req.settled, req.ack = settled, done
            await moving
            if done is None:
                link.send(Msg.DONE, req_id, status=0, text="")
            else:
                answer = await asyncio.shield(done)  # a cut must not cancel it: give_up waits for it
                if answer["status"] != LLMStatusCode.LLM_SUCCESS:
                    raise LLMException(f"cluster {link.remote_cluster_id}: {answer['text']}",
                                       status_code=code_to_status(answer["status"]))
        link.release(req.channel)
    except _Refused:
        link.pending.pop(req.req_id, None)
        link.release(req.channel)
        raise
    except TimeoutError:
        await req.give_up()
        raise LLMException(f"{what} timed out after {timeout_ms} ms",
                           status_code=LLMStatusCode.LLM_TIMEOUT) from None
    except LLMException as exc:
        await req.give_up()
        if exc.status_code == LLMStatusCode.LLM_FAILED and (link.broken is not None or link.closed):
            try:
                link.check()  # the engine stopped the job because the link went: say so
            except LLMException as state:
                raise state from exc
        raise
    except BaseException:
        await req.give_up()
        raise


async def _run_local(rt: Runtime, link: Link, plan: Plan, answer: dict, req_id: int, what: str) -> None:
    """The owner chose same-host sharing for a pull: one native copy out of its mapped (read-only) cache.

    A copy that is given up (timeout, cancel) is stopped and waited for before
    this returns, so no byte lands in ``plan.local`` afterwards.
    """
    share = link.local
    region = None if share is None else share.region(answer["cache_id"])
    if region is None:
        raise LLMException(f"cluster {link.remote_cluster_id} shared cache {answer['cache_id']} is not mapped",
                           status_code=LLMStatusCode.LLM_LINK_FAILED)
    remote = plan.remote
    first, count = one_side_span(len(region.offsets), (remote["layer_first"], remote["layer_last"]),
                                 remote["tensor_num_per_layer"], "src_layer_range")
    rows = list(remote["rows"]) or [answer["row"]]
    if (count != remote["tensor_count"] or not rows or min(rows) < 0 or max(rows) >= region.rows
            or remote["offset"] + remote["nbytes"] > region.row_bytes):
        raise LLMException(f"cluster {link.remote_cluster_id} shared a cache that does not fit the request",
                           status_code=LLMStatusCode.LLM_LINK_FAILED)
    theirs = _core.segments(region.tensor_bases(first, count), array.array("q", rows), region.row_bytes,
                            remote["offset"], remote["nbytes"])
    triples = _core.zip_segments(plan.local_pairs, theirs)
    await _copy_settled(rt, triples, what, (plan.local, region))
    link.send(Msg.DONE, req_id, status=0, text="")


async def _copy_settled(rt: Runtime, triples: Any, what: str, keepalive: Any) -> None:
    """Run one host copy job; if the caller gives up, the job is stopped and waited for first."""
    copier = rt.copier
    settled = asyncio.get_running_loop().create_future()
    moved = rt.completions.start(lambda t: copier.submit(t, triples), copier.cancel, timeout_ms=None, what=what,
                                 keepalive=keepalive, settled=settled)
    try:
        await moved
    except BaseException:
        moved.cancel()
        await settle(settled, COPY_SETTLE_S)
        raise


async def _push_by_owner_read(link: Link, plan: Plan, timeout_ms: int, what: str) -> bool:
    """A same-host push: the owner copies the rows out of our shared (read-only) region itself.

    Returns False when the push must take the stream path instead (no share,
    a source the peer has not mapped, raw addresses). A push that is given up
    (timeout, cancel) sends ``ABORT`` and returns once the owner answered
    that its copy stopped, at most ``ABORT_ACK_S`` later; an owner silent
    past that loses the link, so nothing it does afterwards is ours to wait for.
    """
    share = link.local
    if (share is None or not share.shared(plan.local) or plan.remote["target_kind"] == KIND_ADDRS
            or len(plan.local_rows) > MAX_LOCAL_SRC_ROWS):
        return False
    link.check()
    req_id = link.new_req_id()
    answered = link.expect(req_id)
    link.send(Msg.PUSH_LOCAL, req_id, channel=0, timeout_ms=timeout_ms, **plan.remote,
              src_cache_id=plan.local.cache_id, src_first=plan.local_first, src_nbytes=plan.local_nbytes,
              src_rows=array.array("Q", plan.local_rows).tobytes())
    try:
        async with asyncio.timeout(timeout_ms / 1000):
            answer = await asyncio.shield(answered)
    except BaseException as exc:
        cancelled: list[asyncio.CancelledError] = []
        if not answered.done():
            link.send(Msg.ABORT, req_id, channel=0, generation=NO_GENERATION)
            await _abort_acknowledged(link, answered, what, cancelled)
        link.pending.pop(req_id, None)
        if cancelled:
            raise cancelled[0] from None
        if isinstance(exc, TimeoutError):
            raise LLMException(f"{what} timed out after {timeout_ms} ms",
                               status_code=LLMStatusCode.LLM_TIMEOUT) from None
        raise
    if answer["cache_id"] == USE_STREAM:
        return False
    if answer["status"] != LLMStatusCode.LLM_SUCCESS:
        raise LLMException(f"cluster {link.remote_cluster_id}: {answer['text']}",
                           status_code=code_to_status(answer["status"]))
    return True


async def _run_nixl(link: Link, plan: Plan, answer: dict, req: _Request, *, pull: bool) -> None:
    """The owner chose NIXL: one READ (pull) or WRITE with a notification (push) of whole rows.

    A WRITE is confirmed by the owner once its notification arrived. A
    transfer that is given up is cancelled in NIXL and waited for (at most
    ``NIXL_SETTLE_S``) before the owner hears of it, so the owner never
    recycles memory that a WRITE of ours may still be filling; a push then
    waits for the owner's answer, after which the owner records no arrival
    of it (see :meth:`_Request.give_up`).
    """
    peer = link.nixl
    remote = plan.remote
    req_id, what = req.req_id, req.what
    region = None if peer is None else peer.caches.get(answer["cache_id"])
    if peer is None or region is None:
        raise LLMException(f"cluster {link.remote_cluster_id} cache {answer['cache_id']} is not prepared for NIXL",
                           status_code=LLMStatusCode.LLM_LINK_FAILED)
    first, count = one_side_span(region.tensors, (remote["layer_first"], remote["layer_last"]),
                                 remote["tensor_num_per_layer"], "src_layer_range" if pull else "dst_layer_range")
    if count != plan.local_count:
        raise LLMException(f"cluster {link.remote_cluster_id} resolved a cache that does not fit the request",
                           status_code=LLMStatusCode.LLM_LINK_FAILED)
    rows = list(remote["rows"]) or [answer["row"]]
    done = None if pull else link.expect(req_id)
    moved, settled = peer.transfer("READ" if pull else "WRITE", plan.local, plan.local_first, plan.local_rows,
                                   region.cache_id, first, rows, count, b"" if pull else notif_for(req_id), what)
    req.settled, req.ack = settled, done
    try:
        await moved
    except BaseException as exc:
        moved.cancel()
        if isinstance(exc, LLMException) and exc.status_code == LLMStatusCode.LLM_FAILED:
            # NIXL failed a transfer it had accepted: the peer's agent went away or the fabric failed
            raise LLMException(f"{what}: NIXL transfer with cluster {link.remote_cluster_id} failed ({exc})",
                               status_code=LLMStatusCode.LLM_LINK_FAILED) from None
        raise
    if done is None:
        link.send(Msg.DONE, req_id, status=0, text="")
        return
    answer = await asyncio.shield(done)  # a cut must not cancel it: give_up waits for it
    if answer["status"] != LLMStatusCode.LLM_SUCCESS:
        raise LLMException(f"cluster {link.remote_cluster_id}: {answer['text']}",
                           status_code=code_to_status(answer["status"]))


def _abandon(link: Link, channel: int, generation: int, req_id: int) -> None:
    """Give up a request's data channel: one that may carry its bytes is reset on both ends (our
    job on it is over once this returns, see ``Link.reset_channel``)."""
    if channel < 0:
        return
    if link.channels[channel].generation != generation:
        if req_id:
            link.send(Msg.ABORT, req_id, channel=channel, generation=NO_GENERATION)  # the request only
        return  # the channel was already replaced under us
    if req_id:
        link.reset_channel(channel, tell_peer=True, req_id=req_id)
    else:
        link.release(channel)


# -- the owner's half ------------------------------------------------------


class _Refusal(Exception):
    def __init__(self, code: LLMStatusCode, text: str) -> None:
        super().__init__(text)
        self.code = code
        self.text = text


def _resolve_target(rt: Runtime, req: dict) -> tuple[KvCache, int | None, KeyBinding | None]:
    """The cache a request names, its row, and the key binding a pull of it claims and consumes
    (that binding only: a key removed and bound again meanwhile is another binding)."""
    kind = req["target_kind"]
    reg = rt.registry
    cache: KvCache | None
    if kind == KIND_CACHE_KEY:
        req_valid = req["key_req_id"] != UINT64_MAX
        prefix_valid = req["prefix_id"] != UINT64_MAX
        if req_valid == prefix_valid:
            raise _Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                           "invalid argument 'cache_key': exactly one of req_id and prefix_id must be set")
        ident = (req["key_req_id"], req["prefix_id"], req["model_id"])
        found = reg.resolve_key(ident)
        if found is None:
            raise _Refusal(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                           f"no cache is bound to key req_id={req['key_req_id']} prefix_id={req['prefix_id']} "
                           f"model_id={req['model_id']} (never bound, removed, or already pulled)")
        cache, binding = found
        return cache, binding.row, binding
    if kind == KIND_ID_INDEX:
        cache = reg.by_id(req["cache_id"])
        if cache is None:
            raise _Refusal(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache {req['cache_id']} does not exist")
        return cache, req["batch_index"], reg.key_at(cache.cache_id, req["batch_index"])
    if kind == KIND_BLOCKS_KEY:
        cache = reg.by_blocks_key(req["model_id"])
        if cache is None:
            raise _Refusal(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                           f"no blocks cache is bound to model_id {req['model_id']}")
        return cache, None, None
    raise _Refusal(LLMStatusCode.LLM_PARAM_INVALID, f"unknown target kind {kind}")


def _find_tensor(rt: Runtime, start: int, end: int) -> tuple[KvCache, int] | None:
    for cache in rt.registry.caches():
        lay = cache.layout
        for t, base in enumerate(lay.bases):
            if base <= start and end <= base + lay.tensor_bytes:
                return cache, t
    return None


def _serve_addrs(rt: Runtime, msg: Msg, req: dict) -> tuple[list[KvCache], Any, int, list]:
    """Check raw destination addresses (TransferConfig) against registered memory."""
    if msg is not Msg.PUSH_REQ:
        raise _Refusal(LLMStatusCode.LLM_PARAM_INVALID, "raw addresses can only be pushed to")
    count, rows = req["tensor_count"], list(req["rows"])
    if not 0 < count <= len(rows):
        raise _Refusal(LLMStatusCode.LLM_PARAM_INVALID, "invalid argument 'dst_addrs': address count mismatch")
    addrs, blocks = rows[:count], rows[count:]
    stride, nbytes = req["offset"], req["nbytes"]
    if bool(req["flags"] & F_BLOCKS) != bool(blocks) or nbytes == 0 or (blocks and stride < nbytes):
        raise _Refusal(LLMStatusCode.LLM_PARAM_INVALID, "invalid argument 'dst_block_indices': bad block geometry")
    extent = (max(blocks) * stride if blocks else 0) + nbytes
    caches, landed = [], []
    for i, addr in enumerate(addrs):
        found = None if addr + extent >= 1 << 64 else _find_tensor(rt, addr, addr + extent)
        if found is None:
            raise _Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                           f"invalid argument 'dst_addrs': address {i} ({addr:#x}, {extent} bytes) lies outside "
                           "every cache registered on the destination")
        cache, t = found
        caches.append(cache)
        lay = cache.layout
        offsets = [addr - lay.bases[t] + b * stride for b in (blocks or [0])]
        if all(off % lay.row_bytes == 0 for off in offsets) and nbytes == lay.row_bytes:
            landed.append((cache, range(t, t + 1), [off // lay.row_bytes for off in offsets]))
    pairs = _core.segments(array.array("Q", addrs), array.array("q", blocks or [0]), stride, 0, nbytes)
    return caches, pairs, count * max(len(blocks), 1) * nbytes, landed


def _serve_plan(rt: Runtime, link: Link, msg: Msg, req: dict) -> tuple[Any, Any, int, KeyBinding | None, range,
                                                                      list]:
    """Validate a peer's request; ``(keepalive, pairs, total, key, tensors, landed rows)``."""
    if not rt.settings.remote_cache_accessible:
        raise _Refusal(LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                       "this endpoint's caches are not remotely accessible "
                       "(its option 'llm.EnableRemoteCacheAccessible' is '0')")
    if msg is not Msg.PUSH_LOCAL and not link.peer_channel_ok(req["channel"]):
        raise _Refusal(LLMStatusCode.LLM_LINK_FAILED, f"data channel {req['channel']} is not usable")
    if req["target_kind"] == KIND_ADDRS:
        caches, pairs, total, landed = _serve_addrs(rt, msg, req)
        return caches, pairs, total, None, range(0), landed
    cache, row, ident = _resolve_target(rt, req)
    flags = req["flags"]
    if flags & F_BLOCKS and not cache.is_blocks_cache:
        raise _Refusal(LLMStatusCode.LLM_PARAM_INVALID, f"cache {cache.cache_id} is not a blocks cache")
    if flags & F_CONTIG and cache.is_blocks_cache:
        raise _Refusal(LLMStatusCode.LLM_PARAM_INVALID, f"cache {cache.cache_id} is a blocks cache")
    if req["data_type"] != cache.cache_desc.data_type.value:
        raise _Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                       f"data types differ: cache {cache.cache_id} holds {cache.cache_desc.data_type.name}, "
                       f"the request's cache holds data type {req['data_type']}")
    lay = cache.layout
    rows = list(req["rows"])
    if not rows:
        if row is None:
            raise _Refusal(LLMStatusCode.LLM_PARAM_INVALID, "no source rows given")
        rows = [row]
    bad = [r for r in rows if r >= lay.rows]
    if bad:
        arg = "src_blocks" if msg is Msg.PULL_REQ else "dst_blocks"
        what = "block" if cache.is_blocks_cache else "batch"
        raise _Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                       f"invalid argument '{arg}': {what} index {bad[0]} out of range [0, {lay.rows}) "
                       f"of cache {cache.cache_id}")
    if msg is not Msg.PULL_REQ and len(set(rows)) != len(rows):
        raise _Refusal(LLMStatusCode.LLM_PARAM_INVALID, "invalid argument 'dst_blocks': a block is named twice")
    per_layer = req["tensor_num_per_layer"]
    layers = (req["layer_first"], req["layer_last"])
    arg = "src_layer_range" if msg is Msg.PULL_REQ else "dst_layer_range"
    try:
        if per_layer < 1:
            raise param_invalid("tensor_num_per_layer", "must be >= 1")
        first, count = one_side_span(lay.num_tensors, layers, per_layer, arg)
    except LLMException as exc:
        raise _Refusal(exc.status_code, str(exc)) from None
    if count != req["tensor_count"]:
        raise _Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                       f"invalid argument '{arg}': the peer cache has {count} tensors in range, "
                       f"the local side {req['tensor_count']}")
    offset, nbytes = req["offset"], req["nbytes"]
    if nbytes == 0 or offset + nbytes > lay.row_bytes or (flags & F_EXACT and offset + nbytes != lay.row_bytes):
        raise _Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                       f"row size mismatch: cache {cache.cache_id} rows are {lay.row_bytes} bytes, "
                       f"the request moves {nbytes} bytes per row")
    pairs = lay.segments(first, count, rows, offset, nbytes)
    landed = [(cache, range(first, first + count), rows)] if offset == 0 and nbytes == lay.row_bytes else []
    return cache, pairs, count * len(rows) * nbytes, ident, range(first, first + count), landed


def _serve_local(rt: Runtime, link: Link, msg: Msg, req_id: int, req: dict, cache: KvCache, total: int,
                 pulled_key: KeyBinding | None, tensors: range, landed: list, *, nixl: bool = False) -> None:
    """Let the requester move the bytes itself: a same-host copy against our shared cache, or a
    NIXL READ/WRITE against our registered one. A pull reports back with DONE, a NIXL push
    with its WRITE's notification (a failed push with DONE)."""
    row = -1 if req["rows"] else _target_row(rt, req)
    peer = link.nixl if nixl else None
    assert peer is not None or not nixl, "nixl=True only once _nixl_serves saw the link's NIXL peer"
    plane = None if peer is None else peer.plane
    notified = None

    def ok() -> None:
        if pulled_key is not None:
            rt.registry.release_key(pulled_key, tensors)
            rt.registry.consume(pulled_key, tensors, cache.cache_desc.num_tensors)
        if msg is Msg.PUSH_REQ:
            for target, rows_tensors, rows in landed:
                rt.arrivals.record(target, rows_tensors, rows)
            link.send(Msg.DONE, req_id, status=LLMStatusCode.LLM_SUCCESS, text="")

    def failed() -> None:
        if pulled_key is not None:
            rt.registry.release_key(pulled_key, tensors)

    def abort() -> None:
        # The requester gave up before it saw our answer: it resets the channel it sent.
        ack = link.pull_acks.pop(req_id, None)
        if ack is not None:
            ack[1]()

    def settled(then: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            if link.serving.get(req_id) is abort:
                del link.serving[req_id]
            if plane is not None:
                plane.serve_end(cache.cache_id)
                if notified is not None and not notified.done():
                    notified.cancel()
            then()
        return run

    link.serving[req_id] = abort
    link.pull_acks[req_id] = (settled(ok), settled(failed))
    if peer is not None:
        peer.plane.serve_begin(cache.cache_id)
        if msg is Msg.PUSH_REQ:
            notified = peer.expect_push(req_id, f"NIXL push {req_id}")

            def arrived(f: asyncio.Future) -> None:
                if f.cancelled() or f.exception() is not None:
                    return
                ack = link.pull_acks.pop(req_id, None)
                if ack is not None:
                    ack[0]()

            notified.add_done_callback(arrived)
    link.send(Msg.RESP, req_id, status=LLMStatusCode.LLM_SUCCESS, total=total, cache_id=cache.cache_id, row=row,
              text="")


def _local_source(link: Link, req: dict, count: int, total: int) -> Any:
    """The pusher's source rows in its region we mapped, as copy pairs; None when we have not mapped it
    (the pusher then streams). A source that does not fit what it declared is refused."""
    region = None if link.local is None else link.local.region(req["src_cache_id"])
    if region is None:
        return None
    blob = req["src_rows"]
    first, nbytes = req["src_first"], req["src_nbytes"]
    if len(blob) % 8:
        raise _Refusal(LLMStatusCode.LLM_PARAM_INVALID, "PUSH_LOCAL source rows are malformed")
    rows = array.array("Q", blob)
    if (not rows or max(rows) >= region.rows or first + count > len(region.offsets) or not 0 < nbytes
            or nbytes > region.row_bytes or count * len(rows) * nbytes != total):
        raise _Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                       f"the pushed source does not fit cache {req['src_cache_id']} shared by the pusher")
    pairs = _core.segments(region.tensor_bases(first, count), array.array("q", rows), region.row_bytes, 0, nbytes)
    return pairs, region


def _serve_push_local(rt: Runtime, link: Link, req_id: int, req: dict) -> None:
    """A same-host push: copy the pusher's rows out of its shared region into ours.

    The answer (``RESP``) is sent once the copy is over, never before: on
    success the rows are recorded as arrived; after an ``ABORT`` or a failure
    the copy has stopped by the time the pusher reads the answer.
    """
    def answer(status: LLMStatusCode, text: str, cache_id: int = -1, total: int = 0) -> None:
        link.send(Msg.RESP, req_id, status=status, total=total, cache_id=cache_id, row=-1, text=text)

    try:
        cache, pairs, total, _ident, tensors, landed = _serve_plan(rt, link, Msg.PUSH_LOCAL, req)
        source = _local_source(link, req, len(tensors), total)
    except _Refusal as refusal:
        answer(refusal.code, refusal.text)
        return
    if source is None:
        answer(LLMStatusCode.LLM_SUCCESS, "", cache_id=USE_STREAM)
        return
    src_pairs, region = source
    timeout_ms = min(max(req["timeout_ms"], 1), MAX_SERVE_TIMEOUT_MS) + 1000
    settled = asyncio.get_running_loop().create_future()
    triples = _core.zip_segments(pairs, src_pairs)
    try:
        moved = rt.completions.start(lambda t: rt.copier.submit(t, triples), rt.copier.cancel,
                                     timeout_ms=timeout_ms, what=f"serving PUSH_LOCAL {req_id}",
                                     keepalive=(cache, region), settled=settled)
    except LLMException as exc:
        answer(exc.status_code, str(exc))
        return
    link.serving[req_id] = moved.cancel

    def over(_: asyncio.Future) -> None:
        if link.serving.get(req_id) == moved.cancel:
            del link.serving[req_id]
        if moved.done() and not moved.cancelled() and moved.exception() is None:
            for target, rows_tensors, rows in landed:
                rt.arrivals.record(target, rows_tensors, rows)
            answer(LLMStatusCode.LLM_SUCCESS, "", cache_id=cache.cache_id, total=total)
            return
        if not moved.done():
            moved.cancel()
        answer(LLMStatusCode.LLM_FAILED, "the push was aborted" if moved.cancelled() else str(moved.exception()))

    settled.add_done_callback(over)


def _nixl_serves(link: Link, cache: Any, req: dict) -> bool:
    """Whether the requester may move whole rows of ``cache`` with NIXL."""
    peer = link.nixl
    return (isinstance(cache, KvCache) and peer is not None and peer.serves(cache)
            and req["offset"] == 0 and req["nbytes"] == cache.layout.row_bytes)


def _target_row(rt: Runtime, req: dict) -> int:
    _, row, _ = _resolve_target(rt, req)
    return -1 if row is None else row


def handle_request(rt: Runtime, link: Link, msg: Msg, req_id: int, req: dict) -> None:
    """Serve a peer's PULL_REQ or PUSH_REQ, or its DONE after a pull (from the link's reader)."""
    if msg is Msg.DONE:
        ack = link.pull_acks.pop(req_id, None)
        failed = req["status"] != LLMStatusCode.LLM_SUCCESS
        if ack is not None:
            ack[1 if failed else 0]()
        if failed:
            # A requester that gave up a NIXL or same-host transfer waits for our word that nothing of
            # it is written or recorded here any more: the line above made sure of that.
            link.send(Msg.DONE, req_id, status=LLMStatusCode.LLM_FAILED, text="aborted")
        return
    if msg is Msg.PUSH_LOCAL:
        _serve_push_local(rt, link, req_id, req)
        return
    if msg not in (Msg.PULL_REQ, Msg.PUSH_REQ):
        return
    try:
        cache, pairs, total, ident, tensors, landed = _serve_plan(rt, link, msg, req)
    except _Refusal as refusal:
        link.send(Msg.RESP, req_id, status=refusal.code, total=0, cache_id=-1, row=-1, text=refusal.text)
        return
    pulled_key = ident if msg is Msg.PULL_REQ else None
    if pulled_key is not None and not rt.registry.claim_key(pulled_key, tensors):
        link.send(Msg.RESP, req_id, status=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, total=0, cache_id=-1, row=-1,
                  text="the key is being pulled by another request")
        return
    if req["flags"] & F_NIXL and _nixl_serves(link, cache, req):
        _serve_local(rt, link, msg, req_id, req, cache, total, pulled_key, tensors, landed, nixl=True)
        return
    if (msg is Msg.PULL_REQ and req["flags"] & F_LOCAL and isinstance(cache, KvCache) and link.local is not None
            and link.local.shared(cache)):
        _serve_local(rt, link, msg, req_id, req, cache, total, pulled_key, tensors, landed)
        return
    channel = req["channel"]
    generation = link.channels[channel].generation
    timeout_ms = min(max(req["timeout_ms"], 1), MAX_SERVE_TIMEOUT_MS) + 1000
    link.send(Msg.RESP, req_id, status=LLMStatusCode.LLM_SUCCESS, total=total, cache_id=-1, row=-1, text="")
    fut = link.move(channel, pairs, send=msg is Msg.PULL_REQ, timeout_ms=timeout_ms,
                    what=f"serving {msg.name} {req_id}", keepalive=cache)
    if pulled_key is not None:
        num = cache.cache_desc.num_tensors

        def consumed() -> None:
            rt.registry.release_key(pulled_key, tensors)
            rt.registry.consume(pulled_key, tensors, num)

        link.pull_acks[req_id] = (consumed, lambda: rt.registry.release_key(pulled_key, tensors))

    def abort() -> None:
        # Runs before the next control message is read: the key must be free again by then.
        fut.cancel()
        ack = link.pull_acks.pop(req_id, None)
        if ack is not None:
            ack[1]()

    link.serving[req_id] = abort

    def finished(f: asyncio.Future) -> None:
        if link.serving.get(req_id) is abort:
            del link.serving[req_id]
        exc = None if f.cancelled() else f.exception()
        if exc is None and not f.cancelled():
            if msg is Msg.PUSH_REQ:
                for target, rows_tensors, rows in landed:
                    rt.arrivals.record(target, rows_tensors, rows)
                link.send(Msg.DONE, req_id, status=LLMStatusCode.LLM_SUCCESS, text="")
            return
        ack = link.pull_acks.pop(req_id, None)
        if ack is not None:
            ack[1]()
        if not link.closed and link.broken is None:
            # ABORT first: the requester must drop the channel before it learns of the failure.
            if link.channels[channel].generation == generation:
                link.reset_channel(channel, tell_peer=True)
            if msg is Msg.PUSH_REQ:
                link.send(Msg.DONE, req_id, status=LLMStatusCode.LLM_FAILED,
                          text="cancelled" if exc is None else str(exc))

    fut.add_done_callback(finished)
