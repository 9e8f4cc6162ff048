"""Watching pushes land: how a decoder learns that pushed layers are in place.

A decoder creates a :class:`PushWatch` for the blocks (or batch rows) it
expects, before it tells the prefill side where to push, then awaits the
whole watch or one layer at a time. Only push requests this endpoint accepted
after the watch was created count (:meth:`Arrivals.accepted` stamps each), so
a request of an earlier transfer still landing neither completes nor fails
it. Each layer of a layer-wise transfer is a request of its own, accepted as
it comes: blocks are reused safely once the earlier transfer into them is
over (its pusher's task ended or was cancelled). A push counts for each row
it writes from the row's first byte, whole or a prefix of it (the last block
of a cache pushed into blocks holds the rest of the row). A push into
watched rows that was accepted here and then failed (the pusher gave it up,
the link went, our job failed) fails the layers it touched
(:meth:`Arrivals.torn`): their bytes may be torn. A watch has no timeout of
its own: a peer that never starts pushing is caught by the caller's bound.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from aio_datadist._checks import check_int, param_invalid
from aio_datadist.cache import KvCache
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.views import Views, fail_quietly, refuse_other_loop

__all__ = ["Arrivals", "PushWatch"]


class PushWatch:
    """Futures for the layers of some rows of one cache, completed by peer pushes.

    ``await watch`` (or ``await watch.wait(timeout=ms)``) returns once every
    selected layer of every row has landed; ``await watch.layer(i)`` once
    layer ``i`` has. A push into watched rows that fails part-way (its pusher
    gave it up, the link failed, the job failed here) raises
    :class:`LLMException` from the layers it touched and from ``await watch``
    (``LLM_LINK_FAILED`` when the link went, else the failure's code); layers
    that landed stay done. A failed layer stays failed: watch again for a
    retried push. Deallocating or unregistering the cache fails what is still
    pending with ``LLM_KV_CACHE_NOT_EXIST``. The watch has no timeout of its
    own: bound the wait (``wait(timeout=...)``, ``asyncio.timeout``), as a peer
    that never starts pushing is caught only so. Close it (or use ``with``)
    when no longer needed. Wait on it from the endpoint's event loop: from
    another, waiting for what is still pending raises ``LLM_FAILED``.
    """

    def __init__(self, arrivals: Arrivals, cache: KvCache, rows: Sequence[int], layers: range,
                 tensors_per_layer: int) -> None:
        loop = asyncio.get_running_loop()
        self._arrivals = arrivals
        self._cache = cache
        self._per_layer = tensors_per_layer
        self._rows = frozenset(rows)
        self._missing: dict[int, set[tuple[int, int]]] = {
            layer: {(t, r) for t in range(layer * tensors_per_layer, (layer + 1) * tensors_per_layer) for r in rows}
            for layer in layers}
        self._layers = {layer: loop.create_future() for layer in layers}
        self._pending = len(self._layers)  # layers not done yet (only this class resolves their futures)
        # what layer() handed out: one done-callback per layer feeds them all, so polling adds nothing to
        # the layer's future, and a waiter its caller cancels leaves the layer to the others
        self._views = Views()  # what layer() handed out
        self._all = loop.create_future()
        self._closed = False
        self._since = arrivals.stamp  # pushes accepted up to here are not this watch's
        self._number = 0  # its place among the watches (``Arrivals.add``)

    @property
    def cache(self) -> KvCache:
        return self._cache

    def _landed(self, tensors: range, rows: frozenset[int]) -> None:
        mine = self._rows.intersection(rows)  # a push of many rows, each watch of a few (found by two reviews)
        if not mine:
            return
        for t in tensors:
            layer = t // self._per_layer
            missing = self._missing.get(layer)
            if not missing:
                continue
            missing.difference_update((t, r) for r in mine)
            if not missing:
                self._layers[layer].set_result(None)
                self._pending -= 1
        if not self._pending:
            if not self._all.done():  # else a torn layer failed it already
                self._all.set_result(None)
            self.close()

    def _torn(self, tensors: range, rows: Iterable[int], exc: LLMException) -> None:
        """A push into ``rows`` of ``tensors`` failed part-way: fail the pending layers it touched."""
        hit = self._rows.intersection(rows)
        if not hit:
            return
        layers = sorted({t // self._per_layer for t in tensors} & {
            layer for layer, fut in self._layers.items() if not fut.done()})
        if not layers:
            return
        text = f"pushed layers {layers} of rows {_spans(hit)} did not land: {exc.args[0] if exc.args else exc}"
        for layer in layers:
            self._missing[layer].clear()  # a later push of the layer cannot complete a failed future
            fail_quietly(self._layers[layer], LLMException(text, status_code=exc.status_code))
        self._pending -= len(layers)
        if not self._all.done():
            fail_quietly(self._all, LLMException(text, status_code=exc.status_code))
        if not self._pending:
            self.close()

    def layer(self, index: int) -> asyncio.Future:
        """Future completing once layer ``index`` of every watched row landed."""
        index = check_int("index", index)
        if index not in self._layers:
            raise param_invalid("index", f"layer {index} is not watched")
        return self._views.view(index, self._layers[index])

    def done(self) -> bool:
        return self._all.done()

    def __await__(self) -> Any:
        refuse_other_loop("a PushWatch", self._all)
        return asyncio.shield(self._all).__await__()

    async def wait(self, timeout: int | None = None) -> None:
        """Wait until everything landed; ``timeout`` in ms raises ``LLM_TIMEOUT``."""
        refuse_other_loop("a PushWatch", self._all)
        if timeout is None:
            await asyncio.shield(self._all)
            return
        ms = check_int("timeout", timeout, lo=1, hi=2**31 - 1)
        try:
            # (asyncio.timeout, not wait_for: on Python 3.11 wait_for dropped a cancel of ours that came in
            # the loop pass the watch completed, and returned as if nothing had been cancelled)
            async with asyncio.timeout(ms / 1000):
                await asyncio.shield(self._all)
        except TimeoutError:
            missing = sorted(layer for layer, fut in self._layers.items() if not fut.done())
            raise LLMException(f"pushed layers {missing} did not land within {ms} ms",
                               status_code=LLMStatusCode.LLM_TIMEOUT) from None

    def close(self, exc: LLMException | None = None) -> None:
        """Stop watching; waiters still pending fail with ``LLM_FAILED`` (or ``exc``)."""
        if self._closed:
            return
        self._closed = True
        self._arrivals._remove(self)
        if exc is None:
            exc = LLMException("the push watch was closed", status_code=LLMStatusCode.LLM_FAILED)
        for fut in [*self._layers.values(), self._all]:
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()

    def __enter__(self) -> PushWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Stamped(list[int]):
    """The rows of a push, stamped with when this endpoint accepted it (:meth:`Arrivals.accepted`)."""

    __slots__ = ("accepted",)

    def __init__(self, rows: Iterable[int], accepted: int) -> None:
        super().__init__(rows)
        self.accepted = accepted


class Arrivals:
    """The open watches of one endpoint, fed by completed pushes.

    Kept by cache and by row: a push hears only the watches of the rows it wrote. Before, every push checked
    every open watch of its cache (one per request, as a decoder watches before the prefill side pushes): with
    8000 watches open, a one-block push of 40 layers held the event loop 180 ms (found by a hunt)."""

    def __init__(self) -> None:
        # id(cache) -> its open watches, and id(cache) -> row -> the watches of that row (dicts as ordered sets)
        self._watches: dict[int, dict[PushWatch, None]] = {}
        self._by_row: dict[int, dict[int, dict[PushWatch, None]]] = {}
        self._numbers = itertools.count()  # a watch's number: watches hear a push in the order they were made
        self._accepted = 0  # pushes accepted so far: a watch hears only of those accepted after it was made

    def add(self, watch: PushWatch) -> PushWatch:
        watch._number = next(self._numbers)
        self._watches.setdefault(id(watch.cache), {})[watch] = None
        by_row = self._by_row.setdefault(id(watch.cache), {})
        for row in watch._rows:
            by_row.setdefault(row, {})[watch] = None
        return watch

    def _remove(self, watch: PushWatch) -> None:
        key = id(watch.cache)
        watches = self._watches.get(key)
        if watches is None or watch not in watches:
            return
        del watches[watch]
        by_row = self._by_row[key]
        for row in watch._rows:
            of_row = by_row.get(row)
            if of_row is not None:
                of_row.pop(watch, None)
                if not of_row:
                    del by_row[row]
        if not watches:
            del self._watches[key]
            del self._by_row[key]

    @property
    def stamp(self) -> int:
        """The stamp of the last push accepted (0: none yet)."""
        return self._accepted

    def accepted(self, cache: KvCache, tensors: range, rows: Iterable[int]) -> tuple[KvCache, range, list[int]]:
        """A push into ``rows`` of ``tensors`` of ``cache`` was accepted now: what to :meth:`record` (or
        :meth:`torn`) once it is over, stamped so that only watches made before now hear of it."""
        self._accepted += 1
        return cache, tensors, _Stamped(rows, self._accepted)

    def _hearing(self, cache: KvCache, rows: Iterable[int]) -> tuple[list[PushWatch], frozenset[int]]:
        """The open watches of ``rows`` of ``cache`` made before their push was accepted (all, unstamped), in
        the order they were made, and the rows as a set (made once per push: each watch intersects its few)."""
        accepted = rows.accepted if isinstance(rows, _Stamped) else self._accepted + 1
        by_row = self._by_row.get(id(cache))
        if not by_row:
            return [], frozenset()
        pushed = frozenset(rows)
        hit: dict[PushWatch, None] = {}
        for row in pushed:
            of_row = by_row.get(row)
            if of_row:
                hit.update(of_row)
        hearing = sorted((watch for watch in hit if watch._since < accepted), key=lambda watch: watch._number)
        return hearing, pushed

    def record(self, cache: KvCache, tensors: range, rows: Iterable[int]) -> None:
        hearing, pushed = self._hearing(cache, rows)
        for watch in hearing:
            watch._landed(tensors, pushed)

    def watched(self, cache: KvCache) -> bool:
        """Whether an open watch watches ``cache``."""
        return id(cache) in self._watches

    def torn(self, cache: KvCache, tensors: range, rows: Iterable[int], exc: LLMException) -> None:
        """A push into ``rows`` of ``tensors`` of ``cache``, accepted here, failed (some bytes may have landed):
        every open watch of those rows made before the push was accepted fails its pending layers among
        ``tensors`` with ``exc``'s status."""
        hearing, pushed = self._hearing(cache, rows)
        for watch in hearing:
            watch._torn(tensors, pushed, exc)

    def released(self, cache: KvCache) -> None:
        """``cache`` was deallocated or unregistered: nothing can land in it for its caller any more, so every
        open watch of it fails what is still pending with ``LLM_KV_CACHE_NOT_EXIST`` and closes."""
        for watch in list(self._watches.get(id(cache), ())):
            watch.close(LLMException(f"cache {cache.cache_id} was released while its pushes were watched",
                                     status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST))

    def close(self) -> None:
        for watches in list(self._watches.values()):
            for watch in list(watches):
                watch.close()


def _spans(rows: Iterable[int]) -> str:
    """``0-23, 30`` for rows 0 to 23 and 30 (the first 8 runs, then how many more)."""
    runs: list[list[int]] = []
    for r in sorted(rows):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs[:8])
    return text + (f" and {len(runs) - 8} more runs" if len(runs) > 8 else "")
