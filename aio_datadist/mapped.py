"""Proof that raw addresses name memory this process may read and write.

Serving frameworks register KV memory they own by integer address
(``register_cache(desc, [addr, ...])``, as vllm-ascend and MindIE do). A bare
int is never trusted: before a cache is built on it, every
``[addr, addr + nbytes)`` range must lie in mappings of this process that are
readable and writable, one after another without a gap, as
``/proc/self/maps`` lists them at that moment. The stack and the kernel's
special mappings (``[vvar]``, ``[vdso]``, ``[vsyscall]``) never count.

What this cannot prove is that the memory stays the caller's: freeing it
while it is registered remains the caller's error, as it is in LLM-DataDist.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from aio_datadist._checks import param_invalid

__all__ = ["check_mapped", "writable_spans"]

MAPS = "/proc/self/maps"
_SPECIAL = ("[stack]", "[vvar]", "[vdso]", "[vsyscall]", "[vvar_vclock]")


def writable_spans(maps_text: str) -> list[tuple[int, int]]:
    """Readable and writable ``(start, end)`` spans of a ``/proc/<pid>/maps`` text, sorted, adjacent
    mappings merged."""
    spans: list[tuple[int, int]] = []
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 5 or not fields[1].startswith("rw"):
            continue
        if len(fields) == 6 and fields[5].strip().startswith(_SPECIAL):
            continue
        lo, _, hi = fields[0].partition("-")
        start, end = int(lo, 16), int(hi, 16)
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    spans.sort()
    return spans


def check_mapped(arg_name: str, ranges: Sequence[tuple[int, int]], *, maps_text: str | None = None) -> None:
    """Raise unless every ``(addr, nbytes)`` of ``ranges`` lies in this process's writable memory.

    :param arg_name: the argument the addresses came from, for the message.
    :param maps_text: a ``/proc/self/maps`` text to check against (tests); read now if None.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg_name`` and the
        first address whose range is not (or not wholly) mapped readable and
        writable.
    """
    if maps_text is None:
        with open(MAPS, encoding="ascii", errors="replace") as maps:
            maps_text = maps.read()
    spans = writable_spans(maps_text)
    starts = [start for start, _ in spans]
    for index, (addr, nbytes) in enumerate(ranges):
        k = bisect.bisect_right(starts, addr) - 1
        if k < 0 or spans[k][1] <= addr:
            raise param_invalid(arg_name, f"address {index} ({addr:#x}) is not in memory this process may "
                                "read and write (see /proc/self/maps)")
        if addr + nbytes > spans[k][1]:
            raise param_invalid(arg_name, f"address {index} ({addr:#x}): {nbytes} bytes from there run past the "
                                f"end of its mapping at {spans[k][1]:#x}")
