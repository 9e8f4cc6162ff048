"""The device IPC plane: device caches between same-host processes, one batched device copy per transfer.

Each end of a same-host link maps the other's library-allocated device
caches read-only (``devices/ipc.py``, records on the share socket of
``transport/local.py``). Then:

* A pull is one batched device-to-device copy by the requester, out of the
  owner's mapped cache into its own, on its copy stream (``DeviceCopy``),
  completed through the StreamNotifier; then ``DONE``. Before answering, the
  owner waits until its copy stream is past the work already on its current
  stream (a fence), as the staging plane's gather would.
* A push is ``PUSH_LOCAL`` (as for host caches): the pusher fences its own
  stream, the owner copies the rows out of the pusher's mapped cache into its
  own on its copy stream and answers once the copy is over.

An export withdrawn while the owner fences (the cache deallocated, the share
lost) is never named in the answer: the owner serves that pull through the
staging plane instead (the cache's memory lives while it is served), and a
requester that finds the owner withdrew the cache it named fails the pull
with ``LLM_KV_CACHE_NOT_EXIST``, not as a link failure.

No peer ever writes our memory. A copy that is given up (timeout, cancel,
``ABORT``) is marked cancelled and waited for: the call returns only once its
stream reported the copy over, so no byte lands after it returned.

Where device IPC cannot carry a transfer (a registered device cache, a peer
that could not map ours, one end on the host, raw addresses) the staging
plane does, and the link's stats say why (``LinkStats.device_ipc_off``).
"""

from __future__ import annotations

import array
import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aio_datadist.devices.copies import DeviceCopy, cache_side
from aio_datadist.devices.ipc import ExportInvalid
from aio_datadist.layers import one_side_span
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.transport.base import (
    InPlacePlane,
    LinkPort,
    Refusal,
    Request,
    Served,
    meets,
    serve_timeout_ms,
    stop_status,
    time_left,
)
from aio_datadist.transport.same_host import MAX_LOCAL_SRC_ROWS, USE_STREAM, push_local, serve_copy
from aio_datadist.transport.staging import PLANE as STAGING
from aio_datadist.wire import Msg, ReqFlag, Resp, TransferReq

if TYPE_CHECKING:
    from aio_datadist.devices.copies import Side
    from aio_datadist.plans import Plan
    from aio_datadist.runtime import Runtime

__all__ = ["PLANE", "DeviceIpcPlane"]


def _link_failed(link: LinkPort, text: str) -> LLMException:
    return LLMException(f"cluster {link.remote_cluster_id} {text}", status_code=LLMStatusCode.LLM_LINK_FAILED)


async def copy_rows_settled(rt: Runtime, dst: Side, src: Side, nbytes: int, what: str, keepalive: Any) -> int:
    """One batched device copy on our copy stream; a caller that gives up returns only once the stream
    reported it over (cancelled or not)."""
    backend = rt.devices
    assert backend is not None, "device caches exist only with a device backend"
    job = DeviceCopy(backend, dst, src, nbytes, keepalive=keepalive)
    # Our own stream: it does get there, and nothing may land afterwards (so no bound on the wait).
    return await rt.completions.run(job.submit, job.cancel, timeout_ms=None, what=what, keepalive=job)


async def fence(rt: Runtime, timeout_ms: int | None, what: str) -> None:
    """Wait until the copy stream is past the work on the caller's current stream (``timeout_ms`` None: the
    caller's own timeout bounds it)."""
    backend = rt.devices
    assert backend is not None, "device caches exist only with a device backend"
    done = rt.completions.start(backend.fence, backend.cancel, timeout_ms=timeout_ms, what=f"{what} (stream fence)")
    await done


class DeviceIpcPlane(InPlacePlane):
    """Offered for pulls into device caches when the link's share maps device caches; pushes by
    :meth:`move_alone`."""

    name = "device-ipc"
    transport = "local"
    flag = ReqFlag.DEVICE

    def can_carry(self, link: LinkPort, plan: Plan, *, pull: bool) -> bool:
        share = link.local
        # Row for row (a contiguous row cut into blocks takes the staging plane: one copy per side here).
        row_for_row = ((len(plan.remote.rows) or 1) == len(plan.local_rows)
                       and plan.remote.nbytes == plan.local_nbytes)
        return (pull and share is not None and share.imports_devices and plan.local.on_device
                and not plan.by_address and row_for_row)

    async def carry(self, rt: Runtime, link: LinkPort, plan: Plan, answer: Resp, req: Request, *,
                    pull: bool) -> None:
        """One batched copy out of the owner's mapped (read-only) device cache, then ``DONE``."""
        share = link.local
        peer = None if share is None else share.device_region(answer.cache_id)
        if peer is None:
            if share is not None and not share.closed:
                # The owner withdrew it (its record's DEL, read before we got here): deallocated after it
                # answered. The link is fine; the cache is gone.
                raise LLMException(f"cluster {link.remote_cluster_id} withdrew device cache {answer.cache_id} "
                                   "(deallocated) during the pull", status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
            raise _link_failed(link, f"device cache {answer.cache_id} is not mapped here")
        remote = plan.remote
        first, count = one_side_span(peer.num_tensors, (remote.layer_first, remote.layer_last),
                                     remote.tensor_num_per_layer, "src_layer_range")
        rows = list(remote.rows) or [answer.row]
        if count != remote.tensor_count or len(rows) != len(plan.local_rows) or remote.nbytes != plan.local_nbytes:
            raise _link_failed(link, "shared a device cache that does not fit the request")
        try:
            src = peer.side(rows, remote.offset, remote.nbytes, first, count)
        except ExportInvalid as exc:
            raise _link_failed(link, f"shared a device cache that does not fit the request: {exc}") from None
        dst = cache_side(plan.local, plan.local_rows, plan.local_offset, plan.local_nbytes, plan.local_first,
                         plan.local_count)
        await copy_rows_settled(rt, dst, src, plan.local_nbytes, req.what, (plan.local, peer))
        await req.finish()  # DONE, or the link's failure when it went meanwhile

    async def move_alone(self, rt: Runtime, link: LinkPort, plan: Plan, timeout_ms: int, what: str, *,
                         queue_ms: int | None = None) -> bool:
        """A push from a device cache whose export reached the owner: it maps it (if it has not yet) and copies
        the rows out of it itself, or answers that it cannot (we then stage)."""
        share = link.local
        # Row for row, as a pull (a source row cut into blocks, transfer_cache_async's dst_block_memory_size,
        # takes the staging plane: the owner copies one source row per destination row here).
        row_for_row = ((len(plan.remote.rows) or 1) == len(plan.local_rows)
                       and plan.remote.nbytes == plan.local_nbytes)
        if (share is None or not plan.local.on_device or not share.device_offered(plan.local) or plan.by_address
                or len(plan.local_rows) > MAX_LOCAL_SRC_ROWS or not row_for_row):
            return False
        deadline = asyncio.get_running_loop().time() + timeout_ms / 1000
        await fence(rt, timeout_ms, what)  # the rows are final on our device before the owner reads them
        return await push_local(link, plan, time_left(deadline, what), what, queue_ms=queue_ms)  # one time-out

    def serves(self, link: LinkPort, msg: Msg, req: TransferReq, served: Served) -> bool:
        cache = served.cache
        return (msg is Msg.PULL_REQ and cache is not None and cache.on_device and link.local is not None
                and link.local.device_shared(cache))

    def serve(self, rt: Runtime, link: LinkPort, msg: Msg, req_id: int, req: TransferReq, served: Served) -> None:
        """Answer once our copy stream is past what our current stream had enqueued (a fence), then as
        every in-place plane does, if the peer still maps the cache; else through the staging plane."""
        def answer() -> None:
            cache = served.cache
            share = link.local
            if cache is not None and share is not None and share.device_shared(cache):
                InPlacePlane.serve(self, rt, link, msg, req_id, req, served)
                return
            # Withdrawn during the fence (deallocated: its DEL went to the peer, which no longer maps it; or the
            # share was lost): an answer naming it would fail the pull as a link failure. Its memory lives while
            # it is served (an in-flight pull of an allocated cache is not cut): staged, as if never shared.
            staged = STAGING.transport_on(link)
            if not meets(staged, rt.settings.require_transport):
                raise Refusal(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                              "the device cache was deallocated while the request was served")
            served.transport = staged  # counted as what carries it
            STAGING.serve(rt, link, msg, req_id, req, served)

        serve_fenced(rt, link, msg, req_id, req, served, answer)

    def serve_alone(self, rt: Runtime, link: LinkPort, req_id: int, req: Any, served: Served) -> None:
        """The owner's half of a device push: copy the pusher's rows out of its mapped export into our device
        cache on our copy stream; ``RESP`` once the copy is over (the pusher streams where we mapped nothing)."""
        def answer(status: LLMStatusCode, text: str, cache_id: int = -1) -> None:
            link.send(Msg.RESP, req_id, status=status, total=0, cache_id=cache_id, row=-1, text=text)

        cache = served.cache
        assert cache is not None and cache.on_device, "same-host serve_alone sends device caches here"
        try:
            sides = _push_sides(link, req, served)
        except Refusal as refusal:
            link.counters.refused("served_push", self.transport, refusal.code)
            answer(refusal.code, refusal.text)
            return
        if sides is None:
            answer(LLMStatusCode.LLM_SUCCESS, "", cache_id=USE_STREAM)
            return
        dst, src, nbytes, peer = sides
        backend = rt.devices
        assert backend is not None, "device caches exist only with a device backend"
        job = DeviceCopy(backend, dst, src, nbytes, keepalive=(cache, peer))
        serve_copy(rt, link, req_id, req, served, job.submit, job.cancel, job, self.transport)


def serve_fenced(rt: Runtime, link: LinkPort, msg: Msg, req_id: int, req: TransferReq, served: Served,
                 answer: Callable[[], None]) -> None:
    """Serve a request against a device cache in place: ``answer()`` (which sends ``RESP``) only once our copy
    stream is past what our current stream had enqueued (a fence), so the peer touches final rows. A
    requester that gives up meanwhile (``DONE`` failed) is heard; a fence that fails refuses the request, and
    so does an ``answer()`` that raises :class:`Refusal` (with its code)."""
    backend = rt.devices
    assert backend is not None, "serves() saw a device cache"
    given_up: list[LLMStatusCode] = []  # heard that the request stopped: how it counts then (``stop_status``)

    def hear() -> None:
        given_up.append(stop_status(link))

    waiting = (hear, hear)
    link.pull_acks[req_id] = waiting

    def failed(status: LLMStatusCode, text: str) -> None:
        served.ended(False, status)
        if served.key is not None:
            rt.registry.release_key(served.key, served.tensors)
        if not given_up and not link.down:
            link.send(Msg.RESP, req_id, status=status, total=0, cache_id=-1, row=-1, text=text)

    def fenced(f: asyncio.Future) -> None:
        if link.pull_acks.get(req_id) is waiting:
            del link.pull_acks[req_id]
        if f.cancelled() or f.exception() is not None:
            exc = None if f.cancelled() else f.exception()
            code = exc.status_code if isinstance(exc, LLMException) else LLMStatusCode.LLM_FAILED
            failed(code, f"device stream fence failed: {exc}")
            return
        if given_up or link.down:
            failed(given_up[0] if given_up else stop_status(link), "abandoned")
            return
        try:
            answer()
        except Refusal as refusal:  # counted as the request's end (served.ended), as a failed fence is
            failed(refusal.code, refusal.text)

    try:
        done = rt.completions.start(backend.fence, backend.cancel, timeout_ms=serve_timeout_ms(req),
                                    what=f"serving {msg.name} {req_id} (stream fence)")
    except LLMException as exc:
        if link.pull_acks.get(req_id) is waiting:
            del link.pull_acks[req_id]
        failed(exc.status_code, str(exc))
        return
    done.add_done_callback(fenced)


def _push_sides(link: LinkPort, req: Any, served: Served) -> tuple[Side, Side, int, Any] | None:
    """Our rows and the pusher's mapped rows of a device ``PUSH_LOCAL``; None when we mapped no such cache of
    the pusher's (it streams). A source that does not fit what it declared is refused."""
    cache = served.cache
    assert cache is not None, "PUSH_LOCAL names a registered cache"
    peer = None if link.local is None else link.local.device_region(req.src_cache_id)
    if peer is None:
        return None
    blob, nbytes = req.src_rows, req.src_nbytes
    rows = array.array("Q", blob) if len(blob) % 8 == 0 else None
    dst_rows = list(req.rows) or ([] if served.row is None else [served.row])
    count = len(served.tensors)
    if (rows is None or not rows or len(rows) != len(dst_rows) or nbytes != req.nbytes
            or count * len(rows) * nbytes != served.total):
        raise Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                      f"the pushed source does not fit device cache {req.src_cache_id} shared by the pusher")
    try:
        src = peer.side(list(rows), req.src_offset, nbytes, req.src_first, count)
    except ExportInvalid as exc:
        raise Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                      f"the pushed source does not fit device cache {req.src_cache_id}: {exc}") from None
    dst = cache_side(cache, dst_rows, req.offset, nbytes, served.tensors.start, count)
    return dst, src, nbytes, peer


PLANE = DeviceIpcPlane()
