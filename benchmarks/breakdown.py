"""Where the time of a pull goes: ``python -m benchmarks.breakdown [--transport tcp,local,nixl] [--blocks N]``.

A PROMPT process (spawned) and the DECODER (this process) run with
``AIO_DATADIST_TRACE=1``: the library notes the time each pull reaches each
stage (``aio_datadist/_trace.py``), on both ends, on CLOCK_MONOTONIC, so the
two processes' marks line up. After warm-up pulls, ``--n`` 1-block pulls run
one after another; the table gives, per stage, the median time from the
previous stage (and, in its second column, the median over the slowest
``--tail`` per cent of the pulls by total: which stage a slow pull loses
its time in, for the p99 row), and where it is spent:

- ``call -> planned``: the requester's checks and plan (the loop, here);
- ``planned -> request sent``: the link's channel, the request record, the write;
- ``request sent -> owner: request read``: loopback and the owner's wake-up;
- ``owner: ...``: the owner's checks, its answer and the start of its job;
- ``owner: answered -> answer read``: loopback and our wake-up;
- ``answer read -> job submitted``: handing our half to the engine (a thread);
- ``job submitted -> job done``: the bytes (TCP: the owner's send and our
  receive; same-host: one copy) and the engine's completion reaching the loop;
- ``job done -> returned``: the confirmation (``DONE``) and the return.

A pull over a plain TCP channel posts its receive before the request goes
out and takes the owner's answer on the channel (``ReqFlag.POSTED``): it
has no ``answer read`` or ``job submitted`` marks, and ``owner: answered ->
job done`` is the bytes. The last rows are the raw TCP round trip of the same
bytes (a 32-byte request, the reply; ``benchmarks.baselines``), measured in
stretches of 50 between the pulls, and the ratio of the two medians.

A same-host pull that the owner's read ledger lists never reaches the owner
(``docs/transports.md``, "The read ledger"): its rows are the requester's
alone, ``job submitted -> job done`` being the copy. Nor does a NIXL pull
the owner granted (``docs/nixl.md``, "Pulls without asking"): ``call ->
job submitted`` holds its checks, a loop turn and the READ of the owner's
ledger word.

Over NIXL (``--transport nixl``, needs the NIXL package) the job is the
NIXL engine's. A transfer of at most ``nixl_engine.INLINE_MAX`` is posted
from the loop while the worker is idle: ``job submitted -> nixl: transfer()
returned`` is then ``make_prepped_xfer`` and the posting call (with UCX
shared memory the copy runs inside it). Otherwise (or with
``AIO_DATADIST_NIXL_INLINE_MAX=0``) ``job submitted -> nixl: worker took
it`` is the hand-off to its worker thread, ``-> nixl: handle made`` NIXL's
``make_prepped_xfer``, ``-> nixl: transfer() returned`` the posting call,
``-> nixl: settled`` the polling until NIXL said DONE,
``-> job done`` the completion reaching the loop. ``--blocks 4`` is the
8 MiB request of ``benchmarks.nixl``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks._endpoints import blocks_desc, endpoint_options
from benchmarks.baselines import TcpReplyPeer
from benchmarks._peer import Peer
from benchmarks._spinner import Spinner
from benchmarks._workload import KvGeometry

PROMPT_ID, DECODER_ID = 1, 2
CACHE_BLOCKS = 64
TIMEOUT_MS = 20_000
WARMUP = 60
RAW_EVERY = 50  # pulls between stretches of as many raw TCP round trips
TOTAL = "total (call -> returned)"
#: The stages of one pull in the order they happen (the owner's job may end before or after ours).
ORDER = ("call", "planned", "request sent", "owner: request read", "owner: planned", "owner: answered",
         "answer read", "job submitted", "nixl: worker took it", "nixl: handle made", "nixl: transfer() returned",
         "nixl: settled", "job done", "returned")


def _prompt_peer(conn: Any, transport: str) -> None:
    asyncio.run(_prompt_main(conn, transport))


async def _prompt_main(conn: Any, transport: str) -> None:
    from aio_datadist import BlocksCacheKey, LLMDataDist, LLMRole, _trace

    geometry = KvGeometry()
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as dd:
        await dd.init(endpoint_options(transport, listen=True, timeout_ms=TIMEOUT_MS))
        cache = dd.kv_cache_manager.allocate_blocks_cache(blocks_desc(geometry, CACHE_BLOCKS),
                                                          BlocksCacheKey(PROMPT_ID, 0))
        for t in cache.tensors:
            t.fill_(1)
        assert dd.listen_address is not None
        conn.send(dd.listen_address[1])
        loop = asyncio.get_running_loop()
        while True:
            command = await loop.run_in_executor(None, conn.recv)
            if command == "marks":
                conn.send(_trace.take())
            elif command == "exit":
                return


def _runs(marks: list[tuple[int, str]], first: str) -> list[dict[str, int]]:
    """The marks cut into one ``{stage: ns}`` per pull, each starting at ``first``."""
    runs: list[dict[str, int]] = []
    for t, stage in marks:
        if stage == first:
            runs.append({})
        if runs and stage not in runs[-1]:
            runs[-1][stage] = t
    return runs


def _breakdown(mine: list[dict[str, int]], theirs: list[dict[str, int]],
               tail: float) -> list[tuple[str, float, float]]:
    """Per stage: the median over all pulls, and the median over the slowest ``tail`` of them (by total)."""
    rows: dict[str, list[float | None]] = {}
    merged_runs = [{**ours, **owner} for ours, owner in zip(mine, theirs, strict=False)]
    totals = [(m["returned"] - m["call"]) / 1000 if "returned" in m else 0.0 for m in merged_runs]
    cut = sorted(totals)[min(len(totals) - 1, int(len(totals) * (1 - tail)))] if totals else 0.0
    slow = [t >= cut for t in totals]
    for i, merged in enumerate(merged_runs):
        stages = [s for s in ORDER if s in merged]
        seen: set[str] = set()
        for before, after in zip(stages, stages[1:]):
            name = f"{before} -> {after}"
            seen.add(name)
            rows.setdefault(name, [None] * i).append((merged[after] - merged[before]) / 1000)
        if "returned" in merged:
            seen.add(TOTAL)
            rows.setdefault(TOTAL, [None] * i).append(totals[i])
        for name, values in rows.items():  # a stage this pull did not reach
            if name not in seen:
                values.append(None)
    out = []
    for name, values in rows.items():
        every = [v for v in values if v is not None]
        slowest = [v for v, s in zip(values, slow, strict=True) if s and v is not None]
        out.append((name, statistics.median(every), statistics.median(slowest) if slowest else float("nan")))
    return out


def _lists(i: int, blocks: int) -> tuple[list[int], list[int]]:
    """Pull ``i``'s source and destination blocks: distinct within each list, moving along the cache."""
    return ([(i * blocks + j) % CACHE_BLOCKS for j in range(blocks)],
            [((i + 1) * blocks + j) % CACHE_BLOCKS for j in range(blocks)])


async def link_decoder(dd: Any, port: int, transport: str) -> tuple[Any, Any]:
    """Initialise the DECODER ``dd``, give it a blocks cache like the peer's and link it to the PROMPT peer
    (``_prompt_peer``) listening on ``port`` over ``transport``: ``(cache, the peer's blocks key)``."""
    from aio_datadist import BlocksCacheKey, LLMClusterInfo, LLMStatusCode

    await dd.init(endpoint_options(transport, listen=False, timeout_ms=TIMEOUT_MS))
    cache = dd.kv_cache_manager.allocate_blocks_cache(blocks_desc(KvGeometry(), CACHE_BLOCKS))
    info = LLMClusterInfo()
    info.remote_cluster_id = PROMPT_ID
    info.append_remote_ip_info("127.0.0.1", port)
    status, _ = await dd.link_clusters([info])
    if status != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"link_clusters failed: {status!r}")
    negotiated = dd.stats().links[PROMPT_ID].transport
    if negotiated != transport:
        raise RuntimeError(f"asked for {transport}, the link negotiated {negotiated}")
    return cache, BlocksCacheKey(PROMPT_ID, 0)


async def _warm(dd: Any, peer: Peer, transport: str, blocks: int) -> tuple[Any, Any]:
    """Link ``dd`` to the peer, run the warm-up pulls and drop every mark so far, on both ends."""
    from aio_datadist import _trace

    cache, key = await link_decoder(dd, await peer.recv_async(120.0), transport)
    for i in range(WARMUP):
        await dd.kv_cache_manager.pull_blocks(key, cache, *_lists(i, blocks))
    await asyncio.sleep(0.05)  # the owner's last DONE is read
    _trace.take()
    peer.send("marks")
    await peer.recv_async(30.0)
    return cache, key


async def _decoder(peer: Peer, transport: str, n: int, blocks: int, hot: bool = False,
                   tail: float = 0.05, spinner: Spinner | None = None) -> list[tuple[str, float, float]]:
    from aio_datadist import LLMDataDist, LLMRole, _trace

    geometry = KvGeometry()
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
        cache, key = await _warm(dd, peer, transport, blocks)
        raw_us: list[float] = []
        with TcpReplyPeer(geometry.request_bytes(blocks)) as raw, \
                spinner.running() if spinner is not None else contextlib.nullcontext():
            for i in range(n):
                if i % RAW_EVERY == 0:  # the baseline in alternating stretches, so drift hits both alike
                    m = await asyncio.to_thread(raw.rtt, geometry.request_bytes(blocks), RAW_EVERY, warmup=2)
                    raw_us.extend(t * 1e6 for t in m.samples)
                await dd.kv_cache_manager.pull_blocks(key, cache, *_lists(0 if hot else i, blocks))
        await asyncio.sleep(0.05)
        mine = _runs(_trace.take(), "call")
        peer.send("marks")
        theirs = _runs(await peer.recv_async(30.0), "owner: request read")
        peer.send("exit")
        # A same-host pull the owner's read ledger lists never reaches the owner: then only our marks.
        if len(mine) != n or len(theirs) not in (0, n):
            raise RuntimeError(f"expected {n} pulls of marks on each end, got {len(mine)} and {len(theirs)}")
        raw_tail = sorted(raw_us)[int(len(raw_us) * (1 - tail)):]
        return [*_breakdown(mine, theirs or [{}] * n, tail),
                ("raw TCP round trip of the same bytes (baseline)", statistics.median(raw_us),
                 statistics.median(raw_tail))]


def _cpu_rows(marks: list[tuple[int, str]], n: int) -> list[tuple[str, float, float]]:
    """CPU marks of one thread (``AIO_DATADIST_TRACE_CLOCK=cpu``): per pair of consecutive stages that at least
    half of the ``n`` pulls passed, in the order first seen, ``(name, median us, mean us)``."""
    pairs: dict[str, list[float]] = {}
    for (t0, before), (t1, after) in zip(marks, marks[1:]):
        pairs.setdefault(f"{before} -> {after}", []).append((t1 - t0) / 1000)
    return [(name, statistics.median(us), statistics.mean(us)) for name, us in pairs.items() if len(us) >= n // 2]


async def _decoder_cpu(peer: Peer, transport: str, n: int, blocks: int, hot: bool = False,
                       spinner: Spinner | None = None) -> tuple[list[tuple[str, float, float]],
                                                                list[tuple[str, float, float]], float]:
    """``--cpu``: the CPU each loop thread spends between its stages, ours and the owner's, and our loop
    thread's CPU per pull in all."""
    import time

    from aio_datadist import LLMDataDist, LLMRole, _trace

    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
        cache, key = await _warm(dd, peer, transport, blocks)
        with spinner.running() if spinner is not None else contextlib.nullcontext():
            started = time.thread_time()
            for i in range(n):
                await dd.kv_cache_manager.pull_blocks(key, cache, *_lists(0 if hot else i, blocks))
            ours = (time.thread_time() - started) / n * 1e6
        await asyncio.sleep(0.05)
        mine = _trace.take()
        peer.send("marks")
        theirs = await peer.recv_async(30.0)
        peer.send("exit")
    return _cpu_rows(mine, n), _cpu_rows(theirs, n), ours


def _print_cpu(transport: str, mine: list[tuple[str, float, float]], theirs: list[tuple[str, float, float]],
               ours_us: float) -> None:
    print(f"## {transport}: CPU of each loop thread between its stages (us)\n")
    for side, rows in (("requester (this process)", mine), ("owner (the PROMPT process)", theirs)):
        print(f"| {side} | median | mean |\n|---|---:|---:|")
        for name, median, mean in rows:
            print(f"| {name} | {median:.1f} | {mean:.1f} |")
        print(f"| sum of the means | | {sum(mean for _, _, mean in rows):.0f} |\n")
    print(f"(our loop thread: {ours_us:.0f} us of CPU per pull in all, measured around the timed pulls)\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.breakdown", description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="tcp,local",
                        help="comma-separated: tcp, local, nixl (default tcp,local)")
    parser.add_argument("--blocks", type=int, default=1, help="blocks per pull (default 1: 2 MiB; 4: 8 MiB)")
    parser.add_argument("--n", type=int, default=400, help="timed pulls per transport (default 400)")
    parser.add_argument("--tail", type=float, default=5.0,
                        help="the second column: medians over the slowest PCT %% of pulls by total (default 5)")
    parser.add_argument("--loaded", action="store_true",
                        help="run the timed pulls and the baseline while a busy-loop child keeps one core busy "
                             "(the suite's loaded passes)")
    parser.add_argument("--hot", action="store_true",
                        help="pull the same blocks every time (their memory stays in the CPU caches, as the raw "
                             "baseline's buffer does) instead of the next ones round the 128 MiB cache")
    parser.add_argument("--cpu", action="store_true",
                        help="the CPU time each end's loop thread spends between its stages (user + system, "
                             "AIO_DATADIST_TRACE_CLOCK=cpu) instead of the wall-clock breakdown; no raw baseline")
    args = parser.parse_args(argv)
    os.environ["AIO_DATADIST_TRACE"] = "1"  # before the library is imported, here and in the peer
    if args.cpu:
        os.environ["AIO_DATADIST_TRACE_CLOCK"] = "cpu"
    if "aio_datadist._trace" in sys.modules:
        raise RuntimeError("run benchmarks.breakdown as its own program: the library was imported already")
    geometry = KvGeometry()
    if not 1 <= args.blocks <= CACHE_BLOCKS // 2:
        parser.error(f"--blocks must be within 1..{CACHE_BLOCKS // 2}")
    if not 0 < args.tail <= 50:
        parser.error("--tail must be within (0, 50]")
    tail = args.tail / 100
    print(f"# Where a {args.blocks}-block pull's time goes ({geometry.request_bytes(args.blocks) >> 20} MiB; "
          f"median of {args.n} pulls, us)\n")
    with contextlib.ExitStack() as stack:
        spinner = stack.enter_context(Spinner()) if args.loaded else None
        for transport in args.transport.split(","):
            with Peer(_prompt_peer, transport, timeout=600.0, name="prompt") as peer:
                if args.cpu:
                    _print_cpu(transport, *asyncio.run(_decoder_cpu(peer, transport, args.n, args.blocks, args.hot,
                                                                    spinner)))
                    continue
                rows = asyncio.run(_decoder(peer, transport, args.n, args.blocks, args.hot, tail, spinner))
            _print_rows(transport, rows, args.tail)
        if spinner is not None:
            print(f"(one core busy: {spinner.describe()}, {spinner.cpu_seconds():.1f} CPU s in all)")
    return 0


def _print_rows(transport: str, rows: list[tuple[str, float, float]], tail_pct: float) -> None:
    print(f"## {transport}\n\n| stage | median us | slowest {tail_pct:g} %: median us |\n|---|---:|---:|")
    for name, us, slow_us in rows:
        print(f"| {name} | {us:.0f} | {slow_us:.0f} |")
    total, raw_rtt = {name: (us, slow) for name, us, slow in rows}[TOTAL], rows[-1][1:]
    print(f"| total / raw round trip | {total[0] / raw_rtt[0]:.2f}x | {total[1] / raw_rtt[1]:.2f}x |")
    print()


if __name__ == "__main__":
    sys.exit(main())
