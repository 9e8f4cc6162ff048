"""NIXL pulls without asking: the grants of one link, on the requester's side and on the owner's.

A pull of a blocks cache by its blocks key does not ask when the owner
granted it (``GRANT``, sent with the cache's ``OFFER``): the requester runs
the owner's own check against the granted geometry (``transport/fit.py``),
then reads the owner's ledger word for the cache (``transport/ledger.py``,
registered with NIXL and offered as ``LEDGER``) into a word of its own, and
only if that word still names the cache posts its READ of the rows. The word
holds the cache's id exactly while the owner binds the key to it and offers
it; a word that differs means the cache was unbound, withdrawn or freed, and
the pull asks the owner after all, having written nothing (the owner moves
the rows, or refuses). The owner clears the word
before it withdraws or frees the cache, then sends ``REVOKE`` and keeps the
cache registered (and its memory alive) until the peer says ``REVOKED``,
which it does once no read of it is in flight (``REVOKE_WAIT_S`` at most),
or the link ends. The owner hears of such reads afterwards (``READS``,
summed over ``REPORT_AFTER_S``), for its counters. A read that waits for the
owner's progress asks for it (``NUDGE``).

:class:`ReadGrants` is the requester's half (what the peer granted us and
our reads of it), :class:`Revocations` the owner's (what we granted the
peer, our revocations it has not answered, the progress its reads need).
The link's NIXL peer holds one of each, gives them its send callable, and
keeps what they read through: the peer's ledger and caches, prepared for
NIXL, and the posting of the READs.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

from aio_datadist.plans import block_shape_digest
from aio_datadist.transport.fit import Geometry
from aio_datadist.transport.ledger import SLOTS
from aio_datadist.wire import ProtocolError

if TYPE_CHECKING:
    from aio_datadist.cache import KvCache
    from aio_datadist.transport.nixl_engine import NixlEngine

__all__ = ["ReadGrants", "Revocations", "LEDGER", "GRANT", "REVOKE", "REVOKED", "READS", "NUDGE", "GRANT_INFO",
           "CALLER_MEMORY", "REGISTRATION_MASK",
           "REVOKE_WAIT_S", "REPORT_AFTER_S", "MAX_READS", "NUDGE_AFTER_S", "NUDGE_HOLD_S", "NUDGE_RATE"]

log = logging.getLogger("aio_datadist.nixl")

#: Record kinds of reads without asking (``Msg.NIXL`` records; the link's own are numbered below them): our
#: ledger's words, a cache peers may read, its end, the peer's word that it no longer reads it, and the reads
#: it made. NUDGE: a read of ours is waiting for the owner's progress.
LEDGER, GRANT, REVOKE, REVOKED, READS, NUDGE = 8, 9, 10, 11, 12, 13
#: A ``GRANT`` record's blob: the cache's blocks key (model id), data type, block-shape digest, and what its
#: ledger word holds while the grant stands: the cache id and, above it, which registration of the cache this
#: is (a cache registered anew, ``registry.refresh``, gets a new word: a peer still holding the old
#: registration's list reads a word that differs and asks). The word's top bit (``CALLER_MEMORY``) says the
#: cache is memory the caller registered, which is the caller's again once it is released.
GRANT_INFO = struct.Struct("!QIQQ")
#: Set in the ledger word of a registered (caller-owned) cache. Its memory is reused the moment the owner's
#: ``deallocate_cache`` / ``unregister_cache`` returned, while an allocated cache's memory lives until every
#: peer said ``REVOKED``: a reader checks such a word again after the rows' READ, and asks when it changed.
CALLER_MEMORY = 1 << 63
#: The registration's number takes the 31 bits between the cache id and ``CALLER_MEMORY`` (it wraps).
REGISTRATION_MASK = (1 << 31) - 1
#: How long the owner keeps a cache it revoked registered for a peer that does not say ``REVOKED``.
REVOKE_WAIT_S = 10.0
#: How long reads made without asking are summed before they are reported (``READS``), and the most one
#: report counts.
REPORT_AFTER_S = 0.01
MAX_READS = 1 << 20
#: A read without asking still in progress this long asks the owner to make progress (``NUDGE``), which it
#: does for ``NUDGE_HOLD_S`` after the last nudge. UCX over shared memory or RDMA reads one-sidedly once
#: the endpoint is wired up, which needs the owner's progress once; UCX over TCP needs it for every read.
NUDGE_AFTER_S = 0.002
NUDGE_HOLD_S = 1.0
#: ... plus its bytes at this rate (B/s): a large READ still copying is not waiting for anyone.
NUDGE_RATE = 2e9

#: Sends one record to the peer: kind, cache id, count, row bytes, rows, blob.
Send = Callable[[int, int, int, int, tuple, bytes], None]


class Region(Protocol):
    """What a grant's geometry is made from: the peer's cache as prepared for NIXL."""

    tensors: int
    rows: int
    row_bytes: int


R = TypeVar("R", bound=Region)


class ReadGrants:
    """The requester's side on one link: the caches the peer lets us read without asking, and our reads of them.

    The peer's records ``GRANT`` and ``REVOKE`` arrive here; we send
    ``REVOKED``, ``READS`` and ``NUDGE`` through ``send``.
    """

    def __init__(self, send: Send, loop: asyncio.AbstractEventLoop) -> None:
        self._send = send
        self._loop = loop
        # The caches the peer granted (cache id -> slot, model id, data type, block-shape digest, word) and by
        # blocks key, our reads of each in flight, the caches it revoked that we still read, and our reads not
        # yet reported.
        self.grants: dict[int, tuple[int, int, int, int, int]] = {}
        self.by_model: dict[int, int] = {}
        self._geometries: dict[int, tuple[object, tuple, Geometry]] = {}  # grant_for's, per offer and grant
        self.reading: dict[int, int] = {}  # reads in flight per cache (a dict: Counter's methods run in Python)
        self._revoked: collections.Counter[int] = collections.Counter()  # REVOKEs to answer once reads end
        # Grants the peer has not revoked yet, per cache (kept through a DECLINE: reads in flight still answer
        # revocations). An honest owner revokes a cache once per grant of it; a REVOKE past that is a lie.
        self._unrevoked: collections.Counter[int] = collections.Counter()
        self._reads: dict[int, list] = {}
        self._reporting: asyncio.TimerHandle | None = None
        self._nudged = 0.0  # when we last nudged the peer (loop time)
        self.declined = False  # the link gave NIXL up: reads are no longer reported
        self.closed = False  # the link ended: nothing is sent

    def grant_for(self, model_id: int, regions: Mapping[int, R]) -> tuple[R, Geometry, int, int] | None:
        """The peer's cache bound to blocks key ``model_id`` that it lets us read without asking, among
        ``regions`` (the peer's caches as prepared, by id): its region, its geometry (for ``fit``), its ledger
        slot and what the word there holds while the grant stands; None when we must ask."""
        cache_id = self.by_model.get(model_id)
        if cache_id is None or cache_id in self._revoked:
            return None
        remote = regions.get(cache_id)
        grant = self.grants.get(cache_id)
        if remote is None or grant is None:
            return None
        slot, _model_id, data_type, shape, word = grant
        known = self._geometries.get(cache_id)
        if known is None or known[0] is not remote or known[1] is not grant:  # made once per offer and grant
            known = (remote, grant, Geometry(cache_id, True, data_type, remote.tensors, remote.rows, remote.row_bytes,
                                             shape))
            self._geometries[cache_id] = known
        return remote, known[2], slot, word

    def read_started(self, cache_id: int) -> bool:
        """A read of ``cache_id`` without asking starts, if the peer still grants it."""
        if cache_id not in self.grants:
            return False
        self.reading[cache_id] = self.reading.get(cache_id, 0) + 1
        return True

    def read_ended(self, cache_id: int) -> None:
        """That read settled (NIXL let go of it): once no read of a revoked cache is left, say ``REVOKED``."""
        left = self.reading.pop(cache_id, 1) - 1
        if left > 0:
            self.reading[cache_id] = left
        else:
            for _ in range(self._revoked.pop(cache_id, 0)):  # one REVOKED per REVOKE
                if not self.closed:
                    self._send(REVOKED, cache_id, 0, 0, (), b"")

    def tell_read(self, cache_id: int, nbytes: int, seconds: float) -> None:
        """We read ``nbytes`` of the peer's cache ``cache_id`` without asking: summed, reported ``REPORT_AFTER_S``
        after the first (``READS``: count, bytes, microseconds)."""
        reads = self._reads.setdefault(cache_id, [0, 0, 0.0])
        if reads[0] >= MAX_READS:
            return
        reads[0] += 1
        reads[1] += nbytes
        reads[2] += seconds
        if self._reporting is None and not self.closed:
            self._reporting = self._loop.call_later(REPORT_AFTER_S, self._report_reads)

    def report_reads(self) -> None:
        """Send the reads not reported yet now (the link is about to go: the ``UNLINK``, or the answer to the
        peer's, follows on the same connection, and the link's end drops what is still unsent)."""
        if self._reporting is not None:
            self._reporting.cancel()
        self._report_reads()

    def _report_reads(self) -> None:
        self._reporting = None
        reads, self._reads = self._reads, {}
        if self.closed or self.declined:
            return
        for cache_id, (count, nbytes, seconds) in reads.items():
            self._send(READS, cache_id, count, nbytes, (int(seconds * 1e6),), b"")

    def nudge(self) -> None:
        """A read of ours waits for the owner's progress: ask for it (at most once per ``NUDGE_AFTER_S``)."""
        now = self._loop.time()
        if now - self._nudged >= NUDGE_AFTER_S and not self.closed:
            self._nudged = now
            self._send(NUDGE, 0, 0, 0, (), b"")

    def on_grant(self, cache_id: int, slot: int, blob: bytes) -> None:
        """The peer's ``GRANT`` of ``cache_id`` (a bad one is a ProtocolError)."""
        if cache_id <= 0 or slot >= SLOTS or len(blob) != GRANT_INFO.size or cache_id in self.grants:
            raise ProtocolError("bad NIXL grant")
        model_id, data_type, shape, word = GRANT_INFO.unpack(blob)
        if word == 0:
            raise ProtocolError("bad NIXL grant")
        self.grants[cache_id] = (slot, model_id, data_type, shape, word)
        self.by_model[model_id] = cache_id
        self._unrevoked[cache_id] += 1

    def forget(self, cache_id: int) -> None:
        """The peer withdrew ``cache_id``: no read of it starts any more (one in flight still ends as before)."""
        self._geometries.pop(cache_id, None)
        grant = self.grants.pop(cache_id, None)
        if grant is not None and self.by_model.get(grant[1]) == cache_id:
            del self.by_model[grant[1]]

    def withdrawn(self, cache_id: int) -> None:
        """The peer withdrew ``cache_id`` (``WITHDRAW``): :meth:`forget` it, and the grants of it not revoked yet
        with it. An honest owner revokes every grant before it withdraws; a peer that never does (OFFER, GRANT,
        WITHDRAW with a new id each time) left one count per id for the link's life (found by audit)."""
        self.forget(cache_id)
        self._unrevoked.pop(cache_id, None)

    def on_revoke(self, cache_id: int) -> None:
        """The peer's ``REVOKE`` of ``cache_id``: answered once no read of ours is in flight. One per grant of it
        (a ProtocolError past that): each owes a ``REVOKED``, which went out all at once as the read ended, so
        a peer repeating it while our read was in flight had us queue any number of records in one loop step
        past the control connection's write limit (and one not granted was answered at once: a reflection)."""
        owed = self._unrevoked[cache_id]
        if owed <= 0:
            if self.declined and not self.closed:
                # We gave NIXL up: its GRANTs since were dropped unread, their REVOKEs are honest. Nothing of
                # the cache is read here: say so at once (one record per record, nothing held back).
                self._send(REVOKED, cache_id, 0, 0, (), b"")
                return
            raise ProtocolError("NIXL revoke of a cache not granted (or revoked already)")
        if owed == 1:
            del self._unrevoked[cache_id]
        else:
            self._unrevoked[cache_id] = owed - 1
        self.forget(cache_id)
        if self.reading.get(cache_id, 0) > 0:
            self._revoked[cache_id] += 1  # REVOKED once our last read of it settled (read_ended)
        else:
            self._send(REVOKED, cache_id, 0, 0, (), b"")

    def decline(self) -> None:
        """Read nothing more without asking on this link (NIXL was given up; reads in flight still answer
        revocations)."""
        self.declined = True
        self._forget()

    def close(self) -> None:
        """The link ended: read nothing more, send nothing more."""
        self.closed = True
        self._forget()
        if self._reporting is not None:
            self._reporting.cancel()
            self._reporting = None

    def _forget(self) -> None:
        self.grants.clear()
        self.by_model.clear()
        self._geometries.clear()


class Revocations:
    """The owner's side on one link: the caches we let the peer read without asking, our revocations it has not
    answered, the progress its reads need from us, and its reports of them.

    A revoked cache is kept registered through ``keep(cache_id)`` until the
    peer answers or ``REVOKE_WAIT_S`` passed, then let go through
    ``let_go(cache_id)``; the ``engine`` makes progress while the peer nudges
    us; ``on_read(count, nbytes, seconds)`` hears the reads it reports.
    """

    def __init__(self, send: Send, loop: asyncio.AbstractEventLoop, engine: NixlEngine, cluster_id: int,
                 keep: Callable[[int], None], let_go: Callable[[int], None],
                 on_read: Callable[[int, int, float], None] | None) -> None:
        self._send = send
        self._loop = loop
        self._engine = engine
        self._cluster_id = cluster_id
        self._keep = keep
        self._let_go = let_go
        self._on_read = on_read  # (count, nbytes, seconds): the peer read caches of ours without asking
        self.grants_sent: set[int] = set()
        # One timer per REVOKE not answered yet, oldest first: a cache refreshed (the same id granted again)
        # may be revoked again before the peer answered the first; each REVOKED answers the oldest.
        self._revoking: dict[int, list[asyncio.TimerHandle]] = {}
        self._nudge_end: asyncio.TimerHandle | None = None  # while set, we make progress for the peer's reads
        self.closed = False

    def grant(self, cache: KvCache, slot: int, model_id: int, word: int) -> None:
        """Let the peer read ``cache`` (offered to it a moment ago) without asking: its ledger ``slot`` holds
        ``word`` while it is bound to blocks key ``model_id``."""
        self.grants_sent.add(cache.cache_id)
        info = GRANT_INFO.pack(model_id, cache.cache_desc.data_type.value, block_shape_digest(cache), word)
        self._send(GRANT, cache.cache_id, slot, 0, (), info)

    def revoke(self, cache_id: int) -> None:
        """``cache_id`` is withdrawn and its ledger word clear: if we granted it, tell the peer and keep it
        registered until the peer's ``REVOKED`` (also after a DECLINE: reads the peer started before may be in
        flight)."""
        if cache_id not in self.grants_sent:
            return
        self.grants_sent.discard(cache_id)
        if self.closed:
            return
        self._send(REVOKE, cache_id, 0, 0, (), b"")
        self._keep(cache_id)
        timer: list[asyncio.TimerHandle] = []  # the lambda reads it when it runs: the handle itself
        timer.append(self._loop.call_later(REVOKE_WAIT_S, lambda: self._revoke_over(cache_id, timer[0])))
        self._revoking.setdefault(cache_id, []).append(timer[0])

    def on_revoked(self, cache_id: int) -> None:
        """The peer's ``REVOKED``: it no longer reads ``cache_id`` as far as our oldest revocation goes."""
        self._revoke_over(cache_id)

    def on_nudge(self) -> None:
        """The peer's reads need our progress (``NUDGE``); make it for ``NUDGE_HOLD_S`` from now."""
        if self.closed or not self.grants_sent:
            return  # nothing of ours may be read without asking
        if self._nudge_end is None:
            self._engine.hold()
        else:
            self._nudge_end.cancel()
        self._nudge_end = self._loop.call_later(NUDGE_HOLD_S, self._progress_over)

    def on_reads(self, count: int, nbytes: int, rows: Sequence[int]) -> None:
        """The peer's ``READS``: it read ``count`` times, ``nbytes`` in all (only our counters believe it)."""
        if 0 < count <= MAX_READS and len(rows) == 1 and self._on_read is not None:
            self._on_read(count, nbytes, min(rows[0], 3600_000_000) / 1e6)

    def close(self) -> None:
        """The link ended: the peer reads nothing of ours through it any more."""
        self.closed = True
        self.grants_sent.clear()
        self._progress_over()
        for cache_id, timers in list(self._revoking.items()):
            for _ in list(timers):
                self._revoke_over(cache_id)

    def _progress_over(self) -> None:
        if self._nudge_end is not None:
            self._nudge_end.cancel()
            self._nudge_end = None
            self._engine.unhold()

    def _revoke_over(self, cache_id: int, late: asyncio.TimerHandle | None = None) -> None:
        """The peer no longer reads ``cache_id`` without asking as far as our oldest revocation of it goes (it
        said so, or it is gone), or ``late``: it did not answer that revocation within ``REVOKE_WAIT_S``: that
        revocation no longer keeps the cache registered."""
        timers = self._revoking.get(cache_id)
        if not timers or (late is not None and late not in timers):
            return
        timer = late if late is not None else timers[0]
        timers.remove(timer)
        if not timers:
            del self._revoking[cache_id]
        timer.cancel()
        if late is not None:
            log.warning("cluster %s did not say it stopped reading cache %s within %g s; deregistering it",
                        self._cluster_id, cache_id, REVOKE_WAIT_S)
        self._let_go(cache_id)
