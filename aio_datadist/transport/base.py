"""The transport interface: planes that move a planned transfer, and what they need of a link.

A *plane* is one way of moving a transfer's bytes once both ends agreed on
them: the stream plane (the request's data channel: a socket the native
engine drives, or a TLS channel), the same-host plane (copies against a
peer's sealed, read-only shared memory) and the NIXL plane (READ/WRITE by
the NIXL agent). The requester (``transfers.py``) offers the planes that can
carry a plan in one request; the owner (``owner.py``) checks the request and
lets the first plane that serves it do so; the requester then lets the plane
the owner chose carry the plan. A plane that negotiates its own request
(the same-host push, which the owner performs by reading the pusher's region)
does so in :meth:`Plane.move_alone`; one that can carry a pull without asking
(the same-host plane, where the owner's read ledger lists the cache) says so
in :meth:`Plane.reader`.

Planes sit below links and never import them: what they use of a link is
:class:`LinkPort`, and the request of ours they carry is a
:class:`Request`, which knows what giving it up must wait for.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import enum
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from aio_datadist._settle import Settling, settle
from aio_datadist.cache import KeyBinding, KvCache
from aio_datadist.stats import LinkCounters
from aio_datadist.status import LLMException, LLMStatusCode, code_to_status
from aio_datadist.transport.fit import Refusal
from aio_datadist.wire import NO_GENERATION, Msg, Resp, TransferReq

if TYPE_CHECKING:
    from aio_datadist.plans import Plan
    from aio_datadist.runtime import Runtime
    from aio_datadist.transport.local import LocalShare
    from aio_datadist.transport.nixl import NixlPeer

__all__ = ["UNLINKING", "InPlacePlane", "LinkPort", "Plane", "Refusal", "Refused", "Request", "RequestState", "Served",
           "abort_acknowledged", "await_done", "meets", "nixl_settle", "push_torn", "time_left", "wait_out"]

#: How long a given-up NIXL transfer may take to settle before the owner hears of it ...
NIXL_SETTLE_S = 1.0
#: ... and how long at most while our NIXL worker is still copying a piece of it inside NIXL's posting call (UCX
#: shared memory), which ends with the piece (``nixl_engine.CHUNK_BYTES``): bytes would land after the return.
NIXL_SETTLE_LIMIT_S = 10.0
#: How long a given-up NIXL transfer still in NIXL's hands past those bounds (the owner makes no progress on it: a
#: READ or WRITE over UCX's TCP transport needs the owner's for every byte) may take to settle once its peer's
#: agent was let go (``Settling.force``: NIXL disconnects from it, which ends what is in flight with it).
NIXL_FORCE_S = 2.0
#: A force our NIXL worker has not applied yet (it is inside a NIXL call that takes long: a registration, a
#: metadata load) is looked at again this often, for ``NIXL_SETTLE_LIMIT_S`` at most: the transfer may move until
#: it is applied, so the call waits (``NIXL_FORCE_S`` counts from then).
FORCE_LOOK_S = 0.05
#: How long a given-up data-channel job may take to report itself over (the channel reset stops it at once).
JOB_SETTLE_S = 1.0
#: How long a pusher waits for the owner to confirm that an aborted push stopped.
ABORT_ACK_S = 1.0
#: What a peer hears of a request of its that we refused or stopped because the link is being unlinked
#: (``LLM_NOT_YET_LINK``: its transfer fails as one made after the unlink would).
UNLINKING = "the link is being unlinked"
#: The longest a served request may run, whatever the requester asked for.
MAX_SERVE_TIMEOUT_MS = 600_000
#: How long past a request's own timeout (counted from our answer) the owner waits for the requester's word that
#: it is over (``DONE``, or a NIXL push's notification) before it gives the request up as failed. The requester
#: sends it before its timeout, or gave up by then and says so within ``NIXL_SETTLE_S``: a peer silent past
#: this is buggy or hostile, and what it held (a key's claim, a NIXL registration) is released.
DONE_GRACE_S = 2.0


def time_left(deadline: float, what: str) -> int:
    """Milliseconds left before ``deadline`` (loop time), rounded up (asyncio's clock moves within a loop step: a
    1 ms time-out asked for at once has 0.99 ms left), at least 1; ``LLM_TIMEOUT`` once it passed. A deadline the
    clock has just reached has not passed: uvloop's clock moves in whole milliseconds, so a 1 ms time-out asked for
    at once reads 0 ms left whenever the clock ticks in between (its next step's timer fires it, as asyncio's
    timers do)."""
    left = deadline - asyncio.get_running_loop().time()
    if left < -1e-6:  # (float noise: a deadline reached exactly may read a few picoseconds past)
        raise LLMException(f"{what} timed out", status_code=LLMStatusCode.LLM_TIMEOUT)
    return max(1, math.ceil(left * 1000 - 1e-6))  # (less float noise: a 1 ms deadline read as 1.0000000002 ms)


def meets(transport: str, required: str) -> bool:
    """Whether ``transport`` (``tcp``, ``tls``, ``local``, ``nixl``) is what ``aio.RequireTransport=required``
    asks for: any transport meets ``tcp`` (or nothing required); ``local`` and ``nixl`` are met by themselves."""
    return required in ("", "tcp") or transport == required


class LinkPort(Protocol):
    """What planes and requests use of a link (``links.Link`` is one)."""

    remote_cluster_id: int
    runtime: Runtime
    counters: LinkCounters
    local: LocalShare | None
    nixl: NixlPeer | None
    pending: dict[int, asyncio.Future]
    serving: dict[int, Callable[[], Any]]
    local_pushes: dict[int, asyncio.Future]
    served_pushes: dict[int, asyncio.Future]
    pull_acks: dict[int, tuple[Callable[[], None], Callable[[], None]]]
    channels: list[Any]
    broken: LLMException | None
    closed: bool
    ending: bool

    @property
    def down(self) -> bool: ...

    @property
    def data_transport(self) -> str: ...
    def send(self, msg: Msg, req_id: int, **fields: Any) -> None: ...
    def send_soon(self, msg: Msg, req_id: int, **fields: Any) -> None: ...
    def done_overdue(self, req_id: int, timeout_ms: int) -> None: ...
    def send_record(self, msg: Msg, req_id: int, record: Any, **changes: Any) -> None: ...
    def expect(self, req_id: int, answer: Any = None, *, then: asyncio.Future | None = None,
               then_answer: Any = None) -> asyncio.Future: ...
    def unexpect(self, req_id: int) -> None: ...
    def new_req_id(self) -> int: ...
    def check(self) -> None: ...
    def check_heard(self) -> None: ...
    def fail(self, exc: LLMException) -> None: ...
    async def acquire(self) -> int: ...
    def release(self, index: int, generation: int) -> None: ...
    def reset_channel(self, index: int, tell_peer: bool, req_id: int = 0) -> None: ...
    def posts(self, index: int) -> bool: ...
    def peer_channel_ok(self, index: int) -> bool: ...
    def answering(self, index: int, job: asyncio.Future) -> None: ...
    def move(self, index: int, pairs: Any, *, send: bool, timeout_ms: int | None, what: str, keepalive: Any,
             settled: asyncio.Future | None = None, gated: int = 0) -> asyncio.Future: ...


class Refused(LLMException):
    """The owner refused our request before any byte moved."""


@dataclasses.dataclass
class Served:
    """A peer's request as the owner validated it: what it moves and what it must settle afterwards."""

    keepalive: Any  # the cache (or caches) the bytes live in
    pairs: Any  # our side's copy pairs, in wire byte order
    total: int
    key: KeyBinding | None  # the key binding the request names (a pull claims and consumes it)
    tensors: range
    # ``(cache, tensors, rows)`` a push writes from each row's first byte, stamped as accepted
    # (``Arrivals.accepted``), recorded as arrived once it is over
    landed: list
    row: int | None = None  # the row the target names (a key's or an id-and-index's), if any
    #: Told once how serving ended (True: every byte moved; else the failure's status); set by the owner to
    #: count it (``stats``).
    report: Callable[[bool, LLMStatusCode], None] | None = None
    #: The transport it is counted under (set by the owner; a plane that hands the request on changes it).
    transport: str = ""

    def ended(self, ok: bool, status: LLMStatusCode = LLMStatusCode.LLM_FAILED) -> None:
        """The plane serving the request is done with it (``ok``: every byte moved; else ``status`` says how it
        failed, ``LLM_TIMEOUT`` for one given up at its deadline); tells ``report`` once."""
        report, self.report = self.report, None
        if report is not None:
            report(ok, status)

    @property
    def cache(self) -> KvCache | None:
        """The one registered cache the request names, or None for raw addresses."""
        return self.keepalive if isinstance(self.keepalive, KvCache) else None


class RequestState(enum.Enum):
    """Where one request of ours stands."""

    NEW = "new"  # nothing sent
    ASKED = "asked"  # the request is out, no answer yet
    MOVING = "moving"  # the owner accepted; a plane is moving the bytes
    DONE = "done"
    GIVEN_UP = "given up"  # timed out, failed or cancelled: nothing of it can land any more


class Request:
    """One request of ours while it runs, and what giving it up must wait for.

    The requester moves it through its states; a plane that carries it sets
    ``settled`` (done once our own job can touch no byte any more) and, for
    a push whose bytes may be on their way, ``ack`` (the owner's ``DONE``).
    A request that is given up (timeout, error, cancellation) returns only
    once no byte of it can change its destination any more (see
    :meth:`give_up`).
    """

    __slots__ = ("link", "what", "consumes", "state", "channel", "generation", "req_id", "in_place", "settled",
                 "ack", "then", "cut")

    def __init__(self, link: LinkPort, what: str, *, consumes: bool = False) -> None:
        self.link = link
        self.what = what
        #: A pull by key (``CacheKey``, ``CacheKeyByIdAndIndex``), whose ``DONE`` consumes the key at the owner.
        self.consumes = consumes
        self.state = RequestState.NEW
        self.channel = -1  # the data channel the request names, while we hold it
        self.generation = -1
        self.req_id = 0
        self.in_place = False  # the owner chose a plane that needs no data channel (NIXL, same-host)
        self.settled: asyncio.Future | None = None
        self.ack: asyncio.Future | None = None
        # The peer's reply after the owner's answer (``Link.expect``'s ``then``): a push's ``DONE``, a stream
        # pull's ``RESP`` should the owner stop part-way (it unregistered the cache the pull reads: why the bytes
        # stopped coming). Waited for from the moment the answer is read, so a reply sent right after the answer
        # is not dropped before the plane that moves the bytes runs. A posted pull's only waiter, its answer
        # (a refusal), is kept here too.
        self.then: asyncio.Future | None = None
        self.cut = False  # the caller unregistered the registered cache we move (see transfers._Cut)

    def owner_failure(self) -> LLMException | None:
        """What the owner said when it stopped the request part-way (a failed ``DONE`` of a push, a failed
        ``RESP`` after a pull was answered), if it said so already (also before a plane took the request up)."""
        word = self.then  # a push's ``ack`` is this future too
        if word is not None and word.done() and not word.cancelled() and word.exception() is None:
            record = word.result()
            if record.status != LLMStatusCode.LLM_SUCCESS:
                return LLMException(f"cluster {self.link.remote_cluster_id}: {record.text}",
                                    status_code=code_to_status(record.status))
        return None

    def check_owner(self) -> None:
        """Raise what the owner said if it stopped the request already (its reply right after its answer): a
        plane then starts no job for it."""
        failure = self.owner_failure()
        if failure is not None:
            raise failure

    async def finish(self) -> None:
        """Once the bytes moved: a pull tells the owner with ``DONE``; a push (``ack`` set) waits for the
        owner's ``DONE`` and raises its refusal.

        A pull whose ``DONE`` the owner might no longer act on (the link went, is going, or we sent ``UNLINK``)
        fails with the link's code: the owner gave back what it held for the pull, the key the pull read
        unconsumed and the memory an in-place copy read (``docs/reliability.md`` row 177).

        A pull that consumes a key writes its ``DONE`` before it returns: left to the end of the loop pass, it
        waited behind whatever the caller ran on the loop after the pull returned, and a caller that held the
        loop past the owner's wait (its timeout and ``DONE_GRACE_S``) had a success whose key the owner never
        consumed (row 272). Other pulls consume nothing; their ``DONE`` only frees the owner's hold sooner."""
        if self.ack is None:
            self.link.check_heard()
            if self.consumes:
                self.link.send(Msg.DONE, self.req_id, status=0, text="")
            else:
                self.link.send_soon(Msg.DONE, self.req_id, status=0, text="")
            return
        confirmed = await asyncio.shield(self.ack)  # a cut must not cancel it: give_up waits for it
        if confirmed.status != LLMStatusCode.LLM_SUCCESS:
            raise LLMException(f"cluster {self.link.remote_cluster_id}: {confirmed.text}",
                               status_code=code_to_status(confirmed.status))

    def release_channel(self) -> None:
        """Hand the data channel back for the next request."""
        if self.channel >= 0:
            self.link.release(self.channel, self.generation)
            self.channel = -1

    async def give_up(self) -> None:
        """Abandon the request and wait, bounded and through cancellations (re-raised afterwards),
        until nothing of it can land: our job settled, then the owner's answer to the abort of a push
        (``ABORT_ACK_S``). An owner silent past that bound loses the link, and with it every data
        channel, so nothing more of ours reaches it."""
        link = self.link
        cancelled: list[asyncio.CancelledError] = []
        if self.in_place:
            if self.settled is not None:  # NIXL: let the cancelled transfer settle before the owner hears
                await nixl_settle(self.settled, cancelled)
            if self.req_id:
                link.send(Msg.DONE, self.req_id, status=LLMStatusCode.LLM_FAILED, text="abandoned")
        else:
            self.abandon_channel()
            if self.settled is not None:
                await wait_out(self.settled, JOB_SETTLE_S, cancelled)
        if self.ack is not None:
            await abort_acknowledged(link, self.ack, self.what, cancelled)
        if self.req_id:
            link.unexpect(self.req_id)
        self.state = RequestState.GIVEN_UP
        if cancelled:
            raise cancelled[0]

    def abandon_channel(self) -> None:
        """A channel that may carry the request's bytes is reset on both ends (our job on it is over
        once this returns, see ``Link.reset_channel``)."""
        link, channel, req_id = self.link, self.channel, self.req_id
        self.channel = -1
        if channel < 0:
            return
        if link.channels[channel].generation != self.generation:
            if req_id:
                link.send(Msg.ABORT, req_id, channel=channel, generation=NO_GENERATION)  # the request only
            return  # the channel was already replaced under us
        if req_id:
            link.reset_channel(channel, tell_peer=True, req_id=req_id)
        else:
            link.release(channel, self.generation)


async def abort_acknowledged(link: LinkPort, ack: asyncio.Future, what: str,
                             cancelled: list[asyncio.CancelledError]) -> None:
    """Wait (``ABORT_ACK_S`` at most) for the owner's answer to an aborted push, which it sends once
    nothing more of the push can land; an owner silent past that loses the link."""
    if not ack.done() and not await wait_out(ack, ABORT_ACK_S, cancelled):
        link.fail(LLMException(f"{what}: cluster {link.remote_cluster_id} did not confirm an aborted "
                               f"push within {ABORT_ACK_S} s", status_code=LLMStatusCode.LLM_LINK_FAILED))


async def nixl_settle(settled: asyncio.Future, cancelled: list[asyncio.CancelledError], *,
                      tick: Callable[[], None] | None = None, every_s: float = NIXL_SETTLE_S) -> bool:
    """Wait for a given-up NIXL transfer to settle: ``NIXL_SETTLE_S``, and past it, up to ``NIXL_SETTLE_LIMIT_S``,
    if our worker is then still copying a piece of it or has not got to it yet (``Settling.busy``: NIXL's
    posting call copies the piece in progress over UCX shared memory, and ends with it; a command still queued
    is skipped once cancelled); ``tick()`` every ``every_s``
    meanwhile (a read waiting for the owner's progress nudges it). A transfer still in NIXL's hands then is forced
    off (``Settling.force``: its peer's agent is let go, and the link) and waited for ``NIXL_FORCE_S`` more from
    when the worker applied the force (``Settling.forcing``; up to ``NIXL_SETTLE_LIMIT_S`` for that): none may
    write our memory, or read it, after the call returned. Cancellations go to ``cancelled``; whether it
    settled."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    bound = NIXL_SETTLE_S
    forced_at = applied_at = None
    while not settled.done():
        now = loop.time()
        left = start + bound - now
        if left <= 0:
            if not isinstance(settled, Settling):
                break
            if forced_at is None:
                if bound < NIXL_SETTLE_LIMIT_S and settled.busy():
                    bound = NIXL_SETTLE_LIMIT_S
                    continue
                if settled.force is None:
                    break
                forced_at = now
                settled.force()
            elif applied_at is not None or now >= forced_at + NIXL_SETTLE_LIMIT_S:
                break
            if settled.forcing is not None and settled.forcing() and now < forced_at + NIXL_SETTLE_LIMIT_S:
                # Not applied yet: the worker is inside a NIXL call that takes long, and the transfer may move
                # until it is out. Look again shortly, NIXL_SETTLE_LIMIT_S at most.
                bound = now - start + FORCE_LOOK_S
                continue
            applied_at = now
            bound = now - start + NIXL_FORCE_S
            continue
        if not await wait_out(settled, left if tick is None else min(left, every_s), cancelled) and tick is not None:
            tick()
    return settled.done()


async def wait_out(future: asyncio.Future, bound_s: float, cancelled: list[asyncio.CancelledError]) -> bool:
    """``settle`` that keeps a cancellation in ``cancelled`` instead of raising it; whether ``future`` is done."""
    try:
        return await settle(future, bound_s)
    except asyncio.CancelledError as exc:
        cancelled.append(exc)
        return future.done()


def await_done(link: LinkPort, req_id: int, req: TransferReq, ok: Callable[[], None],
               failed: Callable[[], None], *, expired: Callable[[], None] | None = None) -> None:
    """Keep ``(ok, failed)`` in ``link.pull_acks`` until the requester's word that ``req_id`` is over (or the
    link's end) runs one of them, for the request's own timeout plus :data:`DONE_GRACE_S` at most: past that,
    the request is given up as a failed ``DONE`` would (``expired`` first, then ``failed``; serving stopped),
    and a ``DONE`` that comes later is one of a request we do not know. One timer per request, cancelled by
    whichever ends it."""
    loop = asyncio.get_running_loop()

    def expire() -> None:
        if link.pull_acks.get(req_id) is not entry:
            return
        if expired is not None:
            expired()
        # One request, one outcome: a request whose bytes all moved was counted as served then (a stream pull
        # of a key, which waits for DONE only to consume it) and stays so; the others are counted as failed
        # by ``failed`` below. The warning says the request was given up.
        stop = link.serving.pop(req_id, None)
        if stop is not None:
            stop()
        ack = link.pull_acks.pop(req_id, None)
        if ack is not None:
            ack[1]()
        link.done_overdue(req_id, req.timeout_ms)

    timer = loop.call_at(loop.time() + min(max(req.timeout_ms, 1), MAX_SERVE_TIMEOUT_MS) / 1000 + DONE_GRACE_S,
                         expire)

    def done_ok() -> None:
        timer.cancel()
        ok()

    def done_failed() -> None:
        timer.cancel()
        failed()

    entry = (done_ok, done_failed)
    link.pull_acks[req_id] = entry


def stop_status(link: LinkPort) -> LLMStatusCode:
    """How a request served to the peer counts when it is stopped now, taken where it is stopped (a cause read at
    the count may be a later one): ``LLM_LINK_FAILED`` by the teardown of a link that failed (its heartbeat, its
    control connection: the peer's failure), else ``LLM_FAILED`` (the requester gave it up) (row 265)."""
    return LLMStatusCode.LLM_LINK_FAILED if link.broken is not None else LLMStatusCode.LLM_FAILED


def push_torn(rt: Runtime, link: LinkPort, served: Served, why: BaseException | str | None) -> None:
    """A push we accepted (so some of its bytes may have landed) ended in failure: the open push watches of the
    rows it was filling fail the layers it touched (``Arrivals.torn``), ``LLM_LINK_FAILED`` when the link went,
    else ``why``'s code (an :class:`LLMException`) or ``LLM_FAILED``. Called from the failure branches only: the
    success path records arrivals as before."""
    arrivals = rt.arrivals
    landed = [entry for entry in served.landed if arrivals.watched(entry[0])]
    if not landed:
        return
    if link.closed or link.broken is not None:
        code = LLMStatusCode.LLM_LINK_FAILED
        text = "the link failed" if link.broken is None else f"the link failed: {link.broken}"
    elif isinstance(why, LLMException):
        code, text = why.status_code, str(why.args[0] if why.args else why)
    else:
        code, text = LLMStatusCode.LLM_FAILED, str(why or "the push was aborted")
    exc = LLMException(f"a push from cluster {link.remote_cluster_id} failed: {text}", status_code=code)
    for target, tensors, rows in landed:
        arrivals.torn(target, tensors, rows, exc)


def serve_timeout_ms(req: TransferReq) -> int:
    """How long the owner lets a request's native job run: what the requester asked plus a second."""
    return min(max(req.timeout_ms, 1), MAX_SERVE_TIMEOUT_MS) + 1000


class Plane(abc.ABC):
    """One way of moving a transfer's bytes, with a requester's and an owner's half."""

    #: The plane's name, as logs and docs say it.
    name: ClassVar[str]
    #: The transport the plane is, as ``LLMDataDist.stats()`` and ``aio.RequireTransport`` name it.
    transport: ClassVar[str] = ""
    #: The request flag that offers this plane to the owner (none for the stream plane, always offered).
    flag: ClassVar[int] = 0
    #: Whether the requester moves the bytes itself against the owner's memory (no data channel).
    in_place: ClassVar[bool] = False

    def transport_on(self, link: LinkPort) -> str:
        """The transport this plane is on ``link`` (the stream plane's depends on the link: TCP or TLS)."""
        return self.transport

    # -- the requester's half --

    async def prepare(self, rt: Runtime, link: LinkPort, plan: Plan, *, pull: bool,  # noqa: B027 - most need nothing
                      deadline: float) -> None:
        """Get ready to offer ``plan`` (a cache allocated a moment ago may still be registering); the transfer
        must be over by ``deadline`` (the loop's clock)."""

    def can_carry(self, link: LinkPort, plan: Plan, *, pull: bool) -> bool:
        """Whether this plane may be offered for ``plan`` on ``link``."""
        return False

    async def move_alone(self, rt: Runtime, link: LinkPort, plan: Plan, timeout_ms: int, what: str, *,
                         queue_ms: int | None = None) -> bool:
        """Carry a push by a request of this plane's own; False when the owner wants it offered the usual way.
        ``queue_ms``: as ``run_push``'s (the push may wait that much more behind the owner's earlier work)."""
        return False

    def reader(self, rt: Runtime, link: LinkPort, plan: Plan) -> Callable[[int, str], Awaitable[bool]] | None:
        """A pull this plane can carry without asking the owner (what it read tells the owner so), as
        ``read(timeout_ms, what)``, which returns False when the owner must be asked after all; None when
        the owner must be asked."""
        return None

    @abc.abstractmethod
    async def carry(self, rt: Runtime, link: LinkPort, plan: Plan, answer: Resp, req: Request, *,
                    pull: bool) -> None:
        """Move ``plan`` once the owner chose this plane (``answer``); confirm as the plane requires."""

    # -- the owner's half --

    def serves(self, link: LinkPort, msg: Msg, req: TransferReq, served: Served) -> bool:
        """Whether this plane serves ``req`` (which offered it)."""
        return False

    @abc.abstractmethod
    def serve(self, rt: Runtime, link: LinkPort, msg: Msg, req_id: int, req: TransferReq, served: Served) -> None:
        """Answer ``RESP`` and serve the validated request ``served``; report its end as the plane requires."""

    def serve_alone(self, rt: Runtime, link: LinkPort, req_id: int, req: Any, served: Served) -> None:
        """The owner's half of :meth:`move_alone`: serve this plane's own request ``req``."""
        raise NotImplementedError(f"the {self.name} plane has no request of its own")


class InPlacePlane(Plane):
    """A plane whose requester moves the bytes itself against the owner's memory (same-host, NIXL).

    The owner answers ``RESP`` naming the cache; a pull ends with the
    requester's ``DONE``, a push with the plane's own arrival signal (or a
    failed ``DONE``). Subclasses add what their memory needs while a request
    is served (:meth:`_begin`, :meth:`_arrival`).
    """

    in_place = True

    def _begin(self, link: LinkPort, cache: KvCache) -> Callable[[], None] | None:
        """A request against ``cache`` is being served; what to do once it is over, if anything."""
        return None

    def _arrival(self, link: LinkPort, req_id: int) -> asyncio.Future | None:
        """The future of a push's arrival, when the plane itself signals it (else the requester's DONE)."""
        return None

    def serve(self, rt: Runtime, link: LinkPort, msg: Msg, req_id: int, req: TransferReq, served: Served) -> None:
        cache = served.cache
        assert cache is not None, "in-place planes serve registered caches only (see serves)"
        row = -1 if req.rows or served.row is None else served.row
        key, tensors = served.key if msg is Msg.PULL_REQ else None, served.tensors
        # The requester moves the bytes itself: our job list (16 bytes per row and tensor, rows repeated as
        # often as wire.MAX_ROWS) and, for a pull, the rows a push would record are not needed, and what is
        # kept here lasts until the peer's word, which a buggy or hostile peer never sends.
        served.pairs = None
        if msg is not Msg.PUSH_REQ:
            served.landed = []
        arrived_by_plane: asyncio.Future | None = None
        end: Callable[[], None] | None = None
        overdue: list[bool] = []  # the requester's word did not come within the request's timeout

        def ok() -> None:
            served.ended(True)
            if key is not None:
                rt.registry.release_key(key, tensors)
                rt.registry.consume(key, tensors, cache.cache_desc.num_tensors)
            if msg is Msg.PUSH_REQ:
                for target, rows_tensors, rows in served.landed:
                    rt.arrivals.record(target, rows_tensors, rows)
                link.send(Msg.DONE, req_id, status=LLMStatusCode.LLM_SUCCESS, text="")

        def failed() -> None:
            # Run where the request stopped: by the requester's failed DONE, its silence past the timeout, or the
            # link's teardown.
            served.ended(False, LLMStatusCode.LLM_TIMEOUT if overdue else stop_status(link))
            if key is not None:
                rt.registry.release_key(key, tensors)
            if msg is Msg.PUSH_REQ and served.landed:
                # The requester gave the push up (a failed DONE), went silent past its timeout, or the link
                # ended (``_teardown`` runs us before the link is marked closed: tell the watches a step later).
                asyncio.get_running_loop().call_soon(push_torn, rt, link, served,
                                                     "it was given up, or not confirmed in time")

        def abort() -> None:
            # The requester gave up before it saw our answer: it resets the channel it sent.
            ack = link.pull_acks.pop(req_id, None)
            if ack is not None:
                ack[1]()

        def settled(then: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                if link.serving.get(req_id) is abort:
                    del link.serving[req_id]
                if end is not None:
                    end()
                if arrived_by_plane is not None and not arrived_by_plane.done():
                    arrived_by_plane.cancel()
                then()
            return run

        link.serving[req_id] = abort
        await_done(link, req_id, req, settled(ok), settled(failed), expired=lambda: overdue.append(True))
        end = self._begin(link, cache)
        if msg is Msg.PUSH_REQ:
            arrived_by_plane = self._arrival(link, req_id)
            if arrived_by_plane is not None:
                def arrived(f: asyncio.Future) -> None:
                    if f.cancelled() or f.exception() is not None:
                        return
                    ack = link.pull_acks.pop(req_id, None)
                    if ack is not None:
                        ack[0]()

                arrived_by_plane.add_done_callback(arrived)
        link.send(Msg.RESP, req_id, status=LLMStatusCode.LLM_SUCCESS, total=served.total, cache_id=cache.cache_id,
                  row=row, text="")
