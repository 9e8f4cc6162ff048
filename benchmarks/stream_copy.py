"""The host copy with streaming stores against an ordinary one: ``python -m benchmarks.stream_copy [--rounds 5]``.

The core writes a host copy of ``_core.stream_copy_min`` bytes or more (a
``copy_now`` list, a copy engine job) with streaming stores that bypass the CPU
caches (``aio_datadist/_stream_copy.pxd``). This program times
``_core.copy_now`` on the calling thread, the way a same-host pull copies, with
the threshold at 0 (every copy streams) and off (every copy is ``memcpy``), in
alternating stretches of each round, for lists shaped like a pull's (one run of
32 KiB per tensor and block; 4 MiB runs for 128 MiB), in two cases:

- ``hot``: the same source and destination every time, so both stay in the
  CPU caches as far as they fit (the suite's latency rows pull this way);
- ``cold``: source and destination move along two 512 MiB buffers, so every
  copy reads and writes memory the CPU has not touched for a while (a prefill
  wrote the KV long before a decoder pulls it, into blocks it has not used).

It prints the median time per copy of each and the ratio streaming / memcpy
(below 1: streaming is faster), and the threshold the library uses.
"""

from __future__ import annotations

import argparse
import array
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from aio_datadist import _core

SPAN = 512 << 20
OFF = 2 ** 64 - 1
#: (bytes per copy, bytes per run, copies per stretch)
SHAPES = ((64 << 10, 32 << 10, 400), (256 << 10, 32 << 10, 300), (1 << 20, 32 << 10, 200),
          (2 << 20, 32 << 10, 150), (8 << 20, 128 << 10, 40), (128 << 20, 4 << 20, 3))


def _lists(src: int, dst: int, size: int, run: int, count: int, cold: bool) -> list[array.array]:
    out = []
    for k in range(count):
        s = (k * size) % (SPAN - size) if cold else 0
        d = ((k + 97) * size) % (SPAN - size) if cold else 0
        triples = array.array("Q")
        for i in range(0, size, run):
            triples.extend((dst + d + i, src + s + i, run))
        out.append(triples)
    return out


def _stretch(lists: Sequence[array.array], threshold: int) -> list[float]:
    _core.set_stream_copy_min(threshold)
    samples = []
    for triples in lists:
        t0 = time.perf_counter_ns()
        _core.copy_now(triples)
        samples.append((time.perf_counter_ns() - t0) / 1e3)
        sum(range(2000))  # some Python between copies, as a loop runs between pulls
    return samples


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stream_copy", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per case (default 5)")
    args = parser.parse_args(argv)
    default = _core.stream_copy_min()
    src = torch.randint(0, 256, (SPAN,), dtype=torch.uint8)
    dst = torch.zeros(SPAN, dtype=torch.uint8)
    print("# Host copies on the calling thread: streaming stores against memcpy (median us per copy)\n")
    print("| bytes | run | case | memcpy us | streaming us | streaming / memcpy |\n|---:|---:|---|---:|---:|---:|")
    try:
        for size, run, count in SHAPES:
            for cold in (False, True):
                lists = _lists(src.data_ptr(), dst.data_ptr(), size, run, count, cold)
                plain: list[float] = []
                streaming: list[float] = []
                for r in range(args.rounds):
                    order = ((OFF, plain), (0, streaming)) if r % 2 == 0 else ((0, streaming), (OFF, plain))
                    for threshold, into in order:
                        into.extend(_stretch(lists, threshold))
                p, s = statistics.median(plain), statistics.median(streaming)
                print(f"| {size >> 10} KiB | {run >> 10} KiB | {'cold' if cold else 'hot'} | {p:.1f} | {s:.1f} | "
                      f"{s / p:.2f} |")
    finally:
        _core.set_stream_copy_min(default)
    print(f"\nThe library streams copies from {default} bytes on (`_core.stream_copy_min()`, "
          "`$AIO_DATADIST_STREAM_COPY_MIN`).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
