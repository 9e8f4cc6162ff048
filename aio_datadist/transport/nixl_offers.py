"""What one link's NIXL offers may cost each end: the bound on a cache, on a link's caches, and their pace.

A cache offered over NIXL (``OFFER``) costs the receiving end's NIXL worker
a metadata load and a descriptor list of one entry per (tensor, row), built
while every other NIXL transfer of that endpoint waits (measured with plain
agents: about 0.1-0.2 us and 70 B at the peak per entry; 2**24 entries
0.7-2 s and 1.2 GB at the peak, 2**27 27 s and 9.3 GB). So:

- a cache of more than :data:`MAX_DESCRIPTORS` entries is not registered
  with NIXL (its transfers take TCP, a device cache's the staging plane),
  and a peer's offer of more is a protocol error;
- a link carries at most :data:`MAX_LINK_CACHES` standing offers and
  :data:`MAX_LINK_DESCRIPTORS` entries in all each way (:class:`OurOffers`:
  ours never go beyond, the cache takes TCP on that link; :class:`PeerOffers`:
  the peer's beyond is a protocol error, as is an offer of a cache it offered
  already and did not withdraw);
- the loads of a peer's lists are paced (:class:`PeerOffers`): they draw on
  ``MAX_LINK_DESCRIPTORS`` entries given back at :data:`OFFER_RATE`, an offer
  past them is loaded once enough came back (its cache moves over TCP
  meanwhile), and a withdrawal cancels a load that has not started and gives
  its entries back.

The pace is per link: a peer that links again starts with a full budget.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from aio_datadist.wire import ProtocolError

__all__ = ["MAX_DESCRIPTORS", "MAX_INDICES", "MAX_LINK_CACHES", "MAX_LINK_DESCRIPTORS", "OFFER_LOAD_ENTRIES",
           "OFFER_RATE", "OurOffers", "PeerOffers", "over_link_budget", "too_many_descriptors"]

#: The most (tensor, row) entries a cache may have over NIXL (2**24: e.g. 160 tensors of 104,857 rows, or 4096
#: of 4096).
MAX_DESCRIPTORS = 1 << 24
#: NIXL's descriptor indices are 32-bit: a list's entries are numbered below this (``nixl._tensor_starts``).
MAX_INDICES = 1 << 31
assert MAX_DESCRIPTORS <= MAX_INDICES
#: The most caches, and entries in all, one end offers the other over one link.
MAX_LINK_CACHES = 1024
MAX_LINK_DESCRIPTORS = 1 << 26
#: How fast the entries a peer's loads drew on come back (per second: MAX_DESCRIPTORS in 10 s, a tenth to a
#: fifth of the worker's time at the measured cost).
OFFER_RATE = MAX_DESCRIPTORS / 10
#: What a load costs beside its entries, in entries: each offer carries the peer's agent metadata, loaded whole
#: (``add_remote_agent``: about 150 us here, as many as 1000 entries' lists), so one-entry offers withdrawn and
#: offered again draw on the budget too (they were not paced: 23,000 loads in 4 s held every NIXL call of the
#: endpoint 40 ms behind them; found by audit).
OFFER_LOAD_ENTRIES = 1024


def too_many_descriptors(tensors: int, rows: int) -> str | None:
    """Why a cache of ``tensors`` x ``rows`` is not moved by NIXL (``MAX_DESCRIPTORS``), or None."""
    if tensors * rows <= MAX_DESCRIPTORS:
        return None
    return (f"{tensors} tensors x {rows} rows are {tensors * rows} NIXL descriptors, more than the "
            f"{MAX_DESCRIPTORS} a peer accepts")


def over_link_budget(offered: Mapping[int, int], cache_id: int, descriptors: int) -> str | None:
    """Why one more cache (``cache_id``, of ``descriptors``) does not fit beside ``offered`` (cache id ->
    descriptors) on one link (``MAX_LINK_CACHES``, ``MAX_LINK_DESCRIPTORS``), or None."""
    others = {k: v for k, v in offered.items() if k != cache_id}
    if len(others) >= MAX_LINK_CACHES:
        return f"{len(others)} caches are offered on the link already, the most a peer accepts"
    if sum(others.values()) + descriptors > MAX_LINK_DESCRIPTORS:
        return (f"{sum(others.values()) + descriptors} NIXL descriptors on the link with it, more than the "
                f"{MAX_LINK_DESCRIPTORS} a peer accepts")
    return None


class OurOffers:
    """The caches we offered the peer on one link, by id (their entries): never more than it accepts."""

    def __init__(self) -> None:
        self.entries: dict[int, int] = {}
        self.refused_before = False  # whether take() refused a cache on this link already (logged once)

    def take(self, cache_id: int, descriptors: int) -> str | None:
        """Count ``cache_id`` as offered, or say why it would go beyond the link's budget (not counted then)."""
        over = over_link_budget(self.entries, cache_id, descriptors)
        if over is None:
            self.entries[cache_id] = descriptors
        return over

    def withdrawn(self, cache_id: int) -> None:
        self.entries.pop(cache_id, None)


class PeerOffers:
    """The caches the peer offered us on one link, until it withdraws them: checked against the link's budget,
    the loads of their lists paced and cancelled by their withdrawal."""

    def __init__(self) -> None:
        self.declared: dict[int, int] = {}  # cache id -> entries
        self.loading: dict[int, asyncio.Future] = {}  # cache id -> its load, until it ends
        self._tokens = float(MAX_LINK_DESCRIPTORS)  # what the next loads may take
        self._tokens_at = asyncio.get_running_loop().time()
        self._unstarted: dict[asyncio.Future, int] = {}  # entries of each delayed load not started yet

    def accept(self, cache_id: int, descriptors: int) -> float:
        """The peer offers ``cache_id`` of ``descriptors`` entries: how long its load waits (0: now; its load draws
        ``descriptors`` + :data:`OFFER_LOAD_ENTRIES`, :meth:`cost`). A ProtocolError if it offered it already (an
        honest peer withdraws it first) or it is beyond the budget."""
        if cache_id in self.declared:
            raise ProtocolError("NIXL offer of a cache offered already")
        if over_link_budget(self.declared, cache_id, descriptors) is not None:
            raise ProtocolError("NIXL offers beyond the link's budget")
        self.declared[cache_id] = descriptors
        now = asyncio.get_running_loop().time()
        self._tokens = min(float(MAX_LINK_DESCRIPTORS), self._tokens + (now - self._tokens_at) * OFFER_RATE)
        self._tokens_at = now
        self._tokens -= self.cost(descriptors)  # below zero: loads offered later wait behind this one
        return 0.0 if self._tokens >= 0 else -self._tokens / OFFER_RATE

    @staticmethod
    def cost(descriptors: int) -> int:
        """What the load of a cache of ``descriptors`` entries draws on the pace's budget."""
        return descriptors + OFFER_LOAD_ENTRIES

    def track(self, cache_id: int, load: asyncio.Future, delayed: int = 0) -> None:
        """``load`` loads ``cache_id``'s list; ``delayed``: it waits first, and these entries come back if it is
        cancelled before it starts."""
        self.loading[cache_id] = load
        if delayed:
            self._unstarted[load] = delayed

        def ended(f: asyncio.Future) -> None:
            if self.loading.get(cache_id) is f:
                del self.loading[cache_id]
            self._refund(f)  # cancelled before it started (even before its task's first step)

        load.add_done_callback(ended)

    def started(self, load: asyncio.Future) -> None:
        """A delayed load starts: its entries stay spent."""
        self._unstarted.pop(load, None)

    def withdraw(self, cache_id: int) -> None:
        """The peer withdrew ``cache_id``: its share of the budget is back, a load of it not ended is cancelled,
        and one that had not started gives its entries back now (before an offer read with this draws on them)."""
        self.declared.pop(cache_id, None)
        queued = self.loading.pop(cache_id, None)
        if queued is not None:
            queued.cancel()
            self._refund(queued)

    def _refund(self, load: asyncio.Future) -> None:
        self._tokens += self._unstarted.pop(load, 0)
