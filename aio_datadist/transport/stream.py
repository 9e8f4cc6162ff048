"""The stream plane: a request's bytes on its own data channel (a socket, or a TLS channel).

Both ends run one native scatter/gather job on the channel the request
names (``Link.move``): the byte stream is tensor-major, then row order,
identical on both ends. A pull over a plain socket posts its receive before
the request goes out (``ReqFlag.POSTED``): the owner answers on the channel
with an ``ANSWER`` header ahead of the bytes instead of ``RESP``, and the
requester's gated receive reads the header before anything else. A pull of a key acknowledges with ``DONE`` so the
owner can consume the key (a pull of blocks by their blocks key consumes
nothing and sends none); a push is over when the owner confirms with ``DONE``. A job
that stops part-way leaves the channel out of step: both ends reset it
(``ABORT``) and the client dials it again.
"""

from __future__ import annotations

import array
import asyncio
from typing import TYPE_CHECKING, Any

from aio_datadist import _trace
from aio_datadist.status import LLMException, LLMStatusCode, code_to_status
from aio_datadist.transport.base import (
    UNLINKING,
    LinkPort,
    Plane,
    Refused,
    Request,
    RequestState,
    Served,
    await_done,
    push_torn,
    serve_timeout_ms,
    stop_status,
)
from aio_datadist.views import mark_retrieved
from aio_datadist.wire import ANSWER, ANSWER_MAGIC, MAX_TEXT, Msg, ReqFlag, Resp, Target, TransferReq, peer_text

if TYPE_CHECKING:
    from aio_datadist.plans import Plan
    from aio_datadist.runtime import Runtime

__all__ = ["PLANE", "StreamPlane", "answer_header", "refuse_posted"]


def answer_header(status: int, req_id: int, total: int, text: bytes = b"") -> tuple[array.array, array.array]:
    """The ``ANSWER`` header of a posted pull (and a refusal's text after it), and its ``[addr, nbytes]``
    run; the array must be kept alive while a job sends it."""
    header = array.array("B", ANSWER.pack(ANSWER_MAGIC, status & 0xFFFFFFFF, req_id, total) + text)
    return header, array.array("Q", (header.buffer_info()[0], len(header)))


def refuse_posted(link: LinkPort, req_id: int, req: TransferReq, status: int, text: str) -> bool:
    """Refuse a pull whose receive is posted on its channel (``ReqFlag.POSTED``) there: the header with
    the status, then the text. False when we do not hold that channel in step (refuse with ``RESP``)."""
    if not link.peer_channel_ok(req.channel):
        return False
    raw = text.encode()[:MAX_TEXT]
    header, pairs = answer_header(status, req_id, len(raw), raw)
    sent = link.move(req.channel, pairs, send=True, timeout_ms=serve_timeout_ms(req), what=f"refusing {req_id}",
                     keepalive=header)
    sent.add_done_callback(mark_retrieved)  # unsent: the requester's receive fails with its channel
    link.answering(req.channel, sent)
    return True


#: The codes of our own failures that the requester hears as they are (a passing shortage it may retry on); any
#: other failure of ours (a device copy's, our serving time's) is LLM_FAILED to it.
_OWN_CODES = (LLMStatusCode.LLM_OUT_OF_MEMORY, LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY)


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
        done = None if pull else req.then
        settled = asyncio.get_running_loop().create_future()
        moving = link.move(req.channel, plan.local_pairs, send=not pull, timeout_ms=None, what=req.what,
                           keepalive=plan.local, settled=settled)
        req.settled, req.ack = settled, done
        if _trace.ON:
            _trace.mark("job submitted")
        await moving
        if pull:
            link.unexpect(req_id)
        if _trace.ON:
            _trace.mark("job done")
        if pull and plan.remote.target_kind == Target.BLOCKS_KEY:
            return  # the owner's job is its own confirmation: no key to consume, so no DONE to wait for
        await req.finish()

    async def pull_posted(self, link: LinkPort, plan: Plan, req: Request, timeout_ms: int) -> None:
        """A pull whose receive is posted with its request (``ReqFlag.POSTED``): one gated
        receive on the request's channel takes the owner's ``ANSWER`` header and then the bytes, so
        no ``RESP`` round trip and no second hand-off to the engine stand between the request and
        its bytes. A refusal is the header and its text on the channel, which stays in step; an owner
        that refuses with ``RESP`` instead (a channel it does not hold in step) gets the channel reset."""
        req_id = req.req_id
        answered = link.expect(req_id)
        # The request leaves first: the answer waits in the socket until the receive is queued, and what
        # the receive needs (its header and runs, the hand-off to the engine thread) is made while the
        # owner wakes, instead of delaying the request. Nothing awaits in between, so the loop reads no
        # answer before the receive is posted.
        link.send_record(Msg.PULL_REQ, req_id, plan.remote, channel=req.channel, timeout_ms=timeout_ms,
                         flags=plan.remote.flags | ReqFlag.POSTED)
        req.state = RequestState.ASKED
        if _trace.ON:
            _trace.mark("request sent")
        header, pairs = answer_header(0, 0, 0)
        pairs.extend(plan.local_pairs)
        settled = asyncio.get_running_loop().create_future()
        moving = link.move(req.channel, pairs, send=False, timeout_ms=None, what=req.what,
                           keepalive=(plan.local, header), settled=settled, gated=req_id)
        req.settled = settled

        def answered_instead(f: asyncio.Future) -> None:
            if not f.cancelled() and not moving.done():
                moving.cancel()  # RESP (or the link failed): the owner will not answer on the channel

        answered.add_done_callback(answered_instead)
        req.then = answered  # a failed RESP, also after the answer header: the owner stopped part-way
        task = asyncio.current_task()
        cancelling = 0 if task is None else task.cancelling()  # a task in its own cleanup may be at 1 already
        try:
            moved = await moving
        except asyncio.CancelledError:
            if task is None or task.cancelling() > cancelling or not answered.done():
                raise  # our caller cancelled us
            answer: Resp = answered.result()  # the link's failure, if that was it
            why = answer.text or (f"answered posted request {req_id} on the control connection with "
                                  f"{'an accepting' if answer.status == 0 else 'a'} {type(answer).__name__.upper()}, "
                                  f"not on data channel {req.channel}")
            raise LLMException(f"cluster {link.remote_cluster_id}: {why}",
                               status_code=code_to_status(answer.status) if answer.status else
                               LLMStatusCode.LLM_LINK_FAILED) from None
        link.pending.pop(req_id, None)
        if _trace.ON:
            _trace.mark("job done")
        magic, status, answered_id, total = ANSWER.unpack(header)
        if magic != ANSWER_MAGIC or answered_id != req_id:
            raise LLMException(f"cluster {link.remote_cluster_id} answered request {req_id} on data channel "
                               f"{req.channel} with a malformed header", status_code=LLMStatusCode.LLM_LINK_FAILED)
        if status:
            raise Refused(f"cluster {link.remote_cluster_id}: {await self._refusal_text(link, req, total)}",
                          status_code=code_to_status(status))
        if total != plan.total or moved != ANSWER.size + plan.total:  # the gate stopped after the header
            raise LLMException(f"cluster {link.remote_cluster_id} offers {total} bytes, {plan.total} expected",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        req.state = RequestState.MOVING
        if plan.remote.target_kind != Target.BLOCKS_KEY:
            await req.finish()  # DONE: the owner may consume the key

    @staticmethod
    async def _refusal_text(link: LinkPort, req: Request, length: int) -> str:
        """The text after a refusal's header (the channel is in step again once it is read)."""
        if length > MAX_TEXT:
            raise LLMException(f"cluster {link.remote_cluster_id} refused request {req.req_id} with a "
                               f"{length}-byte text (at most {MAX_TEXT})", status_code=LLMStatusCode.LLM_LINK_FAILED)
        if not length:
            return "refused"
        text = array.array("B", bytes(length))
        settled = asyncio.get_running_loop().create_future()
        reading = link.move(req.channel, array.array("Q", (text.buffer_info()[0], length)), send=False,
                            timeout_ms=None, what=req.what, keepalive=text, settled=settled)
        req.settled = settled  # only once a receive was started (a channel gone meanwhile starts none)
        await reading
        return peer_text(text.tobytes())

    def serves(self, link: LinkPort, msg: Msg, req: TransferReq, served: Served) -> bool:
        return True

    def serve(self, rt: Runtime, link: LinkPort, msg: Msg, req_id: int, req: TransferReq, served: Served) -> None:
        channel = req.channel
        generation = link.channels[channel].generation
        answer = None
        if msg is Msg.PULL_REQ and req.flags & ReqFlag.POSTED:
            answer = answer_header(0, req_id, served.total)
        else:
            link.send(Msg.RESP, req_id, status=LLMStatusCode.LLM_SUCCESS, total=served.total, cache_id=-1, row=-1,
                      text="")
        fut = self._serve_move(rt, link, msg, req_id, req, served, answer)
        link.answering(channel, fut)
        if msg is Msg.PUSH_REQ:
            link.served_pushes[req_id] = fut  # stopped and awaited before our UNLINK (Link.settle_served)
        key, tensors = served.key if msg is Msg.PULL_REQ else None, served.tensors
        if key is not None:
            cache = served.cache
            assert cache is not None, "keys name registered caches"
            num = cache.cache_desc.num_tensors

            def consumed() -> None:
                rt.registry.release_key(key, tensors)
                rt.registry.consume(key, tensors, num)

            await_done(link, req_id, req, consumed, lambda: rt.registry.release_key(key, tensors))

        stopped: list[LLMStatusCode] = []  # how it counts, taken when the link stopped us (``stop_status``)

        def abort() -> None:
            # Runs before the next control message is read: the key must be free again by then.
            stopped.append(stop_status(link))
            fut.cancel()
            ack = link.pull_acks.pop(req_id, None)
            if ack is not None:
                ack[1]()

        link.serving[req_id] = abort
        told: list[bool] = []  # whether the requester was told why we stopped (``cut``)

        def cut() -> None:
            # The caller unregistered a cache this request reads or writes (``CacheRegistry.serving``): the
            # memory is the caller's again once we return, so the job stops here and now. Resetting the
            # channel stops it at once (a loop job is stopped, the engine detaches the fd before the reset
            # returns, a TLS channel stops filling memory); the requester hears why first, then the ABORT.
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                return  # every byte moved: the job is over, and ``finished`` reports it
            if not fut.done():  # else ``finished`` tells the requester of the failure that stopped it
                told.append(True)
                text = "the cache was unregistered while the request was served"
                if msg is Msg.PUSH_REQ:
                    link.send(Msg.DONE, req_id, status=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, text=text)
                else:
                    link.send(Msg.RESP, req_id, status=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, total=0,
                              cache_id=-1, row=-1, text=text)
            ch = link.channels[channel]
            if ch.generation == generation and ch.sock is not None:
                link.reset_channel(channel, tell_peer=True, req_id=req_id)
            fut.cancel()
            self._cut_copies(rt, req_id)

        caches = served.keepalive if isinstance(served.keepalive, list) else [served.keepalive]
        unwatch = rt.registry.serving(caches, cut)

        def finished(f: asyncio.Future) -> None:
            if unwatch is not None:
                unwatch()
            if link.serving.get(req_id) is abort:
                del link.serving[req_id]
            if link.served_pushes.get(req_id) is f:
                del link.served_pushes[req_id]
            exc = None if f.cancelled() else f.exception()
            if _trace.ON:
                _trace.mark("owner: job done")
            status = exc.status_code if isinstance(exc, LLMException) else LLMStatusCode.LLM_FAILED
            ours = exc is not None and status is not LLMStatusCode.LLM_LINK_FAILED  # failed here, not by the channel
            if status is LLMStatusCode.LLM_LINK_FAILED and not link.down:
                # The channel failed under a link that is up: the requester gave the request up (it resets the
                # channel before its ABORT comes), which every plane counts as LLM_FAILED, as for the ABORT.
                status = LLMStatusCode.LLM_FAILED
            elif f.cancelled() and stopped[:1] == [LLMStatusCode.LLM_LINK_FAILED] and not told:
                # Stopped by the teardown of a link that failed (its heartbeat, its control connection): the
                # peer's failure, not an abort of the requester's (found by audit).
                status = LLMStatusCode.LLM_LINK_FAILED
            served.ended(exc is None and not f.cancelled(), status)
            if exc is None and not f.cancelled():
                if msg is Msg.PUSH_REQ:
                    for target, rows_tensors, rows in served.landed:
                        rt.arrivals.record(target, rows_tensors, rows)
                    link.send(Msg.DONE, req_id, status=LLMStatusCode.LLM_SUCCESS, text="")
                return
            if msg is Msg.PUSH_REQ and served.landed:
                push_torn(rt, link, served, exc if exc is not None else LLMException(
                    "the cache was unregistered while the request was served",
                    status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST) if told else "the push was aborted")
            ack = link.pull_acks.pop(req_id, None)
            if ack is not None:
                ack[1]()
            if not link.down:
                if ours and not told:
                    # Our job failed for a reason of ours (a staged job's device copy, its serving time): the
                    # requester hears why before its channel is reset, as for a cut, and waits for that word when
                    # it sees the reset (``transfers``: a reset alone reads as a failed link). A reply to a
                    # request it gave up meanwhile is dropped.
                    told.append(True)
                    why = str(exc) or type(exc).__name__
                    code = status if status in _OWN_CODES else LLMStatusCode.LLM_FAILED
                    if msg is Msg.PUSH_REQ:
                        link.send(Msg.DONE, req_id, status=code, text=why)
                    else:
                        link.send(Msg.RESP, req_id, status=code, total=0, cache_id=-1, row=-1, text=why)
                # Else ABORT first: the requester drops the channel before it learns that we stopped.
                if link.channels[channel].generation == generation:
                    link.reset_channel(channel, tell_peer=True)
                if msg is Msg.PUSH_REQ and not told:
                    if exc is None and link.ending:  # stopped because the link ends: the pusher's push fails so
                        link.send(Msg.DONE, req_id, status=LLMStatusCode.LLM_NOT_YET_LINK, text=UNLINKING)
                    else:
                        link.send(Msg.DONE, req_id, status=LLMStatusCode.LLM_FAILED,
                                  text="cancelled" if exc is None else str(exc))

        fut.add_done_callback(finished)

    def _cut_copies(self, rt: Runtime, req_id: int) -> None:
        """After a cut: wait, blocking, until no copy of the served job's that this plane queued elsewhere
        than the channel touches the cache any more. The stream plane queues none (the channel's job is
        stopped by the reset)."""

    def _serve_move(self, rt: Runtime, link: LinkPort, msg: Msg, req_id: int, req: TransferReq,
                    served: Served, answer: tuple[array.array, array.array] | None) -> asyncio.Future:
        """The owner's job on the request's channel (after the ``answer`` header of a posted pull, in the
        same job); done once nothing of it touches a byte any more."""
        pairs: Any = served.pairs
        keepalive = served.keepalive
        if answer is not None:
            header, pairs = answer
            pairs.extend(served.pairs)
            keepalive = (keepalive, header)
        return link.move(req.channel, pairs, send=msg is Msg.PULL_REQ, timeout_ms=serve_timeout_ms(req),
                         what=f"serving {msg._name_} {req_id}", keepalive=keepalive)


PLANE = StreamPlane()
