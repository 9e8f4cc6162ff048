"""Stage timestamps of transfers, for ``python -m benchmarks.breakdown`` (off unless ``AIO_DATADIST_TRACE=1``).

Each mark is ``(perf_counter_ns, stage)`` appended to :data:`marks` in this
process; ``perf_counter`` reads CLOCK_MONOTONIC on Linux, so marks of two
processes on one host line up. With ``AIO_DATADIST_TRACE_CLOCK=cpu`` a mark
holds the calling thread's CPU time instead (user + system, ``thread_time``):
the difference of two marks of one thread is the CPU it spent between them
(``benchmarks.breakdown --cpu``); marks of two threads do not line up then.
Call sites test :data:`ON` first, so a mark costs one attribute read when
tracing is off.
"""

from __future__ import annotations

import os
import time

__all__ = ["CLOCK", "ON", "mark", "marks", "take"]

#: Whether marks are taken (read once, at import).
ON = os.environ.get("AIO_DATADIST_TRACE") == "1"
#: The marks taken so far, oldest first.
marks: list[tuple[int, str]] = []
#: What a mark reads: ``"wall"`` (CLOCK_MONOTONIC) or ``"cpu"`` (the calling thread's CPU time).
CLOCK = "cpu" if os.environ.get("AIO_DATADIST_TRACE_CLOCK") == "cpu" else "wall"
_now = time.thread_time_ns if CLOCK == "cpu" else time.perf_counter_ns


def mark(stage: str) -> None:
    """Note that a transfer reached ``stage`` now."""
    marks.append((_now(), stage))


def take() -> list[tuple[int, str]]:
    """The marks so far, and forget them."""
    taken = marks[:]
    marks.clear()
    return taken
