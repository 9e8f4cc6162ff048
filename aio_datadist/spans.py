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
        # Where each goes among the others; those of one gap go in with one insertion, the last gap first (so the
        # places found stay right). A cache allocated in one region, or of tensors made one after another, is one
        # insertion; one interleaved with others, one per gap. Before, a tensor at a time: caches allocated at
        # falling addresses (as the host allocator hands them out) shifted every span once per tensor, and a
        # re-sort of the whole index for interleaved ones cost 21 ms per cache at 384,000 spans (found by review).
        places = [bisect.bisect_left(self._starts, span[0]) for span in new]
        end = len(new)
        while end:
            begin = end - 1
            while begin and places[begin - 1] == places[end - 1]:
                begin -= 1
            k = places[end - 1]
            self._starts[k:k] = [span[0] for span in new[begin:end]]
            self._spans[k:k] = new[begin:end]
            end = begin

    def remove(self, cache_id: int) -> None:
        """Drop the tensors of cache ``cache_id`` (nothing if it is not indexed): one deletion per run of them."""
        starts = self._bases.pop(cache_id, None)
        if not starts:
            return
        places = []
        for base in sorted(set(starts)):
            k = bisect.bisect_left(self._starts, base)
            while k < len(self._spans) and self._starts[k] == base:  # (zero-length tensors may share a start)
                if self._spans[k][2] == cache_id:
                    places.append(k)
                k += 1
        places.sort()
        end = len(places)
        while end:
            begin = end - 1
            while begin and places[begin - 1] == places[begin] - 1:
                begin -= 1
            del self._starts[places[begin]:places[end - 1] + 1]
            del self._spans[places[begin]:places[end - 1] + 1]
            end = begin

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
