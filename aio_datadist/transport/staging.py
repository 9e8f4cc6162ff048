"""The staging plane: device caches on a data channel, through bounded page-locked host chunks.

Device memory cannot go to a socket. Each end that holds a device cache
moves its half of a stream-plane transfer through the staging pipeline
(``devices/staging.py``) instead of one scatter/gather job: the bytes on the
channel are the stream plane's (tensor-major, then row order), so the other
end may be a host cache on the stream plane or a device cache staging too,
and nothing on the wire changes.

* Sending (an owner serving a pull, a requester pushing): the D2H gather of
  chunk n+1 runs on the copy stream while chunk n is on the socket.
* Receiving: chunk n+1 comes off the socket while chunk n's H2D scatter runs.

Staging memory is the runtime's pool (``buffers x chunk_bytes``); a buffer is
reused only after the stream reported its copy done and its socket job is
over. On a NIXL link, a device cache that NIXL cannot take (not registered as
VRAM) is staged here, and the link records and logs once why
(``LinkStats.nixl_vram_off``). A transfer returns, fails or is given up only once every copy it
enqueued is done on the stream and every socket job settled, so no byte
lands after it returns.
"""

from __future__ import annotations

import array
import asyncio
import logging
from typing import TYPE_CHECKING, Any

import torch

from aio_datadist import _core
from aio_datadist.devices.staging import settle_all
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.transport.base import LinkPort, Request, Served, serve_timeout_ms
from aio_datadist.transport.stream import StreamPlane
from aio_datadist.wire import Msg, Resp, TransferReq

if TYPE_CHECKING:
    from aio_datadist.devices.staging import Chunk
    from aio_datadist.plans import Plan
    from aio_datadist.runtime import Runtime

__all__ = ["PLANE", "StagingPlane", "CUT_WAIT_S", "wait_cut_copies"]

log = logging.getLogger(__name__)

#: How long unregistering a registered device cache waits, blocking, for the copies a cut staged job queued on
#: the copy stream (at most the staging pool's chunks: milliseconds on a device that runs).
CUT_WAIT_S = 1.0


def wait_cut_copies(rt: Runtime, what: str) -> None:
    """A staged job that touches a registered device cache was cut because the caller unregistered the cache,
    which is the caller's memory again once that call returns: block until the copy stream has done what the
    job queued there, behind other work (at most :data:`CUT_WAIT_S`; a stuck device is logged)."""
    backend = rt.devices
    if backend is not None and not backend.wait_copies(CUT_WAIT_S):
        log.error("%s: the device copies of a staged job cut by unregistering its cache did not finish within "
                  "%.1f s (the device is stuck): they may still touch its memory", what, CUT_WAIT_S)


def _view_pairs(view: torch.Tensor) -> Any:
    return _core.segments(array.array("Q", [view.data_ptr()]), array.array("q", [0]), 0, 0, view.numel())


async def staged_move(rt: Runtime, link: LinkPort, channel: int, cache: Any, first: int, count: int,
                      rows: list[int], offset: int, nbytes: int, *, send: bool, what: str,
                      on_settled: asyncio.Future | None = None) -> None:
    """Move rows of a device ``cache`` over data channel ``channel`` through the staging pipeline.

    Returns or raises once every device copy and socket job it started is
    over. ``on_settled``, when given, is set at that point too.
    """
    staging = rt.staging
    loop = asyncio.get_running_loop()
    jobs: list[asyncio.Future] = []

    def job(chunk: Chunk, view: torch.Tensor) -> asyncio.Future:
        settled = loop.create_future()
        moving = link.move(channel, _view_pairs(view), send=send, timeout_ms=None, what=what, keepalive=view,
                           settled=settled)  # raises, starting nothing, when the channel is down (reset)
        jobs.append(settled)
        return moving

    try:
        if send:  # the link's share of the endpoint's buffers (one peer that stops reading holds no more)
            await staging.send(cache, first, count, rows, offset, nbytes, job, what, link)
        else:
            await staging.receive(cache, first, count, rows, offset, nbytes, job, what, link)
    finally:
        try:
            await settle_all(jobs)
        finally:
            if on_settled is not None and not on_settled.done():
                on_settled.set_result(None)


def _nixl_off(link: LinkPort, cache: Any) -> None:
    """A device cache staged on a NIXL link: if NIXL cannot take it, record and say (once per link) why."""
    peer = link.nixl
    if peer is None or not peer.usable():
        return
    why = peer.agent.device_staged(cache)
    if why is not None:
        link.counters.nixl_vram_off = why
        peer.say_staged(why)


class StagingPlane(StreamPlane):
    """The stream plane for an end whose cache is on the device (see the module docstring)."""

    name = "staging"

    def can_carry(self, link: LinkPort, plan: Plan, *, pull: bool) -> bool:
        return plan.local.on_device

    async def carry(self, rt: Runtime, link: LinkPort, plan: Plan, answer: Resp, req: Request, *,
                    pull: bool) -> None:
        _nixl_off(link, plan.local)
        done = None if pull else req.then
        settled = asyncio.get_running_loop().create_future()
        req.settled, req.ack = settled, done
        await staged_move(rt, link, req.channel, plan.local, plan.local_first, plan.local_count,
                          list(plan.local_rows), plan.local_offset, plan.local_nbytes, send=not pull,
                          what=req.what, on_settled=settled)
        if pull:
            link.unexpect(req.req_id)
        await req.finish()

    def serves(self, link: LinkPort, msg: Msg, req: TransferReq, served: Served) -> bool:
        cache = served.cache
        return cache is not None and cache.on_device

    def _cut_copies(self, rt: Runtime, req_id: int) -> None:
        # The job's task is cancelled, so it queues no copy after this.
        wait_cut_copies(rt, f"serving request {req_id}")

    def _serve_move(self, rt: Runtime, link: LinkPort, msg: Msg, req_id: int, req: TransferReq,
                    served: Served, answer: tuple[array.array, array.array] | None) -> asyncio.Future:
        cache = served.cache
        assert cache is not None, "serves() saw a registered device cache"
        assert req.rows or served.row is not None, "serve_plan refuses a request without rows"
        rows = list(req.rows) or [served.row or 0]
        _nixl_off(link, cache)

        async def run() -> None:
            limit_ms = serve_timeout_ms(req)
            scope = None
            try:
                async with asyncio.timeout(limit_ms / 1000) as scope:
                    if answer is not None:  # a posted pull: its header first, on the same channel
                        await link.move(req.channel, answer[1], send=True, timeout_ms=None,
                                        what=f"answering {req_id}", keepalive=answer[0])
                    await staged_move(rt, link, req.channel, cache, served.tensors.start, len(served.tensors),
                                      rows, req.offset, req.nbytes, send=msg is Msg.PULL_REQ,
                                      what=f"serving {msg.name} {req_id}")
            except TimeoutError:  # the requester hears this (StreamPlane.serve): say what ran out
                if scope is None or not scope.expired():
                    raise  # a socket's own ETIMEDOUT, not our clock
                raise LLMException(f"serving {msg.name} {req_id} timed out after {limit_ms} ms",
                                   status_code=LLMStatusCode.LLM_TIMEOUT) from None

        return asyncio.ensure_future(run())


PLANE = StagingPlane()
