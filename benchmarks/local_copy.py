"""Local ``copy_blocks`` throughput against torch and memcpy: ``python -m benchmarks.local_copy [--quick]``.

One blocks cache of the shared geometry (64 tensors, fp16 blocks of
[16, 8, 128] = 32 KiB per block per tensor) and, per request size, random
disjoint source and destination blocks. Measured in the same run:

- ``copy_blocks``: ``await kv.copy_blocks(cache, {src: [dst], ...})`` on the
  library's host copy engine (``aio.CopyThreads`` worker threads).
- torch: per tensor ``t[dst_idx] = t[src_idx]`` (one gather and one scatter
  per tensor, on the same cache tensors, torch's own intra-op threads), and
  ``t.index_copy_(0, dst_idx, t.index_select(0, src_idx))``.
- memcpy: one contiguous ``np.copyto`` of the same total bytes, one thread
  (``benchmarks.baselines.raw_memcpy``).

Ratios are value / baseline (above 1: copy_blocks is faster). After timing,
every destination block is checked to carry the stamp of its source block.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

import torch

from aio_datadist import CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole, Placement
from benchmarks import baselines
from benchmarks.harness import (
    KvGeometry,
    Measurement,
    Table,
    available_memory,
    blocks_label,
    cache_blocks_for,
    format_bytes,
    machine_info,
    peak_rss,
    random_blocks,
    repeats_for,
    run_coroutine,
    stamp_blocks,
    time_async,
    time_sync,
    verify_blocks,
)

SIZES = (4, 64, 512)
COPY_TIMEOUT_MS = 120_000
MEMORY_HEADROOM = 0.8


def _parse_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes must be comma-separated block counts, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--sizes must be block counts >= 1, got {text!r}")
    return counts


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.local_copy", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few repeats (about 30 s on 2 cores)")
    p.add_argument("--sizes", type=_parse_counts, default=SIZES,
                   help=f"blocks per request, comma-separated (default {','.join(map(str, SIZES))})")
    p.add_argument("--copy-threads", type=int, default=None, help="aio.CopyThreads (default: the library's)")
    p.add_argument("--uvloop", action="store_true", help="run the event loop on uvloop")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    return p.parse_args(argv)


def _footprint(count: int, geometry: KvGeometry) -> int:
    """Cache + torch's gathered temporary + the two memcpy buffers."""
    return geometry.request_bytes(cache_blocks_for(count)) + 3 * geometry.request_bytes(count)


async def _measure_case(kv: Any, geometry: KvGeometry, count: int, quick: bool, seed: int) -> dict[str, Measurement]:
    num_blocks = cache_blocks_for(count)
    desc = CacheDesc(geometry.num_tensors, geometry.tensor_shape(num_blocks), DataType.DT_FLOAT16, Placement.DEVICE)
    cache = kv.allocate_blocks_cache(desc)
    try:
        tensors = cache.tensors
        stamp_blocks(tensors)
        blocks = random_blocks(num_blocks, 2 * count, seed)
        src, dst = blocks[:count], blocks[count:]
        info = {s: [d] for s, d in zip(src, dst)}
        src_idx = torch.tensor(src, dtype=torch.int64)
        dst_idx = torch.tensor(dst, dtype=torch.int64)
        nbytes = geometry.request_bytes(count)
        repeats = repeats_for(nbytes, quick=quick)

        def index_put() -> None:
            for t in tensors:
                t[dst_idx] = t[src_idx]

        def index_copy() -> None:
            for t in tensors:
                t.index_copy_(0, dst_idx, t.index_select(0, src_idx))

        out = {}
        samples = await time_async(lambda: kv.copy_blocks(cache, info, timeout=COPY_TIMEOUT_MS), repeats=repeats)
        out["copy_blocks"] = Measurement("copy_blocks", nbytes, tuple(samples))
        if not verify_blocks(tensors, dst, src):
            raise AssertionError(f"copy_blocks put wrong bytes in place at {count} blocks")
        out["index_put"] = Measurement("index_put", nbytes, tuple(time_sync(index_put, repeats=repeats)))
        out["index_copy"] = Measurement("index_copy", nbytes, tuple(time_sync(index_copy, repeats=repeats)))
        if not verify_blocks(tensors, dst, src):
            raise AssertionError(f"the torch baselines put wrong bytes in place at {count} blocks")
        return out
    finally:
        kv.deallocate_cache(cache)


async def _measure_library(counts: Sequence[int], geometry: KvGeometry, quick: bool,
                           copy_threads: int | None) -> tuple[dict[int, dict[str, Measurement]], int]:
    cfg = LLMConfig()
    if copy_threads is not None:
        cfg.copy_threads = copy_threads
    results = {}
    async with LLMDataDist(LLMRole.DECODER, 1) as dd:
        await dd.init(cfg.generate_options())
        threads = dd._runtime.copier.threads
        for i, count in enumerate(counts):
            results[count] = await _measure_case(dd.kv_cache_manager, geometry, count, quick, seed=i)
    return results, threads


def measure(table: Table, counts: Sequence[int], *, quick: bool, copy_threads: int | None = None,
            use_uvloop: bool = False, geometry: KvGeometry | None = None) -> None:
    """Add one row per size and baseline to ``table``."""
    geometry = geometry or KvGeometry()
    budget = int(available_memory() * MEMORY_HEADROOM)
    fitting = []
    for count in counts:
        if _footprint(count, geometry) <= budget:
            fitting.append(count)
        else:
            table.note(f"skipped {count} blocks: needs {format_bytes(_footprint(count, geometry))}, "
                       f"{format_bytes(budget)} usable")
    if not fitting:
        return
    library, threads = run_coroutine(lambda: _measure_library(fitting, geometry, quick, copy_threads),
                                     use_uvloop=use_uvloop)
    request = {c: geometry.request_bytes(c) for c in fitting}
    memcpy = baselines.raw_memcpy_sizes({request[c]: repeats_for(request[c], quick=quick) for c in fitting})
    for count in fitting:
        case = blocks_label(count, geometry)
        m = library[count]
        ours = m["copy_blocks"].gbps
        table.add("copy_blocks", case, ours, "GB/s", baseline="torch t[dst]=t[src]",
                  baseline_value=m["index_put"].gbps)
        table.add("copy_blocks", case, ours, "GB/s", baseline="torch index_copy_",
                  baseline_value=m["index_copy"].gbps)
        table.add("copy_blocks", case, ours, "GB/s", baseline="memcpy 1 thread",
                  baseline_value=memcpy[request[count]].gbps)
        table.add("copy_blocks p99", case, m["copy_blocks"].p99_us / 1000, "ms")
    table.note(f"copy_blocks: {threads} copy thread(s) (aio.CopyThreads), "
               f"{'uvloop' if use_uvloop else 'asyncio'} loop; torch intra-op threads: {torch.get_num_threads()}")
    table.note(f"one block of one tensor is {format_bytes(geometry.block_bytes)}; a request of B blocks moves "
               f"B x {geometry.num_tensors} blocks; cache = max(64, 2B) blocks; source and destination blocks "
               "random, disjoint")
    table.note("memcpy copies one contiguous buffer of the same size: sizes that fit the CPU caches run from them")
    table.note(str(peak_rss()))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    mode = "quick" if args.quick else "default"
    table = Table(f"aio_datadist local copy_blocks ({mode}; GB = 1e9 B; value = median)", machine=machine_info())
    measure(table, args.sizes, quick=args.quick, copy_threads=args.copy_threads, use_uvloop=args.uvloop)
    if args.format == "markdown":
        print(table.render_markdown())
    elif args.format == "json":
        print(table.to_json())
    else:
        table.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
