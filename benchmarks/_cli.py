"""What every benchmark program's command line shares: flags, sizes, memory checks, output."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from benchmarks._machine import available_memory
from benchmarks._table import Table
from benchmarks._workload import BLOCK_COUNTS, FULL_BLOCK_COUNTS, format_bytes

#: Share of MemAvailable one case may use.
MEMORY_HEADROOM = 0.8


def parse_block_counts(text: str) -> tuple[int, ...]:
    """``"1,4,64"`` -> ``(1, 4, 64)``; an argparse ``type=``.

    Raises:
        argparse.ArgumentTypeError: not comma-separated integers >= 1.
    """
    try:
        counts = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes must be comma-separated block counts, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--sizes must be block counts >= 1, got {text!r}")
    return counts


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """``--quick`` | ``--full``, ``--sizes``, ``--format``, ``--verbose``."""
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="few repeats (under 30 s)")
    mode.add_argument("--full", action="store_true", help="also 4096 blocks (8 GiB requests), more repeats")
    parser.add_argument("--sizes", type=parse_block_counts, help="block counts, e.g. 1,4,64 (overrides the defaults)")
    parser.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    parser.add_argument("--verbose", action="store_true", help="section timings on stderr")


def block_counts(args: argparse.Namespace, default: Sequence[int] = BLOCK_COUNTS) -> tuple[int, ...]:
    """``--sizes`` if given, else ``FULL_BLOCK_COUNTS`` with ``--full``, else ``default``."""
    if args.sizes:
        return tuple(args.sizes)
    return FULL_BLOCK_COUNTS if args.full else tuple(default)


def mode_label(args: argparse.Namespace) -> str:
    return "quick" if args.quick else ("full" if args.full else "default")


def fits_in_memory(table: Table, what: str, count: int, need_bytes: int) -> bool:
    """True when ``need_bytes`` fits in MemAvailable x :data:`MEMORY_HEADROOM`; else notes the skip in ``table``."""
    budget = int(available_memory() * MEMORY_HEADROOM)
    if need_bytes <= budget:
        return True
    table.note(f"skipped {what} at {count} blocks: needs {format_bytes(need_bytes)}, {format_bytes(budget)} usable")
    return False


def emit(table: Table, fmt: str) -> None:
    """Print ``table`` as ``text``, ``markdown`` or ``json``."""
    if fmt == "markdown":
        print(table.render_markdown(), flush=True)
    elif fmt == "json":
        print(table.to_json(), flush=True)
    elif fmt == "text":
        table.print()
    else:
        raise ValueError(f"fmt must be 'text', 'markdown' or 'json', got {fmt!r}")


class Progress:
    """Section timings on stderr when enabled (``--verbose``), so long runs show where they are."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.start = self.last = time.perf_counter()

    def __call__(self, what: str) -> None:
        now = time.perf_counter()
        if self.enabled:
            print(f"[{now - self.start:6.1f}s] {what} ({now - self.last:.1f}s)", file=sys.stderr, flush=True)
        self.last = now
