"""pull_blocks and push_blocks between two processes: ``python -m benchmarks.transfer [--quick]``.

Two endpoints on 127.0.0.1, each in its own process, each with a blocks
cache of the shared geometry (64 tensors, fp16 blocks of [16, 8, 128] =
32 KiB per block per tensor; ``cache_blocks_for(64)`` blocks), one such pair
per transport measured (``--transport tcp|local|nixl|all``, default ``all``:
every transport that can run here; ``nixl`` only where the NIXL package
imports). Per request size (64 blocks = 128 MiB, 4 blocks = 8 MiB over all
tensors), with random distinct source and destination blocks:

- ``pull_blocks over T``: this process (DECODER) pulls from the spawned
  PROMPT, timed here from the call to its return.
- ``push_blocks over T``: the spawned PROMPT pushes into this process's cache
  (``CacheIndex``), timed there from the call until the receiver confirmed.
- baseline, same bytes, same machine, same run: a spawned peer ``sendall``s
  one contiguous buffer and this process ``recv_into``s it (one loopback TCP
  connection, OS socket buffers, as the library's data channels use), timed
  from the 32-byte request to the last byte (``benchmarks.baselines``).

``T`` is the transport the link negotiated, read from the link after
``link_clusters`` (:func:`aio_datadist._negotiated_transport.negotiated_transport`);
a row whose link fell back to another transport than the one asked says so.
Rows give GB/s at the median sample and p50 latency; ratios are against the
baseline (above 1: faster). After timing, every destination block is checked
to carry the stamp of its source block.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks import baselines
from benchmarks._cli import Progress, emit, fits_in_memory
from benchmarks.harness import (
    KvGeometry,
    Measurement,
    Peer,
    Table,
    block_lists,
    blocks_desc,
    blocks_label,
    cache_blocks_for,
    endpoint_options,
    format_bytes,
    machine_info,
    peak_rss,
    repeats_for,
    run_coroutine,
    time_async,
)

SIZES = (64, 4)
TARGET = {64: ">= 0.8x"}  # pull_blocks over TCP of the 128 MiB request against the raw socket
TRANSPORTS = ("tcp", "local", "nixl")
TRANSPORT_CHOICES = (*TRANSPORTS, "all")
DEFAULT_TRANSPORT = "all"
PROMPT_ID = {"tcp": 1, "local": 3, "nixl": 5}
DECODER_ID = {"tcp": 2, "local": 4, "nixl": 6}
OPS = ("pull_blocks", "push_blocks")
RAW = "raw TCP socket"
RAW_ROW = f"{RAW} sendall/recv_into"
TRANSFER_TIMEOUT_MS = 60_000
PEER_LIFETIME_S = 600.0
SEED = 7
ROUNDS, ROUNDS_QUICK = 6, 3
TRANSPORT_HELP = ("aio.Transport of both endpoints: tcp, local (same-host shared memory), nixl, or all "
                  "(default: each of them that can run here, nixl only where the NIXL package imports); "
                  "rows name the transport each link negotiated")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.transfer", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few repeats (about 30 s on 2 cores)")
    p.add_argument("--sizes", type=_counts, default=SIZES,
                   help=f"blocks per request, comma-separated (default {','.join(map(str, SIZES))})")
    p.add_argument("--transport", choices=TRANSPORT_CHOICES, default=DEFAULT_TRANSPORT, help=TRANSPORT_HELP)
    p.add_argument("--uvloop", action="store_true", help="both processes run their event loop on uvloop")
    p.add_argument("--data-channels", type=int, default=None, help="aio.DataChannels (default: the library's)")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    p.add_argument("--verbose", action="store_true", help="section timings on stderr")
    args = p.parse_args(argv)
    args.transports, args.absent = transports_for(args.transport)
    if not args.transports:
        p.error(f"--transport {args.transport}: {args.absent[args.transport]}")
    return args


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes must be comma-separated block counts, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--sizes must be block counts >= 1, got {text!r}")
    return counts


def nixl_missing() -> str:
    """Why the nixl transport cannot run here, "" when it can (tries the import)."""
    from aio_datadist.transport.nixl_engine import load_nixl

    try:
        load_nixl()
    except Exception as exc:  # an LLMException naming what to install, or a broken install's error
        return f"the NIXL package does not import here ({exc})"
    return ""


def transports_for(choice: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """The transports ``--transport choice`` measures here, and why each one left out is absent."""
    if choice not in TRANSPORT_CHOICES:
        raise ValueError(f"choice must be one of {', '.join(TRANSPORT_CHOICES)}, got {choice!r}")
    wanted = TRANSPORTS if choice == "all" else (choice,)
    absent = {}
    if "nixl" in wanted and (why := nixl_missing()):
        absent["nixl"] = why
    return tuple(t for t in wanted if t not in absent), absent


def row_name(op: str, asked: str, negotiated: str) -> str:
    """``"pull_blocks over tcp"``; ``"... over tcp (asked local)"`` where the link fell back."""
    return f"{op} over {negotiated}" + ("" if negotiated == asked else f" (asked {asked})")


# -- the PROMPT process: one endpoint per transport ---------------------------------------------


def _prompt_peer(conn: Any, geometry: KvGeometry, cache_blocks: int, data_channels: int | None,
                 use_uvloop: bool, transports: Sequence[str]) -> None:
    run_coroutine(lambda: _prompt_main(conn, geometry, cache_blocks, data_channels, transports),
                  use_uvloop=use_uvloop)


async def _prompt_main(conn: Any, geometry: KvGeometry, cache_blocks: int, data_channels: int | None,
                       transports: Sequence[str]) -> None:
    from aio_datadist import BlocksCacheKey, CacheIndex, LLMDataDist, LLMRole
    from benchmarks.harness import stamp_blocks

    async with contextlib.AsyncExitStack() as stack:
        kv, caches, ports = {}, {}, {}
        for transport in transports:
            dd = await stack.enter_async_context(LLMDataDist(LLMRole.PROMPT, PROMPT_ID[transport]))
            await dd.init(endpoint_options(transport, listen=True, timeout_ms=TRANSFER_TIMEOUT_MS,
                                           data_channels=data_channels))
            kv[transport] = dd.kv_cache_manager
            caches[transport] = kv[transport].allocate_blocks_cache(blocks_desc(geometry, cache_blocks),
                                                                    BlocksCacheKey(PROMPT_ID[transport]))
            stamp_blocks(caches[transport].tensors)
            ports[transport] = dd.listen_address[1]
        conn.send(ports)
        loop = asyncio.get_running_loop()
        while True:
            readable = loop.create_future()
            loop.add_reader(conn.fileno(), _set_done, readable)
            try:
                await readable
            finally:
                loop.remove_reader(conn.fileno())
            os.set_blocking(conn.fileno(), True)  # uvloop's add_reader makes it non-blocking
            command = conn.recv()
            if command[0] == "exit":
                return
            _, transport, count, repeats, warmup, dst_cache_id = command
            src_blocks, dst_blocks = block_lists(cache_blocks, count, SEED)
            target = CacheIndex(DECODER_ID[transport], dst_cache_id)
            manager, cache = kv[transport], caches[transport]
            samples = await time_async(
                functools.partial(manager.push_blocks, target, cache, src_blocks, dst_blocks,
                                  timeout=TRANSFER_TIMEOUT_MS),
                repeats=repeats, warmup=warmup)
            conn.send(samples)


def _set_done(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


# -- this process: the DECODER -------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    """What :func:`_measure` took.

    ``samples`` by ``(RAW, count)`` and ``(row_name(...), count)``;
    ``negotiated`` maps each ``aio.Transport`` asked to the transport its link
    negotiated, in the order measured.
    """

    samples: dict[tuple[str, int], Measurement]
    negotiated: dict[str, str]

    def name(self, op: str, asked: str) -> str:
        return row_name(op, asked, self.negotiated[asked])


async def _measure(geometry: KvGeometry, counts: Sequence[int], quick: bool, data_channels: int | None,
                   use_uvloop: bool, progress: Progress, transports: Sequence[str] = ("tcp",)) -> Measured:
    """Samples of the raw socket, and of pull_blocks and push_blocks over each transport, in alternating rounds.

    On a small shared machine the load drifts; alternating the cases round by
    round makes the drift hit them alike.
    """
    from aio_datadist import BlocksCacheKey, LLMClusterInfo, LLMDataDist, LLMRole, LLMStatusCode
    from aio_datadist._negotiated_transport import negotiated_transport
    from benchmarks.harness import verify_blocks

    cache_blocks = cache_blocks_for(max(counts))
    rounds = ROUNDS_QUICK if quick else ROUNDS
    samples: dict[tuple[str, int], list[float]] = {}
    negotiated: dict[str, str] = {}
    raw_bytes = max(geometry.request_bytes(c) for c in counts)
    with Peer(_prompt_peer, geometry, cache_blocks, data_channels, use_uvloop, tuple(transports),
              timeout=PEER_LIFETIME_S, name="prompt") as peer, baselines.TcpReplyPeer(raw_bytes) as raw:
        async with contextlib.AsyncExitStack() as stack:
            endpoints, kv, caches = {}, {}, {}
            for transport in transports:
                dd = await stack.enter_async_context(LLMDataDist(LLMRole.DECODER, DECODER_ID[transport]))
                await dd.init(endpoint_options(transport, listen=False, timeout_ms=TRANSFER_TIMEOUT_MS,
                                               data_channels=data_channels))
                endpoints[transport], kv[transport] = dd, dd.kv_cache_manager
                caches[transport] = kv[transport].allocate_blocks_cache(blocks_desc(geometry, cache_blocks))
            ports = await asyncio.to_thread(peer.recv, 120.0)
            for transport, dd in endpoints.items():
                info = LLMClusterInfo()
                info.remote_cluster_id = PROMPT_ID[transport]
                info.append_remote_ip_info("127.0.0.1", ports[transport])
                status, _ = await dd.link_clusters([info])
                if status != LLMStatusCode.LLM_SUCCESS:
                    raise RuntimeError(f"link_clusters (aio.Transport={transport}) failed: {status!r}")
                negotiated[transport] = negotiated_transport(dd, PROMPT_ID[transport])
            progress("linked")
            for count in counts:
                nbytes = geometry.request_bytes(count)
                per_round = max(2, repeats_for(nbytes, quick=quick, min_repeats=10 if quick else 30) // rounds)
                src_blocks, dst_blocks = block_lists(cache_blocks, count, SEED)
                samples[RAW, count] = []
                for transport in transports:
                    for op in OPS:
                        samples[row_name(op, transport, negotiated[transport]), count] = []
                for round_index in range(rounds):
                    warmup = 2 if round_index == 0 else 1
                    samples[RAW, count] += raw.throughput(nbytes, per_round, warmup=warmup).samples
                    for transport in transports:
                        manager, cache = kv[transport], caches[transport]
                        key = BlocksCacheKey(PROMPT_ID[transport])
                        pull, push = (row_name(op, transport, negotiated[transport]) for op in OPS)
                        for t in cache.tensors:
                            t.zero_()
                        samples[pull, count] += await time_async(
                            functools.partial(manager.pull_blocks, key, cache, src_blocks, dst_blocks,
                                              timeout=TRANSFER_TIMEOUT_MS),
                            repeats=per_round, warmup=warmup)
                        if not verify_blocks(cache.tensors, dst_blocks, src_blocks):
                            raise RuntimeError(f"{pull} of {count} blocks put wrong bytes in place")
                        for t in cache.tensors:
                            t.zero_()
                        peer.send(("push", transport, count, per_round, warmup, cache.cache_id))
                        samples[push, count] += await asyncio.to_thread(peer.recv, 300.0)
                        if not verify_blocks(cache.tensors, dst_blocks, src_blocks):
                            raise RuntimeError(f"{push} of {count} blocks put wrong bytes in place")
                progress(f"{count} blocks")
            peer.send(("exit",))
            peer.result(60.0)
    measured = {k: Measurement(k[0], geometry.request_bytes(k[1]), tuple(v)) for k, v in samples.items()}
    return Measured(measured, negotiated)


def _footprint(geometry: KvGeometry, counts: Sequence[int], transports: int = 1) -> int:
    """Two caches per transport, and the raw baseline's two buffers."""
    return (2 * transports * geometry.request_bytes(cache_blocks_for(max(counts)))
            + 2 * geometry.request_bytes(max(counts)))


def title(quick: bool, use_uvloop: bool, transports: Sequence[str]) -> str:
    """The table's title: what ran, over which transports."""
    return (f"aio_datadist transfers between two processes over {', '.join(dict.fromkeys(transports))} "
            f"({'quick' if quick else 'default'}; {'uvloop' if use_uvloop else 'asyncio'}; "
            "GB = 1e9 B; value = median)")


def fill_table(table: Table, measured: Measured, geometry: KvGeometry, counts: Sequence[int], *, quick: bool,
               use_uvloop: bool, absent: dict[str, str]) -> None:
    """The rows and notes of ``measured``; the title names the transports the links negotiated."""
    table.title = title(quick, use_uvloop, measured.negotiated.values())
    for count in counts:
        case = blocks_label(count, geometry)
        base = measured.samples[RAW, count]
        table.add(RAW_ROW, case, base.gbps, "GB/s")
        for asked, moved_by in measured.negotiated.items():
            for op in OPS:
                target = TARGET.get(count) if op == "pull_blocks" and moved_by == "tcp" else None
                table.add(measured.name(op, asked), case, measured.samples[measured.name(op, asked), count].gbps,
                          "GB/s", baseline=RAW, baseline_value=base.gbps, target=target)
        table.add(f"{RAW} p50 latency", case, base.p50_us / 1e3, "ms")
        for asked in measured.negotiated:
            for op in OPS:
                name = measured.name(op, asked)
                table.add(f"{name} p50 latency", case, measured.samples[name, count].p50_us / 1e3, "ms",
                          baseline=RAW, baseline_value=base.p50_us / 1e3)
    asked = ", ".join(f"{a} -> {n}" for a, n in measured.negotiated.items())
    table.note(f"transport: the one each link negotiated, read from the link after link_clusters "
               f"(aio.Transport asked -> negotiated: {asked}); the raw socket is loopback TCP")
    for transport, why in absent.items():
        table.note(f"no {transport} rows: {why}")
    rounds = ROUNDS_QUICK if quick else ROUNDS
    table.note(f"cache {cache_blocks_for(max(counts))} blocks x {geometry.num_tensors} tensors x "
               f"{format_bytes(geometry.block_bytes)} per process and transport; random distinct source and "
               "destination blocks")
    table.note(f"{rounds} alternating rounds per size of the raw socket, then pull_blocks and push_blocks over "
               f"each transport, {measured.samples[RAW, counts[0]].summary.n} samples each at {counts[0]} blocks; "
               "OS socket buffers for TCP")
    table.note("latency ratios are library / raw: above 1 is slower")
    table.note(str(peak_rss()))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    geometry = KvGeometry()
    counts = tuple(args.sizes)
    progress = Progress(args.verbose)
    table = Table(title(args.quick, args.uvloop, args.transports), machine=machine_info())
    for transport, why in args.absent.items():
        print(f"no {transport} rows: {why}", file=sys.stderr)
    if not fits_in_memory(table, "transfer", max(counts), _footprint(geometry, counts, len(args.transports))):
        emit(table, args.format)
        return 1
    measured = run_coroutine(
        lambda: _measure(geometry, counts, args.quick, args.data_channels, args.uvloop, progress, args.transports),
        use_uvloop=args.uvloop)
    fill_table(table, measured, geometry, counts, quick=args.quick, use_uvloop=args.uvloop, absent=args.absent)
    emit(table, args.format)
    return 0


if __name__ == "__main__":
    sys.exit(main())
