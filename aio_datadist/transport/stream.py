"""The stream plane: a request's bytes on its own data channel (a socket, or a TLS channel).

Both ends run one native scatter/gather job on the channel the request
names (``Link.move``): the byte stream is tensor-major, then row order,
identical on both ends. A pull of a key acknowledges with ``DONE`` so the
owner can consume the key (a pull of blocks by their blocks key consumes
nothing and sends none); a push is over when the owner confirms with ``DONE``. A job
that stops part-way leaves the channel out of step: both ends reset it
(``ABORT``) and the client dials it again.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aio_datadist import _trace
from aio_datadist.status import LLMStatusCode
from aio_datadist.transport.base import LinkPort, Plane, Request, Served, serve_timeout_ms
from aio_datadist.wire import Msg, Resp, Target, TransferReq

if TYPE_CHECKING:
    from aio_datadist.plans import Plan
    from aio_datadist.runtime import Runtime

__all__ = ["PLANE", "StreamPlane"]


class StreamPlane(Plane):
    """Always offered, serves every request the other planes do not, including raw addresses."""

    name = "stream"
    transport = "tcp"

    def transport_on(self, link: LinkPort) -> str:
        return link.data_transport

    def can_carry(self, link: LinkPort, plan: Plan, *, pull: bool) -> bool:
        return True

    async def carry(self, rt: Runtime, link: LinkPort, plan: Plan, answer: Resp, req: Request, *,
                    pull: bool) -> None:
        req_id = req.req_id
        done = None if pull else link.expect(req_id)
        settled = asyncio.get_running_loop().create_future()
        moving = link.move(req.channel, plan.local_pairs, send=not pull, timeout_ms=None, what=req.what,
                           keepalive=plan.local, settled=settled)
        req.settled, req.ack = settled, done
        if _trace.ON:
            _trace.mark("job submitted")
        await moving
        if _trace.ON:
            _trace.mark("job done")
        if pull and plan.remote.target_kind == Target.BLOCKS_KEY:
            return  # the owner's job is its own confirmation: no key to consume, so no DONE to wait for
        await req.finish()

    def serves(self, link: LinkPort, msg: Msg, req: TransferReq, served: Served) -> bool:
        return True

    def serve(self, rt: Runtime, link: LinkPort, msg: Msg, req_id: int, req: TransferReq, served: Served) -> None:
        channel = req.channel
        generation = link.channels[channel].generation
        link.send(Msg.RESP, req_id, status=LLMStatusCode.LLM_SUCCESS, total=served.total, cache_id=-1, row=-1,
                  text="")
        fut = self._serve_move(rt, link, msg, req_id, req, served)
        key, tensors = served.key if msg is Msg.PULL_REQ else None, served.tensors
        if key is not None:
            cache = served.cache
            assert cache is not None, "keys name registered caches"
            num = cache.cache_desc.num_tensors

            def consumed() -> None:
                rt.registry.release_key(key, tensors)
                rt.registry.consume(key, tensors, num)

            link.pull_acks[req_id] = (consumed, lambda: rt.registry.release_key(key, tensors))

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
            if _trace.ON:
                _trace.mark("owner: job done")
            served.ended(exc is None and not f.cancelled())
            if exc is None and not f.cancelled():
                if msg is Msg.PUSH_REQ:
                    for target, rows_tensors, rows in served.landed:
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

    def _serve_move(self, rt: Runtime, link: LinkPort, msg: Msg, req_id: int, req: TransferReq,
                    served: Served) -> asyncio.Future:
        """The owner's job on the request's channel; done once nothing of it touches a byte any more."""
        return link.move(req.channel, served.pairs, send=msg is Msg.PULL_REQ, timeout_ms=serve_timeout_ms(req),
                         what=f"serving {msg.name} {req_id}", keepalive=served.keepalive)


PLANE = StreamPlane()
