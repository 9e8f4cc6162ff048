"""Same-host push latency with the owner's inline copies on and off: ``python -m benchmarks.inline_push``.

A PROMPT (this process) pushes 1-block (2 MiB) requests into a DECODER peer
over a same-host link. The owner of a push copies the rows out of the
pusher's region (``PUSH_LOCAL``); between blocks of ``--per`` pushes the
peer switches its ``same_host.INLINE_COPY_MAX`` between the default (2 MiB:
its loop's thread copies) and 0 (its copy threads do), in alternating order,
so drift on a shared machine hits both alike. Prints p50 and p99 of each.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

from benchmarks import breakdown as bd
from benchmarks._endpoints import blocks_desc, endpoint_options
from benchmarks._peer import Peer
from benchmarks._workload import KvGeometry

DEFAULT = 2 << 20


def _owner_peer(conn: Connection) -> None:
    asyncio.run(_owner(conn))


async def _owner(conn: Connection) -> None:
    from aio_datadist import BlocksCacheKey, LLMDataDist, LLMRole
    from aio_datadist.transport import same_host

    async with LLMDataDist(LLMRole.DECODER, bd.DECODER_ID) as dd:
        await dd.init(endpoint_options("local", listen=True, timeout_ms=bd.TIMEOUT_MS))
        dd.kv_cache_manager.allocate_blocks_cache(blocks_desc(KvGeometry(), bd.CACHE_BLOCKS),
                                                  BlocksCacheKey(bd.DECODER_ID, 0))
        assert dd.listen_address is not None
        conn.send(dd.listen_address[1])
        loop = asyncio.get_running_loop()
        while (threshold := await loop.run_in_executor(None, conn.recv)) != "exit":
            same_host.INLINE_COPY_MAX = threshold
            conn.send("ok")


async def _pusher(peer: Peer, rounds: int, per: int) -> dict[int, list[float]]:
    from aio_datadist import BlocksCacheKey, LLMClusterInfo, LLMDataDist, LLMRole

    port = await peer.recv_async(120.0)
    took: dict[int, list[float]] = {DEFAULT: [], 0: []}
    async with LLMDataDist(LLMRole.PROMPT, bd.PROMPT_ID) as dd:
        await dd.init(endpoint_options("local", listen=False, timeout_ms=bd.TIMEOUT_MS))
        src = dd.kv_cache_manager.allocate_blocks_cache(blocks_desc(KvGeometry(), bd.CACHE_BLOCKS),
                                                        BlocksCacheKey(bd.PROMPT_ID, 0))
        info = LLMClusterInfo()
        info.remote_cluster_id = bd.DECODER_ID
        info.append_remote_ip_info("127.0.0.1", port)
        await dd.link_clusters([info])
        if dd.stats().links[bd.DECODER_ID].transport != "local":
            raise RuntimeError("the link did not negotiate the same-host transport")
        key, k = BlocksCacheKey(bd.DECODER_ID, 0), 0
        for r in range(rounds + 1):  # round 0 warms up
            for threshold in ((DEFAULT, 0) if r % 2 else (0, DEFAULT)):
                peer.send(threshold)
                await peer.recv_async(30.0)
                for _ in range(per):
                    src_blocks, dst_blocks = bd._lists(k, 1)
                    k += 1
                    t0 = time.perf_counter()
                    await dd.kv_cache_manager.push_blocks(key, src, src_blocks, dst_blocks)
                    if r:
                        took[threshold].append(time.perf_counter() - t0)
        peer.send("exit")
    return took


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.inline_push", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=24, help="alternating rounds after a warm-up (default 24)")
    parser.add_argument("--per", type=int, default=40, help="pushes per setting and round (default 40)")
    args = parser.parse_args(argv)
    with Peer(_owner_peer, timeout=600.0, name="owner") as peer:
        took = asyncio.run(_pusher(peer, args.rounds, args.per))
    print(f"same-host 1-block (2 MiB) pushes, {args.rounds} alternating rounds x {args.per} per setting\n")
    print("| the owner's copy | p50 us | p99 us |\n|---|---:|---:|")
    for threshold, label in ((0, "on its copy threads (INLINE_COPY_MAX 0)"),
                             (DEFAULT, "on its loop's thread (INLINE_COPY_MAX 2 MiB, the default)")):
        values = sorted(took[threshold])
        p99 = values[int(0.99 * (len(values) - 1))]
        print(f"| {label} | {statistics.median(values) * 1e6:.0f} | {p99 * 1e6:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
