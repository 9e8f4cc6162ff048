"""Where registered memory lies: the tensors' spans of every cache, sorted, kept as caches come and go.

Registered memory is disjoint (``CacheRegistry.check_unregistered`` refuses
an overlap), so the spans sorted by start are sorted by end too, and the one
span that can hold (or overlap) an address range is found by bisection.
Before this index, each check sorted every registered tensor again: with
4000 caches of 128 tensors a ``register_cache`` or a call naming a
``create_cpu_cache`` cache held the event loop 140-480 ms, and a peer's
raw-address push scanned every tensor once per address (found by a hunt).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

__all__ = ["SpanIndex"]


class SpanIndex:
    """Spans ``[base, base + nbytes)`` of registered tensors, each named by its cache id and tensor index."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._spans: list[tuple[int, int, int, int]] = []  # (start, end, cache_id, tensor), sorted by start
        self._bases: dict[int, list[int]] = {}  # cache id -> its tensors' starts

    def __len__(self) -> int:
        return len(self._spans)

    def add(self, cache_id: int, bases: Iterable[int], nbytes: int) -> None:
        """Index the tensors of cache ``cache_id`` (each ``nbytes`` long at its base)."""
        assert cache_id not in self._bases, f"cache {cache_id} is indexed already"
        starts = list(bases)
        new = sorted((base, base + nbytes, cache_id, tensor) for tensor, base in enumerate(starts))
        self._bases[cache_id] = starts
        if not new:
            return
        k = bisect.bisect_left(self._starts, new[0][0])
        if k == bisect.bisect_left(self._starts, new[-1][0]):
            # No other cache's tensor lies among this one's (a cache allocated in one region, or registered
            # tensors made one after another): one insertion, wherever the gap is. Before, a tensor at a time:
            # caches allocated at falling addresses (as the host allocator hands them out) shifted every span
            # once per tensor (found by review).
            self._starts[k:k] = [span[0] for span in new]
            self._spans[k:k] = new
            return
        self._spans = sorted(self._spans + new)  # two sorted runs: merged in one pass
        self._starts = [span[0] for span in self._spans]

    def remove(self, cache_id: int) -> None:
        """Drop the tensors of cache ``cache_id`` (nothing if it is not indexed)."""
        starts = self._bases.pop(cache_id, None)
        if not starts:
            return
        k, n = bisect.bisect_left(self._starts, min(starts)), len(starts)
        if all(span[2] == cache_id for span in self._spans[k:k + n]) and k + n <= len(self._spans):
            del self._starts[k:k + n]  # its tensors lie together (see add)
            del self._spans[k:k + n]
            return
        self._spans = [span for span in self._spans if span[2] != cache_id]
        self._starts = [span[0] for span in self._spans]

    def clear(self) -> None:
        self._starts.clear()
        self._spans.clear()
        self._bases.clear()

    def overlapping(self, begin: int, nbytes: int) -> int | None:
        """The id of a cache whose memory overlaps ``[begin, begin + nbytes)``, else None: only the last span
        starting before the range's end can."""
        k = bisect.bisect_left(self._starts, begin + nbytes) - 1
        if k >= 0 and self._spans[k][1] > begin:
            return self._spans[k][2]
        return None

    def holding(self, start: int, end: int) -> tuple[int, int] | None:
        """``(cache_id, tensor)`` of the span that holds all of ``[start, end)``, else None."""
        k = bisect.bisect_right(self._starts, start) - 1
        if k >= 0 and end <= self._spans[k][1]:
            return self._spans[k][2], self._spans[k][3]
        return None
