"""Timing: run a callable or coroutine function N times, summarize, convert to GB/s."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator, Sequence

from benchmarks._workload import GIB


def time_sync(
    fn: Callable[[], object], *, repeats: int, warmup: int = 1, disable_gc: bool = True
) -> list[float]:
    """Call ``fn()`` ``warmup`` times untimed, then ``repeats`` times timed.

    Returns:
        One wall-clock sample per timed call, in seconds (``time.perf_counter``).
    Raises:
        ValueError: ``repeats`` < 1 or ``warmup`` < 0.
    """
    _check_counts(repeats, warmup)
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    with _gc_paused(disable_gc):
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return samples


async def time_async(
    fn: Callable[[], Awaitable[object]],
    *,
    repeats: int,
    warmup: int = 1,
    disable_gc: bool = True,
) -> list[float]:
    """Await ``fn()`` ``warmup`` times untimed, then ``repeats`` times timed.

    ``fn`` is a coroutine function (or any callable returning an awaitable); a
    fresh awaitable is made per call.

    Returns:
        One wall-clock sample per timed await, in seconds.
    Raises:
        ValueError: ``repeats`` < 1 or ``warmup`` < 0.
    """
    _check_counts(repeats, warmup)
    for _ in range(warmup):
        await fn()
    samples: list[float] = []
    with _gc_paused(disable_gc):
        for _ in range(repeats):
            t0 = time.perf_counter()
            await fn()
            samples.append(time.perf_counter() - t0)
    return samples


def _check_counts(repeats: int, warmup: int) -> None:
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup!r}")


@contextlib.contextmanager
def _gc_paused(pause: bool) -> Iterator[None]:
    was_enabled = gc.isenabled()
    if pause:
        gc.disable()
    try:
        yield
    finally:
        if pause and was_enabled:
            gc.enable()


@dataclass(frozen=True)
class Summary:
    """Order statistics of a list of samples (same unit as the samples)."""

    n: int
    median: float
    p50: float
    p99: float
    min: float
    max: float
    mean: float


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear interpolation (numpy's default)."""
    if not samples:
        raise ValueError("samples must not be empty")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be within [0, 100], got {q!r}")
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(samples: Sequence[float]) -> Summary:
    """Median, p50, p99, min, max and mean of ``samples``.

    Raises:
        ValueError: ``samples`` is empty.
    """
    if not samples:
        raise ValueError("samples must not be empty")
    median = statistics.median(samples)
    return Summary(
        n=len(samples),
        median=median,
        p50=percentile(samples, 50.0),
        p99=percentile(samples, 99.0),
        min=min(samples),
        max=max(samples),
        mean=statistics.fmean(samples),
    )


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (1 GB = 1e9 bytes)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    return nbytes / seconds / 1e9


@dataclass(frozen=True)
class Measurement:
    """Samples (seconds) of one benchmark case that moved ``nbytes`` per sample."""

    name: str
    nbytes: int
    samples: tuple[float, ...]
    note: str = ""

    @property
    def summary(self) -> Summary:
        return summarize(self.samples)

    @property
    def gbps(self) -> float:
        """GB/s at the median sample."""
        return gbps(self.nbytes, self.summary.median)

    @property
    def best_gbps(self) -> float:
        """GB/s at the fastest sample."""
        return gbps(self.nbytes, self.summary.min)

    @property
    def p50_us(self) -> float:
        return self.summary.p50 * 1e6

    @property
    def p99_us(self) -> float:
        return self.summary.p99 * 1e6


def repeats_for(
    nbytes: int,
    *,
    quick: bool,
    budget_bytes: int | None = None,
    min_repeats: int | None = None,
    max_repeats: int | None = None,
) -> int:
    """How many timed repeats to run for a case moving ``nbytes`` per repeat.

    Keeps the bytes moved per case near a budget (512 MiB quick, 8 GiB
    otherwise), bounded to [3, 20] repeats quick and [5, 200] otherwise.
    """
    budget = budget_bytes if budget_bytes is not None else (GIB // 2 if quick else 8 * GIB)
    lo = min_repeats if min_repeats is not None else (3 if quick else 5)
    hi = max_repeats if max_repeats is not None else (20 if quick else 200)
    return max(lo, min(hi, budget // max(nbytes, 1)))


def run_coroutine(coro_fn: Callable[[], Awaitable[Any]], *, use_uvloop: bool = False) -> Any:
    """Run ``coro_fn()`` to completion on a fresh event loop (asyncio, or uvloop)."""
    if use_uvloop:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro_fn())
    with asyncio.Runner() as runner:
        return runner.run(coro_fn())
