"""The requester's half of a transfer: offer the planes that can carry a plan, let the chosen one move it.

A :class:`~aio_datadist.plans.Plan` names the local rows and the request
for the owner. The requester sends the request once, on a data channel of
its own, offering the fastest in-place plane that can carry it (NIXL, then
same-host) besides the stream plane; the owner checks it (``owner.py``) and
answers ``RESP``, naming a cache when it chose the in-place plane. A pull
with no in-place plane to offer posts its receive first and takes its
answer on the data channel (``StreamPlane.pull_posted``). The plane
the owner chose then moves the bytes (``transport/``). A same-host push is
the same-host plane's own request (its ``move_alone``), tried first; a pull
a plane can carry without asking (its ``reader``: the same-host and NIXL
planes, for a blocks cache the owner's read ledger lists) asks nothing.

One :class:`~aio_datadist.transport.base.Request` per transfer holds its
state and the one timer that bounds it; a request that is given up returns
only once no byte of it can land any more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any

from aio_datadist import _trace
from aio_datadist._checks import named_by_caller
from aio_datadist.plans import Plan
from aio_datadist.stats import Outcome
from aio_datadist.status import LLMException, LLMStatusCode, code_to_status
from aio_datadist.transport import plane, planes_for
from aio_datadist.transport.base import ABORT_ACK_S, Plane, Refused, Request, RequestState, meets, time_left
from aio_datadist.transport.same_host import MAX_LOCAL_SRC_ROWS
from aio_datadist.transport.staging import wait_cut_copies
from aio_datadist.transport.stream import PLANE as STREAM_PLANE
from aio_datadist.types import UINT64_MAX
from aio_datadist.wire import Msg, Resp, Target

if TYPE_CHECKING:
    from aio_datadist.links import Link
    from aio_datadist.runtime import Runtime

__all__ = ["run_pull", "run_push"]

async def run_pull(rt: Runtime, link: Link, plan: Plan, timeout_ms: int, what: str, *,
                   names: Mapping[str, str] | None = None) -> None:
    """Ask the owner for bytes and receive them straight into ``plan.local``. ``names``: the caller's
    names for the arguments the owner's refusals name (``_checks.named_by_caller``)."""
    with named_by_caller(names or {}):  # an owner's refusal (``Refused``, a same-host push's answer) in its words
        await _counted(link, "pull", plan.total, _pull(rt, link, plan, timeout_ms, what))


async def run_push(rt: Runtime, link: Link, plan: Plan, timeout_ms: int, what: str, *,
                   queue_ms: int | None = None, cut: Callable[[], LLMStatusCode | None] | None = None,
                   names: Mapping[str, str] | None = None) -> None:
    """Send ``plan.local``'s bytes to the owner; returns once it confirmed. ``queue_ms``: the time-out
    counts from when the push has a data channel, the wait for one bounded by ``queue_ms`` more. ``cut``:
    asked when the push is cancelled, the status of the failure for which the library cut it (a layer-wise
    transfer's destination failed), counted as that failure; None: the caller cancelled it. ``names``: as
    :func:`run_pull`'s."""
    with named_by_caller(names or {}):
        await _counted(link, "push", plan.total, _push(rt, link, plan, timeout_ms, what, queue_ms), cut)


async def _pull(rt: Runtime, link: Link, plan: Plan, timeout_ms: int, what: str) -> str:
    # One time-out for the whole pull: a reader that gives it back (a NIXL read whose ledger word said no, after
    # its READ) hands on only what is left, as for a push (row 289).
    deadline = asyncio.get_running_loop().time() + timeout_ms / 1000
    for candidate in planes_for(link):
        read = candidate.reader(rt, link, plan)
        if read is not None and await read(time_left(deadline, what), what):
            if _trace.ON:
                _trace.mark("returned")
            return candidate.transport_on(link)
    if not plan.local._owned and not plan.local.alive:  # released while a reader tried: that, not the clock
        raise LLMException(f"{what}: the cache was unregistered during the transfer",
                           status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    return await _run(rt, link, plan, time_left(deadline, what), what, pull=True)


async def _push(rt: Runtime, link: Link, plan: Plan, timeout_ms: int, what: str, queue_ms: int | None) -> str:
    # One time-out for the whole push: a plane that moves it alone (a device-IPC push first waits for its
    # stream, then for the owner's copy) and the planes it falls back to share it (row 289).
    # A plane that moved nothing may have waited, within ``queue_ms``, behind the link's other pushes (a same-host
    # push waits for one of its slots): that wait is the queue's, not the time-out's of the plane that takes over
    # (it counted against the time-out, and a layer that waited for a slot and was then told to stream timed out
    # at once; found by review).
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + timeout_ms / 1000
    queue_s = (queue_ms or 0) / 1000
    for candidate in planes_for(link):
        left = time_left(deadline + min(loop.time() - started, queue_s), what)
        if await candidate.move_alone(rt, link, plan, left, what, queue_ms=queue_ms):
            return candidate.transport_on(link)
    queued = min(loop.time() - started, queue_s)
    rest = None if queue_ms is None else max(0, queue_ms - int(queued * 1000))
    return await _run(rt, link, plan, time_left(deadline + queued, what), what, pull=False, queue_ms=rest)


async def _counted(link: Link, kind: str, nbytes: int, moving: Coroutine[Any, Any, str],
                   cut: Callable[[], LLMStatusCode | None] | None = None) -> None:
    """Run ``moving`` (a transfer that returns the transport it took) and count how it ended on the link; a
    cancellation is the caller's unless ``cut`` names the failure the library cut it for."""
    counters = link.counters
    started = counters.begin(kind)
    try:
        transport = await moving
    except asyncio.CancelledError:
        status = None if cut is None else cut()
        if status is None:
            counters.end(kind, link.transport, nbytes, started, Outcome.CANCELLED, LLMStatusCode.LLM_FAILED)
        else:
            counters.end(kind, link.transport, nbytes, started,
                         Outcome.TIMEOUT if status == LLMStatusCode.LLM_TIMEOUT else Outcome.FAILED, status)
        raise
    except LLMException as exc:
        timed_out = exc.status_code == LLMStatusCode.LLM_TIMEOUT
        counters.end(kind, link.transport, nbytes, started, Outcome.TIMEOUT if timed_out else Outcome.FAILED,
                     exc.status_code)
        raise
    except BaseException:
        counters.end(kind, link.transport, nbytes, started, Outcome.FAILED, LLMStatusCode.LLM_FAILED)
        raise
    counters.end(kind, transport, nbytes, started, Outcome.OK)


def _required_plane(rt: Runtime, link: Link, offered: Plane | None, what: str) -> None:
    """Refuse, before anything is sent, a transfer that would take a slower transport than
    ``aio.RequireTransport`` names."""
    required = rt.settings.require_transport
    taken = link.data_transport if offered is None else offered.transport_on(link)
    if meets(taken, required):
        return
    raise LLMException(f"{what}: aio.RequireTransport={required}, but on the link to cluster "
                       f"{link.remote_cluster_id} (transport {link.transport}) this transfer would take {taken} "
                       "(raw addresses, a cache the peer has not shared over it, a device row pulled into several "
                       f"blocks, a same-host push of more than {MAX_LOCAL_SRC_ROWS} rows, a "
                       "device cache pushed into a host cache, or a link that negotiated less)",
                       status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)


async def _ask(link: Link, req: Request, plan: Plan, offered: Plane | None, timeout_ms: int, *, pull: bool) -> Resp:
    """Send the request, offering ``offered`` besides the stream plane; the owner's acceptance (and, in
    ``req.then``, the waiter for its next reply)."""
    req.then = asyncio.get_running_loop().create_future()
    # A push's next reply is its DONE (a second accepting RESP would read as its confirmation); a pull's may be a
    # RESP saying why the owner stopped, or the DONE an owner that already forgot the request answers our ABORT with.
    answered = link.expect(req.req_id, then=req.then, then_answer=None if pull else Msg.DONE)
    link.send_record(Msg.PULL_REQ if pull else Msg.PUSH_REQ, req.req_id, plan.remote, channel=req.channel,
                     timeout_ms=timeout_ms, flags=plan.remote.flags | (offered.flag if offered is not None else 0))
    req.state = RequestState.ASKED
    if _trace.ON:
        _trace.mark("request sent")
    answer = await answered
    if _trace.ON:
        _trace.mark("answer read")
    if answer.status != LLMStatusCode.LLM_SUCCESS:
        raise Refused(f"cluster {link.remote_cluster_id}: {answer.text}", status_code=code_to_status(answer.status))
    if not isinstance(answer, Resp):  # a DONE that says it went well before the request was even accepted
        raise LLMException(f"cluster {link.remote_cluster_id} confirmed request {req.req_id} before it accepted it",
                           status_code=LLMStatusCode.LLM_LINK_FAILED)
    if answer.total != plan.total:
        raise LLMException(f"cluster {link.remote_cluster_id} offers {answer.total} bytes, "
                           f"{plan.total} expected", status_code=LLMStatusCode.LLM_PARAM_INVALID)
    return answer


async def _ask_and_carry(rt: Runtime, link: Link, plan: Plan, req: Request, offered: Plane | None, timeout_ms: int,
                         what: str, *, pull: bool) -> Plane:
    """Ask with ``RESP`` as the answer, then let the plane the owner chose move the bytes; that plane."""
    answer = await _ask(link, req, plan, offered, timeout_ms, pull=pull)
    chosen = plane("staging" if plan.local.on_device else "stream")  # device memory goes through staging
    if answer.cache_id >= 0:  # the owner chose the in-place plane we offered
        if offered is None:
            raise LLMException(f"cluster {link.remote_cluster_id} answered for a plane we did not offer",
                               status_code=LLMStatusCode.LLM_LINK_FAILED)
        chosen = offered
        req.in_place = True
        req.release_channel()
    elif offered is not None:
        _required_plane(rt, link, None, what)  # the owner chose the stream plane after all
    req.state = RequestState.MOVING
    req.check_owner()  # the owner stopped the request right after its answer: no plane starts a job for it
    await chosen.carry(rt, link, plan, answer, req, pull=pull)
    return chosen


async def _run(rt: Runtime, link: Link, plan: Plan, timeout_ms: int, what: str, *, pull: bool,
               queue_ms: int | None = None) -> str:
    """One transfer through the planes; the transport that carried it."""
    if _trace.ON:
        _trace.mark("planned")
    req = Request(link, what, consumes=pull and _may_consume(plan))
    if plan.local._owned:
        return await _run_request(rt, link, plan, req, timeout_ms, what, pull, queue_ms)
    # A cache the caller registered is its memory again once unregistering it returned: that call cuts us.
    task = asyncio.current_task()
    assert task is not None, "transfers run in a task"
    cancelling = task.cancelling()
    cut = _Cut(rt, plan, req, task)
    unwatch = rt.registry.serving([plan.local], cut)
    try:
        if not plan.local.alive:
            # Unregistered before this watch began (while a plane's reader or lone move awaited, then gave the
            # transfer back): nothing would cut it now, and its memory is the caller's again.
            raise LLMException(f"{what}: the cache was unregistered during the transfer",
                               status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
        carried = await _run_request(rt, link, plan, req, timeout_ms, what, pull, queue_ms)
    except asyncio.CancelledError:
        if cut.cancelled:
            cut.cancelled = False  # taken back here, once
            if task.uncancel() <= cancelling:
                raise LLMException(f"{what}: the cache was unregistered during the transfer",
                                   status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST) from None
        raise  # (also) our caller's cancel
    except LLMException as exc:
        if req.cut:
            raise LLMException(f"{what}: the cache was unregistered during the transfer",
                               status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST) from exc
        raise
    finally:
        if unwatch is not None:
            unwatch()
        if cut.cancelled:  # our cancel was taken by a plane that raised something else: take it back
            task.uncancel()
    if req.cut:  # it ended before the cut could stop it, but after the caller took its memory back
        raise LLMException(f"{what}: the cache was unregistered during the transfer",
                           status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    return carried


def _channel_failed(link: Link, req: Request, exc: LLMException) -> bool:
    """Whether ``exc`` is the data channel of ``req`` failing under a link that is up (reset or closed by the
    peer, or by the network), with no word of the owner's about it yet."""
    return (exc.status_code == LLMStatusCode.LLM_LINK_FAILED and not link.down and not req.in_place
            and req.channel >= 0 and req.then is not None)


async def _owners_word(link: Link, req: Request, deadline: float | None,
                       cancelled: list[asyncio.CancelledError]) -> None:
    """Wait until the owner's word on ``req`` came, or its ``ABORT`` of the request's channel (which it sends
    right after any word, on the same connection), or the link went down: ``ABORT_ACK_S`` at most, and not past
    the request's ``deadline`` (loop time; None: no time left). An owner that stops a request it accepted for a
    reason of its own says why before it resets the channel, but that word and the reset travel on different
    connections: the reset may be read first. A cancellation goes to ``cancelled``."""
    assert req.then is not None, "_channel_failed checked it"
    channel, generation = req.channel, req.generation  # a cut meanwhile gives the channel up (channel -1)
    reset = link.peer_reset(channel, generation)
    left = 0.0 if deadline is None else max(deadline - asyncio.get_running_loop().time(), 0.0)
    bound = min(ABORT_ACK_S, left)
    try:
        await asyncio.wait([reset, req.then], timeout=bound, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError as exc:
        cancelled.append(exc)
    finally:
        link.drop_peer_reset(channel, generation, reset)


def _may_consume(plan: Plan) -> bool:
    """Whether a pull of ``plan`` may consume a key at the owner: one by ``CacheKey`` without a prefix, or by id
    and index (a key of a registered cache is never consumed, but the requester cannot tell)."""
    remote = plan.remote
    return remote.target_kind == Target.ID_INDEX or (
        remote.target_kind == Target.CACHE_KEY and remote.prefix_id == UINT64_MAX)


class _Cut:
    """The caller unregistered the registered cache our transfer moves from or into (``CacheRegistry.serving``):
    stop touching it before that call returns. The channel's reset (told to the owner) ends our job on it at
    once, and the device copies of a device cache's transfer are waited for (``wait_cut_copies``); then the
    transfer's task is cancelled, so that it queues nothing more when it wakes (a staged pull's next scatter,
    a device-IPC pull's copy: its answer or chunk may be in already, its task about to run), and fails with
    ``LLM_KV_CACHE_NOT_EXIST``, as does a transfer that ended before its task woke. A NIXL READ or WRITE the
    owner answered is stopped first: it posts no further piece, and the piece our NIXL worker moves is waited
    for (``nixl.Halting.halt``). A same-host pull's copy by our copy threads is stopped by its own watch
    (``same_host.run_copy_job``): its task is left to wait for it."""

    __slots__ = ("rt", "plan", "req", "task", "cancelled")

    def __init__(self, rt: Runtime, plan: Plan, req: Request, task: asyncio.Task) -> None:
        self.rt, self.plan, self.req, self.task = rt, plan, req, task
        self.cancelled = False

    def __call__(self) -> None:
        req = self.req
        if req.state is RequestState.DONE or req.cut:
            return
        req.cut = True
        if not req.in_place:
            req.abandon_channel()
        on_device = self.plan.local.on_device
        if on_device:
            wait_cut_copies(self.rt, req.what)
        halt = getattr(req.settled, "halt", None) if req.in_place else None  # NIXL's (``nixl.Halting``)
        if halt is not None:
            halt()
        if (on_device or not req.in_place or halt is not None) and not self.task.done():
            self.cancelled = True
            self.task.cancel()


async def _run_request(rt: Runtime, link: Link, plan: Plan, req: Request, timeout_ms: int, what: str, pull: bool,
                       queue_ms: int | None) -> str:
    limit: asyncio.Timeout | None = None
    try:
        async with asyncio.timeout((timeout_ms + (queue_ms or 0)) / 1000) as limit:
            planes = planes_for(link)
            for candidate in planes:
                await candidate.prepare(rt, link, plan, pull=pull, deadline=limit.when() or 0.0)
            offered = next((p for p in planes if p.in_place and p.can_carry(link, plan, pull=pull)), None)
            _required_plane(rt, link, offered, what)
            req.channel = await link.acquire()
            req.generation = link.channels[req.channel].generation  # what release gives back
            if req.cut:  # unregistered while we waited: take nothing from it (the channel goes back)
                raise LLMException(f"{what}: the cache was unregistered", status_code=LLMStatusCode.LLM_FAILED)
            if queue_ms:
                limit.reschedule(asyncio.get_running_loop().time() + timeout_ms / 1000)
            req.req_id = link.new_req_id()
            if pull and offered is None and not plan.local.on_device and link.posts(req.channel):
                chosen: Plane = STREAM_PLANE
                await STREAM_PLANE.pull_posted(link, plan, req, timeout_ms)
            else:
                chosen = await _ask_and_carry(rt, link, plan, req, offered, timeout_ms, what, pull=pull)
        req.state = RequestState.DONE
        req.release_channel()
        if req.then is not None:
            link.unexpect(req.req_id)  # a plane that moved the bytes in place waited for no reply after the answer
        if _trace.ON:
            _trace.mark("returned")
        return chosen.transport_on(link)
    except Refused:
        link.unexpect(req.req_id)
        req.release_channel()
        raise
    except TimeoutError:
        await req.give_up()
        raise LLMException(f"{what} timed out after {timeout_ms} ms",
                           status_code=LLMStatusCode.LLM_TIMEOUT) from None
    except LLMException as exc:
        said = req.owner_failure()  # the owner stopped serving us part-way and said why
        cancelled: list[asyncio.CancelledError] = []
        if said is None and _channel_failed(link, req, exc):
            await _owners_word(link, req, None if limit is None else limit.when(), cancelled)
            said = req.owner_failure()
        own = said is not None  # said before our abort: the owner's own reason
        await req.give_up()
        if cancelled:
            raise cancelled[0] from None
        if said is None:  # or says it now: a reason of its own, not its answer to our abort (LLM_FAILED)
            said = req.owner_failure()
            if said is not None and said.status_code == LLMStatusCode.LLM_FAILED:
                said = None
        if said is not None and (own or said.status_code != exc.status_code):
            raise said from exc
        if exc.status_code == LLMStatusCode.LLM_FAILED and link.down:
            try:
                link.check()  # the engine stopped the job because the link went: say so
            except LLMException as state:
                raise state from exc
        if exc.status_code == LLMStatusCode.LLM_LINK_FAILED and link.unlinking:
            # our own unlink cut it (the peer closed its channels as it answered): an unlink, not a failure
            raise LLMException(f"{what}: link to cluster {link.remote_cluster_id} was unlinked ({exc})",
                               status_code=LLMStatusCode.LLM_NOT_YET_LINK) from exc
        raise
    except BaseException:
        await req.give_up()
        raise
