"""Watching pushes land: how a decoder learns that pushed layers are in place.

A decoder creates a :class:`PushWatch` for the blocks (or batch rows) it
expects, before it tells the prefill side where to push, then awaits the
whole watch or one layer at a time. Only pushes that complete after the watch
was created count, so reused blocks never look ready from an earlier request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

from aio_datadist._checks import check_int, param_invalid
from aio_datadist.cache import KvCache
from aio_datadist.status import LLMException, LLMStatusCode

__all__ = ["Arrivals", "PushWatch"]


class PushWatch:
    """Futures for the layers of some rows of one cache, completed by peer pushes.

    ``await watch`` (or ``await watch.wait(timeout=ms)``) returns once every
    selected layer of every row has landed; ``await watch.layer(i)`` once
    layer ``i`` has. Close it (or use ``with``) when no longer needed.
    """

    def __init__(self, arrivals: Arrivals, cache: KvCache, rows: Sequence[int], layers: range,
                 tensors_per_layer: int) -> None:
        loop = asyncio.get_running_loop()
        self._arrivals = arrivals
        self._cache = cache
        self._per_layer = tensors_per_layer
        self._missing: dict[int, set[tuple[int, int]]] = {
            layer: {(t, r) for t in range(layer * tensors_per_layer, (layer + 1) * tensors_per_layer) for r in rows}
            for layer in layers}
        self._layers = {layer: loop.create_future() for layer in layers}
        self._all = loop.create_future()
        self._closed = False

    @property
    def cache(self) -> KvCache:
        return self._cache

    def _landed(self, tensors: range, rows: Iterable[int]) -> None:
        rows = list(rows)
        for t in tensors:
            layer = t // self._per_layer
            missing = self._missing.get(layer)
            if not missing:
                continue
            missing.difference_update((t, r) for r in rows)
            if not missing:
                self._layers[layer].set_result(None)
        if not self._all.done() and all(f.done() for f in self._layers.values()):
            self._all.set_result(None)
            self.close()

    def layer(self, index: int) -> asyncio.Future:
        """Future completing once layer ``index`` of every watched row landed."""
        index = check_int("index", index)
        if index not in self._layers:
            raise param_invalid("index", f"layer {index} is not watched")
        waiter = asyncio.shield(self._layers[index])
        waiter.add_done_callback(_retrieved)  # a closed watch fails layers nobody may await
        return waiter

    def done(self) -> bool:
        return self._all.done()

    def __await__(self) -> Any:
        return asyncio.shield(self._all).__await__()

    async def wait(self, timeout: int | None = None) -> None:
        """Wait until everything landed; ``timeout`` in ms raises ``LLM_TIMEOUT``."""
        if timeout is None:
            await asyncio.shield(self._all)
            return
        ms = check_int("timeout", timeout, lo=1, hi=2**31 - 1)
        try:
            await asyncio.wait_for(asyncio.shield(self._all), ms / 1000)
        except TimeoutError:
            missing = sorted(layer for layer, fut in self._layers.items() if not fut.done())
            raise LLMException(f"pushed layers {missing} did not land within {ms} ms",
                               status_code=LLMStatusCode.LLM_TIMEOUT) from None

    def close(self) -> None:
        """Stop watching; waiters still pending fail with ``LLM_FAILED``."""
        if self._closed:
            return
        self._closed = True
        self._arrivals._remove(self)
        exc = LLMException("the push watch was closed", status_code=LLMStatusCode.LLM_FAILED)
        for fut in [*self._layers.values(), self._all]:
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()

    def __enter__(self) -> PushWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Arrivals:
    """The open watches of one endpoint, fed by completed pushes."""

    def __init__(self) -> None:
        self._watches: dict[int, list[PushWatch]] = {}

    def add(self, watch: PushWatch) -> PushWatch:
        self._watches.setdefault(id(watch.cache), []).append(watch)
        return watch

    def _remove(self, watch: PushWatch) -> None:
        watches = self._watches.get(id(watch.cache), [])
        if watch in watches:
            watches.remove(watch)
        if not watches:
            self._watches.pop(id(watch.cache), None)

    def record(self, cache: KvCache, tensors: range, rows: Iterable[int]) -> None:
        rows = list(rows)
        for watch in list(self._watches.get(id(cache), ())):
            watch._landed(tensors, rows)

    def close(self) -> None:
        for watches in list(self._watches.values()):
            for watch in list(watches):
                watch.close()


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
