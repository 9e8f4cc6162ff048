"""The shared benchmark harness: import everything a benchmark program needs from here.

Benchmarks are programs, not tests (STYLE rule 10). A benchmark program
measures its baselines in the same run (``benchmarks.baselines``), adds one row
per case to a :class:`Table` with the ratio against the baseline, and prints it.

The pieces live in small modules, one concern each:

- ``_timing``: :func:`time_sync`, :func:`time_async`, :func:`summarize`,
  :func:`gbps`, :class:`Measurement`, :func:`repeats_for`, :func:`run_coroutine`
- ``_table``: :class:`Table`, :class:`Row`, :func:`parse_target`
- ``_workload``: :class:`KvGeometry`, :func:`random_blocks`, :func:`stamp_blocks`,
  :func:`verify_blocks`, :func:`aligned_empty`, sizes and labels
- ``_machine``: :func:`machine_info`, :func:`peak_rss`, :func:`available_memory`,
  :class:`OtherCpuLoad`
- ``_peer``: :class:`Peer`, :func:`run_in_subprocess`, :func:`free_port`
- ``_endpoints``: :func:`endpoint_options`, :func:`blocks_desc`, :func:`block_lists` for
  programs that run endpoints
- ``_cli``: the flags every program shares (:func:`add_common_arguments`,
  :func:`block_counts`), :func:`fits_in_memory`, :func:`emit`, :class:`Progress`

None of them imports torch or the library at import time, so spawned peer
processes that only need sockets start quickly.
"""

from __future__ import annotations

from benchmarks._cli import (
    MEMORY_HEADROOM,
    Progress,
    add_common_arguments,
    block_counts,
    emit,
    fits_in_memory,
    mode_label,
    parse_block_counts,
)
from benchmarks._endpoints import block_lists, blocks_desc, endpoint_options
from benchmarks._machine import OtherCpuLoad, PeakRss, available_memory, machine_info, machine_info_dict, peak_rss
from benchmarks._peer import Peer, PeerError, free_port, run_in_subprocess
from benchmarks._table import Row, Table, parse_target
from benchmarks._timing import (
    Measurement,
    Summary,
    gbps,
    percentile,
    repeats_for,
    run_coroutine,
    summarize,
    time_async,
    time_sync,
)
from benchmarks._workload import (
    BLOCK_COUNTS,
    FULL_BLOCK_COUNTS,
    GIB,
    KIB,
    MIB,
    KvGeometry,
    aligned_empty,
    blocks_label,
    cache_blocks_for,
    format_bytes,
    random_blocks,
    stamp_blocks,
    verify_blocks,
)

__all__ = [
    "BLOCK_COUNTS",
    "MEMORY_HEADROOM",
    "Progress",
    "add_common_arguments",
    "block_counts",
    "block_lists",
    "blocks_desc",
    "endpoint_options",
    "emit",
    "fits_in_memory",
    "mode_label",
    "parse_block_counts",
    "FULL_BLOCK_COUNTS",
    "GIB",
    "KIB",
    "MIB",
    "KvGeometry",
    "Measurement",
    "OtherCpuLoad",
    "PeakRss",
    "Peer",
    "PeerError",
    "Row",
    "Summary",
    "Table",
    "aligned_empty",
    "available_memory",
    "blocks_label",
    "cache_blocks_for",
    "format_bytes",
    "free_port",
    "gbps",
    "machine_info",
    "machine_info_dict",
    "parse_target",
    "peak_rss",
    "percentile",
    "random_blocks",
    "repeats_for",
    "run_coroutine",
    "run_in_subprocess",
    "stamp_blocks",
    "summarize",
    "time_async",
    "time_sync",
    "verify_blocks",
]
