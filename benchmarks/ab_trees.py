"""Two (or more) versions of the library side by side: ``python -m benchmarks.ab_trees TREE[=ENV],TREE... [options]``.

Each TREE is a checkout of the repository with its core built in place
(``python setup.py build_ext --inplace``); ``TREE=NAME:VALUE`` also sets one
environment variable for that side (the same tree twice with another
setting, e.g. ``.=AIO_DATADIST_LOOP_IO_MAX:0,.``). For every side, a worker
process with ``PYTHONPATH=TREE`` links a DECODER to a PROMPT peer of the same
tree (``benchmarks.breakdown``'s peer) and waits. The program then asks the
sides in turn, in a rotating order, for a block of ``--per`` pulls, and
measures a block of raw TCP round trips of the same bytes after each turn,
for ``--rounds`` rounds (the first is warm-up). Every side is alive for the
whole run and the blocks are short, so load that comes and goes on a shared
machine hits all sides alike: on this project's 2-core VM that is the only
way differences of 5-10% stand out (separate runs move by 20-30%).

Prints p50 and p99 per side and against the raw round trip. With
``--concurrent N`` every sample is a batch of N concurrent 1-block pulls of
distinct blocks (the suite's 64-concurrent row), and the table gives
transfers per second (N / median batch time) against raw round trips one
after another.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.baselines import TcpReplyPeer
from benchmarks.breakdown import CACHE_BLOCKS
from benchmarks._workload import KvGeometry

WORKER = """
import asyncio, sys, time
from benchmarks import breakdown as bd
from benchmarks._endpoints import blocks_desc, endpoint_options
from benchmarks._peer import Peer
from benchmarks._workload import KvGeometry

async def main(peer, transport, blocks, hot, concurrent):
    from aio_datadist import BlocksCacheKey, LLMClusterInfo, LLMDataDist, LLMRole
    port = await peer.recv_async(120.0)
    async with LLMDataDist(LLMRole.DECODER, bd.DECODER_ID) as dd:
        await dd.init(endpoint_options(transport, listen=False, timeout_ms=bd.TIMEOUT_MS))
        cache = dd.kv_cache_manager.allocate_blocks_cache(blocks_desc(KvGeometry(), bd.CACHE_BLOCKS))
        info = LLMClusterInfo()
        info.remote_cluster_id = bd.PROMPT_ID
        info.append_remote_ip_info("127.0.0.1", port)
        await dd.link_clusters([info])
        key, i = BlocksCacheKey(bd.PROMPT_ID, 0), 0
        loop = asyncio.get_running_loop()
        print("ready", flush=True)
        while (line := await loop.run_in_executor(None, sys.stdin.readline)).strip().isdigit():
            took = []
            for _ in range(int(line)):
                t = time.perf_counter()
                if concurrent:
                    i = i % (bd.CACHE_BLOCKS // concurrent)
                    pulls = [bd._lists(i * concurrent + j, 1) for j in range(concurrent)]
                    await asyncio.gather(*(dd.kv_cache_manager.pull_blocks(key, cache, *p) for p in pulls))
                else:
                    await dd.kv_cache_manager.pull_blocks(key, cache, *bd._lists(0 if hot else i, blocks))
                took.append(time.perf_counter() - t)
                i += 1
            print(" ".join(f"{x * 1e6:.1f}" for x in took), flush=True)
        peer.send("exit")

if __name__ == "__main__":
    with Peer(bd._prompt_peer, sys.argv[1], timeout=3600.0, name="prompt") as peer:
        asyncio.run(main(peer, sys.argv[1], int(sys.argv[2]), sys.argv[3] == "hot", int(sys.argv[4])))
"""


def _side(spec: str) -> tuple[str, Path, dict[str, str]]:
    tree, _, setting = spec.partition("=")
    env = {}
    if setting:
        name, _, value = setting.partition(":")
        env[name] = value
    path = Path(tree).resolve()
    if not (path / "aio_datadist").is_dir():
        raise SystemExit(f"{tree}: not a checkout of this repository (no aio_datadist/)")
    return spec, path, env


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ab_trees", description=__doc__.splitlines()[0])
    parser.add_argument("trees", help="comma-separated TREE or TREE=ENV_NAME:VALUE")
    parser.add_argument("--transport", default="tcp", choices=("tcp", "local", "nixl"))
    parser.add_argument("--blocks", type=int, default=1, help="blocks per pull (default 1: 2 MiB)")
    parser.add_argument("--rounds", type=int, default=30, help="rounds, the first one warm-up (default 30)")
    parser.add_argument("--per", type=int, default=40, help="pulls per side and round (default 40)")
    parser.add_argument("--hot", action="store_true",
                        help="pull the same blocks every time (the suite's latency rows) instead of the next ones")
    parser.add_argument("--concurrent", type=int, default=0,
                        help="each sample a batch of N concurrent 1-block pulls (default 0: one pull)")
    args = parser.parse_args(argv)
    if args.concurrent and not 2 <= args.concurrent <= CACHE_BLOCKS:
        parser.error(f"need 2 <= --concurrent <= {CACHE_BLOCKS} (it pulls distinct blocks of the peer's cache)")
    if args.concurrent:
        args.blocks = 1
    if not 1 <= args.blocks <= CACHE_BLOCKS // 2 or args.rounds < 2 or args.per < 1:
        parser.error("need 1 <= --blocks <= 32, --rounds >= 2, --per >= 1")
    sides = [_side(s) for s in args.trees.split(",") if s]
    procs: dict[str, subprocess.Popen] = {}
    samples: dict[str, list[float]] = {spec: [] for spec, _, _ in sides}
    raw_us: list[float] = []
    nbytes = KvGeometry().request_bytes(args.blocks)
    try:
        for spec, path, env in sides:
            procs[spec] = subprocess.Popen(
                [sys.executable, "-c", WORKER, args.transport, str(args.blocks), "hot" if args.hot else "moving",
                 str(args.concurrent)],
                cwd=path, text=True, env=dict(os.environ, PYTHONPATH=str(path), **env), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE)
            assert procs[spec].stdout is not None
            if procs[spec].stdout.readline().strip() != "ready":
                raise SystemExit(f"{spec}: the worker did not start")
        with TcpReplyPeer(nbytes) as raw:
            for r in range(args.rounds):
                shift = r % len(sides)
                for spec, _, _ in sides[shift:] + sides[:shift]:
                    proc = procs[spec]
                    assert proc.stdin is not None and proc.stdout is not None
                    proc.stdin.write(f"{args.per}\n")
                    proc.stdin.flush()
                    took = [float(x) for x in proc.stdout.readline().split()]
                    if r:
                        samples[spec] += took
                    m = raw.rtt(nbytes, args.per, warmup=2)
                    if r:
                        raw_us += [t * 1e6 for t in m.samples]
    finally:
        for proc in procs.values():
            if proc.stdin is not None:
                proc.stdin.write("exit\n")
                proc.stdin.close()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    raw50, raw99 = statistics.median(raw_us), _quantile(raw_us, 0.99)
    if args.concurrent:
        rate = 1e6 / raw50
        print(f"{args.transport}, batches of {args.concurrent} concurrent 1-block pulls, {args.rounds - 1} rounds x "
              f"{args.per} batches per side (after a warm-up round); raw TCP round trips one after another "
              f"{rate:.0f}/s (p50 {raw50:.0f} us)")
        print("| side | transfers/s | / raw serial | batch p99 us |\n|---|---:|---:|---:|")
        for spec, _, _ in sides:
            v = samples[spec]
            tps = args.concurrent * 1e6 / statistics.median(v)
            print(f"| {spec} | {tps:.0f} | {tps / rate:.2f}x | {_quantile(v, 0.99):.0f} |")
        return 0
    print(f"{args.transport}, {args.blocks}-block pulls, {args.rounds - 1} rounds x {args.per} per side "
          f"(after a warm-up round); raw TCP round trip p50 {raw50:.0f} us, p99 {raw99:.0f} us")
    print("| side | p50 us | p50 / raw | p99 us | p99 / raw |\n|---|---:|---:|---:|---:|")
    for spec, _, _ in sides:
        v = samples[spec]
        p50, p99 = statistics.median(v), _quantile(v, 0.99)
        print(f"| {spec} | {p50:.0f} | {p50 / raw50:.2f}x | {p99:.0f} | {p99 / raw99:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
