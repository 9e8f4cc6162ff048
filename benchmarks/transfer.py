"""pull_blocks and push_blocks between two processes: ``python -m benchmarks.transfer [--quick]``.

Two endpoints on 127.0.0.1, each in its own process, each with a blocks
cache of the shared geometry (64 tensors, fp16 blocks of [16, 8, 128] =
32 KiB per block per tensor; ``cache_blocks_for(64)`` blocks). Per request
size (64 blocks = 128 MiB, 4 blocks = 8 MiB over all tensors), with random
distinct source and destination blocks:

- ``pull_blocks``: this process (DECODER) pulls from the spawned PROMPT,
  timed here from the call to its return.
- ``push_blocks``: the spawned PROMPT pushes into this process's cache
  (``CacheIndex``), timed there from the call until the receiver confirmed.
- baseline, same bytes, same machine, same run: a spawned peer ``sendall``s
  one contiguous buffer and this process ``recv_into``s it (one loopback TCP
  connection, OS socket buffers, as the library's data channels use), timed
  from the 32-byte request to the last byte (``benchmarks.baselines``).

Rows give GB/s at the median sample and p50 latency; ratios are against the
baseline (above 1: faster). After timing, every destination block is checked
to carry the stamp of its source block.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any, Sequence

from benchmarks import baselines
from benchmarks._cli import Progress, emit, fits_in_memory
from benchmarks.harness import (
    block_lists,
    blocks_desc,
    endpoint_options,
    KvGeometry,
    Measurement,
    Peer,
    Table,
    blocks_label,
    cache_blocks_for,
    format_bytes,
    machine_info,
    peak_rss,
    repeats_for,
    run_coroutine,
    time_async,
)

SIZES = (64, 4)
TARGET = {64: ">= 0.8x"}  # pull_blocks of the 128 MiB request against the raw socket
PROMPT_ID, DECODER_ID = 1, 2
TRANSFER_TIMEOUT_MS = 60_000
PEER_LIFETIME_S = 600.0
SEED = 7
ROUNDS, ROUNDS_QUICK = 6, 3


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.transfer", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few repeats (about 30 s on 2 cores)")
    p.add_argument("--sizes", type=_counts, default=SIZES,
                   help=f"blocks per request, comma-separated (default {','.join(map(str, SIZES))})")
    p.add_argument("--uvloop", action="store_true", help="both processes run their event loop on uvloop")
    p.add_argument("--data-channels", type=int, default=None, help="aio.DataChannels (default: the library's)")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    p.add_argument("--verbose", action="store_true", help="section timings on stderr")
    return p.parse_args(argv)


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes must be comma-separated block counts, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--sizes must be block counts >= 1, got {text!r}")
    return counts





# -- the PROMPT process ------------------------------------------------------------------


def _prompt_peer(conn: Any, geometry: KvGeometry, cache_blocks: int, data_channels: int | None,
                 use_uvloop: bool) -> None:
    run_coroutine(lambda: _prompt_main(conn, geometry, cache_blocks, data_channels), use_uvloop=use_uvloop)


async def _prompt_main(conn: Any, geometry: KvGeometry, cache_blocks: int, data_channels: int | None) -> None:
    from aio_datadist import BlocksCacheKey, CacheIndex, LLMDataDist, LLMRole

    from benchmarks.harness import stamp_blocks

    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as dd:
        await dd.init(endpoint_options("tcp", listen=True, timeout_ms=TRANSFER_TIMEOUT_MS, data_channels=data_channels))
        kv = dd.kv_cache_manager
        cache = kv.allocate_blocks_cache(blocks_desc(geometry, cache_blocks), BlocksCacheKey(PROMPT_ID))
        stamp_blocks(cache.tensors)
        conn.send(dd.listen_address[1])
        loop = asyncio.get_running_loop()
        while True:
            readable = loop.create_future()
            loop.add_reader(conn.fileno(), lambda: readable.done() or readable.set_result(None))
            try:
                await readable
            finally:
                loop.remove_reader(conn.fileno())
            os.set_blocking(conn.fileno(), True)  # uvloop's add_reader makes it non-blocking
            command = conn.recv()
            if command[0] == "exit":
                return
            _, count, repeats, warmup, dst_cache_id = command
            src_blocks, dst_blocks = block_lists(cache_blocks, count, SEED)
            target = CacheIndex(DECODER_ID, dst_cache_id)
            samples = await time_async(
                lambda: kv.push_blocks(target, cache, src_blocks, dst_blocks, timeout=TRANSFER_TIMEOUT_MS),
                repeats=repeats, warmup=warmup)
            conn.send(samples)


# -- this process: the DECODER -------------------------------------------------------------


async def _measure(geometry: KvGeometry, counts: Sequence[int], quick: bool, data_channels: int | None,
                   use_uvloop: bool, progress: Progress) -> dict[tuple[str, int], Measurement]:
    """Samples of the raw socket, pull_blocks and push_blocks, taken in alternating rounds.

    On a small shared machine the load drifts; alternating the three cases
    round by round makes the drift hit them alike.
    """
    from aio_datadist import BlocksCacheKey, LLMClusterInfo, LLMDataDist, LLMRole, LLMStatusCode

    from benchmarks.harness import verify_blocks

    cache_blocks = cache_blocks_for(max(counts))
    rounds = ROUNDS_QUICK if quick else ROUNDS
    samples: dict[tuple[str, int], list[float]] = {}
    raw_bytes = max(geometry.request_bytes(c) for c in counts)
    with Peer(_prompt_peer, geometry, cache_blocks, data_channels, use_uvloop,
              timeout=PEER_LIFETIME_S, name="prompt") as peer, baselines.TcpReplyPeer(raw_bytes) as raw:
        async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
            await dd.init(endpoint_options("tcp", listen=False, timeout_ms=TRANSFER_TIMEOUT_MS, data_channels=data_channels))
            kv = dd.kv_cache_manager
            cache = kv.allocate_blocks_cache(blocks_desc(geometry, cache_blocks))
            port = await asyncio.to_thread(peer.recv, 120.0)
            info = LLMClusterInfo()
            info.remote_cluster_id = PROMPT_ID
            info.append_remote_ip_info("127.0.0.1", port)
            status, _ = await dd.link_clusters([info])
            if status != LLMStatusCode.LLM_SUCCESS:
                raise RuntimeError(f"link_clusters failed: {status!r}")
            progress("linked")
            key = BlocksCacheKey(PROMPT_ID)
            for count in counts:
                nbytes = geometry.request_bytes(count)
                per_round = max(2, repeats_for(nbytes, quick=quick, min_repeats=10 if quick else 30) // rounds)
                src_blocks, dst_blocks = block_lists(cache_blocks, count, SEED)
                for name in ("raw socket", "pull_blocks", "push_blocks"):
                    samples[name, count] = []
                for round_index in range(rounds):
                    warmup = 2 if round_index == 0 else 1
                    samples["raw socket", count] += raw.throughput(nbytes, per_round, warmup=warmup).samples
                    for t in cache.tensors:
                        t.zero_()
                    samples["pull_blocks", count] += await time_async(
                        lambda: kv.pull_blocks(key, cache, src_blocks, dst_blocks, timeout=TRANSFER_TIMEOUT_MS),
                        repeats=per_round, warmup=warmup)
                    if not verify_blocks(cache.tensors, dst_blocks, src_blocks):
                        raise RuntimeError(f"pull_blocks of {count} blocks put wrong bytes in place")
                    for t in cache.tensors:
                        t.zero_()
                    peer.send(("push", count, per_round, warmup, cache.cache_id))
                    samples["push_blocks", count] += await asyncio.to_thread(peer.recv, 300.0)
                    if not verify_blocks(cache.tensors, dst_blocks, src_blocks):
                        raise RuntimeError(f"push_blocks of {count} blocks put wrong bytes in place")
                progress(f"{count} blocks")
            peer.send(("exit",))
            peer.result(60.0)
    return {k: Measurement(k[0], geometry.request_bytes(k[1]), tuple(v)) for k, v in samples.items()}


def _footprint(geometry: KvGeometry, counts: Sequence[int]) -> int:
    """Two caches, and the raw baseline's two buffers."""
    return 2 * geometry.request_bytes(cache_blocks_for(max(counts))) + 2 * geometry.request_bytes(max(counts))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    geometry = KvGeometry()
    counts = tuple(args.sizes)
    progress = Progress(args.verbose)
    loop_name = "uvloop" if args.uvloop else "asyncio"
    rounds = ROUNDS_QUICK if args.quick else ROUNDS
    table = Table(f"aio_datadist transfers between two processes ({'quick' if args.quick else 'default'}; "
                  f"{loop_name}; GB = 1e9 B; value = median)", machine=machine_info())
    if not fits_in_memory(table, "transfer", max(counts), _footprint(geometry, counts)):
        emit(table, args.format)
        return 1
    measured = run_coroutine(
        lambda: _measure(geometry, counts, args.quick, args.data_channels, args.uvloop, progress),
        use_uvloop=args.uvloop)
    for count in counts:
        case = blocks_label(count, geometry)
        base = measured["raw socket", count]
        table.add("raw socket sendall/recv_into", case, base.gbps, "GB/s")
        for name in ("pull_blocks", "push_blocks"):
            m = measured[name, count]
            target = TARGET.get(count) if name == "pull_blocks" else None
            table.add(name, case, m.gbps, "GB/s", baseline="raw socket", baseline_value=base.gbps, target=target)
        table.add("raw socket p50 latency", case, base.p50_us / 1e3, "ms")
        for name in ("pull_blocks", "push_blocks"):
            m = measured[name, count]
            table.add(f"{name} p50 latency", case, m.p50_us / 1e3, "ms", baseline="raw socket",
                      baseline_value=base.p50_us / 1e3)
    table.note(f"cache {cache_blocks_for(max(counts))} blocks x {geometry.num_tensors} tensors x "
               f"{format_bytes(geometry.block_bytes)} per process; random distinct source and destination blocks")
    table.note(f"{rounds} alternating rounds of raw socket, pull_blocks and push_blocks per size, "
               f"{measured['raw socket', counts[0]].summary.n} samples each at {counts[0]} blocks; "
               "OS socket buffers everywhere")
    table.note("latency ratios are library / raw: above 1 is slower")
    table.note(str(peak_rss()))
    emit(table, args.format)
    return 0


if __name__ == "__main__":
    sys.exit(main())
