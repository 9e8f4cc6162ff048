"""The NIXL plane: whole rows of registered caches moved by one NIXL READ (pull) or WRITE (push).

The owner answers ``RESP`` naming its cache, prepared for NIXL on the link
(``transport/nixl.py``). A READ ends with the requester's ``DONE``; a WRITE
carries a notification, and the owner confirms the push once that arrived. A
transfer that is given up is cancelled in NIXL and waited for (at most
``NIXL_SETTLE_S``) before the owner hears of it, so the owner never recycles
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
from collections.abc import Callable
from typing import TYPE_CHECKING

from aio_datadist import _trace
from aio_datadist.cache import KvCache
from aio_datadist.layers import one_side_span
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.transport.base import InPlacePlane, LinkPort, Request, Served
from aio_datadist.transport.device_ipc import fence, serve_fenced
from aio_datadist.transport.nixl import notif_for
from aio_datadist.wire import Msg, ReqFlag, Resp, TransferReq

if TYPE_CHECKING:
    from aio_datadist.plans import Plan
    from aio_datadist.runtime import Runtime

__all__ = ["PLANE", "NixlPlane"]


class NixlPlane(InPlacePlane):
    """Offered when the link's NIXL peer is usable and the plan moves whole rows of a registered cache."""

    name = "nixl"
    transport = "nixl"
    flag = ReqFlag.NIXL

    async def prepare(self, link: LinkPort, plan: Plan) -> None:
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

    async def carry(self, rt: Runtime, link: LinkPort, plan: Plan, answer: Resp, req: Request, *,
                    pull: bool) -> None:
        peer = link.nixl
        remote = plan.remote
        req_id, what = req.req_id, req.what
        region = None if peer is None else peer.caches.get(answer.cache_id)
        if peer is None or region is None:
            raise LLMException(f"cluster {link.remote_cluster_id} cache {answer.cache_id} is not prepared for NIXL",
                               status_code=LLMStatusCode.LLM_LINK_FAILED)
        first, count = one_side_span(region.tensors, (remote.layer_first, remote.layer_last),
                                     remote.tensor_num_per_layer, "src_layer_range" if pull else "dst_layer_range")
        if count != plan.local_count:
            raise LLMException(f"cluster {link.remote_cluster_id} resolved a cache that does not fit the request",
                               status_code=LLMStatusCode.LLM_LINK_FAILED)
        rows = list(remote.rows) or [answer.row]
        if plan.local.on_device:  # NIXL reads or writes final rows only (the owner fenced before it answered)
            await fence(rt, None, what)
        done = None if pull else link.expect(req_id)
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
                # NIXL failed a transfer it had accepted: the peer's agent went away or the fabric failed
                raise LLMException(f"{what}: NIXL transfer with cluster {link.remote_cluster_id} failed "
                                   f"({failure(exc)})",
                                   status_code=LLMStatusCode.LLM_LINK_FAILED) from None
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


PLANE = NixlPlane()
