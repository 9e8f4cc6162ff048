"""Print the table of baselines (memcpy, loopback TCP, gloo) for the KV-cache request sizes.

Run from the repository root: ``python -m benchmarks.baselines_main [--quick | --full]``.

Rows: one-thread memcpy; one loopback TCP connection with the OS socket
buffers (ratio against memcpy) and TCP round trips; the same connection with
small fixed socket buffers (ratio against the OS defaults); gloo
gather/send/recv/scatter (ratio against raw TCP with the OS defaults).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from benchmarks import baselines
from benchmarks.harness import (
    GIB,
    KIB,
    MIB,
    KvGeometry,
    OtherCpuLoad,
    Progress,
    Table,
    add_common_arguments,
    block_counts,
    blocks_label,
    emit,
    fits_in_memory,
    format_bytes,
    machine_info,
    mode_label,
    peak_rss,
    repeats_for,
)

SWEEP_SOCK_BUF_SIZES = (64 * KIB, 128 * KIB, 512 * KIB, 1 * MIB, 2 * MIB, 4 * MIB)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.baselines_main", description=__doc__.splitlines()[0])
    add_common_arguments(p)
    p.add_argument("--sockbuf-sweep", action="store_true", help="raw_tcp at 64 blocks with more socket buffer sizes")
    return p.parse_args(argv)


def measure(
    table: Table,
    counts: Sequence[int],
    *,
    quick: bool,
    sweep: bool = False,
    geometry: KvGeometry | None = None,
    verbose: bool = False,
) -> None:
    """Run every baseline for ``counts`` (blocks per request), adding rows and notes to ``table``."""
    geometry = geometry or KvGeometry()
    progress = Progress(verbose)
    load = OtherCpuLoad()
    request = {c: geometry.request_bytes(c) for c in counts}

    memcpy_counts = [c for c in counts if fits_in_memory(table, "memcpy", c, 2 * request[c])]
    memcpy: dict[int, float] = {}
    if memcpy_counts:
        results = baselines.raw_memcpy_sizes({request[c]: repeats_for(request[c], quick=quick) for c in memcpy_counts})
        for c in memcpy_counts:
            memcpy[c] = results[request[c]].gbps
            table.add("memcpy 1 thread", blocks_label(c, geometry), memcpy[c], "GB/s")
        progress("memcpy")
        table.note("memcpy copies the same bytes each repeat: requests smaller than the last-level cache run from it")

    tcp_counts = [c for c in counts if fits_in_memory(table, "raw_tcp", c, 2 * request[c])]
    tcp: dict[int, float] = {}
    rtt_sizes = [32, geometry.block_bytes, geometry.request_bytes(1), geometry.request_bytes(4)]
    max_bytes = max([request[c] for c in tcp_counts] + rtt_sizes)
    with baselines.TcpReplyPeer(max_bytes) as peer:
        for c in tcp_counts:
            m = peer.throughput(request[c], repeats_for(request[c], quick=quick))
            tcp[c] = m.gbps
            table.add(
                "raw_tcp 1 conn", blocks_label(c, geometry), m.gbps, "GB/s",
                baseline="memcpy" if c in memcpy else None, baseline_value=memcpy.get(c),
            )
        progress("raw_tcp throughput")
        for n in rtt_sizes:
            # p99 needs a few hundred samples; large replies get fewer than small ones.
            rtt_repeats = repeats_for(
                n, quick=quick, budget_bytes=(GIB // 4 if quick else 2 * GIB),
                min_repeats=100 if quick else 250, max_repeats=300 if quick else 3000,
            )
            m = peer.rtt(n, rtt_repeats)
            case = f"reply {format_bytes(n)}"
            table.add("raw_tcp_rtt p50", case, m.p50_us, "us")
            table.add("raw_tcp_rtt p99", case, m.p99_us, "us")
        sndbuf, rcvbuf = peer.socket_buffers()
    progress("raw_tcp_rtt")
    defaults = baselines.tcp_default_buffers()
    table.note(
        f"raw_tcp and raw_tcp_rtt use the OS socket buffers (autotuned; this side ended at SO_SNDBUF "
        f"{format_bytes(sndbuf)}, SO_RCVBUF {format_bytes(rcvbuf)}; tcp_rmem {defaults['tcp_rmem']}, "
        f"tcp_wmem {defaults['tcp_wmem']}, rmem_max {defaults['rmem_max']}, wmem_max {defaults['wmem_max']})"
    )

    tuned = baselines.TCP_TUNED_SOCK_BUF
    if tcp_counts:
        with baselines.TcpReplyPeer(max(request[c] for c in tcp_counts), sock_buf=tuned) as peer:
            for c in tcp_counts:
                m = peer.throughput(request[c], repeats_for(request[c], quick=quick))
                table.add(
                    f"raw_tcp SO_*BUF={format_bytes(tuned)}", blocks_label(c, geometry), m.gbps, "GB/s",
                    baseline="raw_tcp", baseline_value=tcp[c],
                )
        progress("raw_tcp tuned socket buffers")
        table.note(
            f"SO_*BUF={format_bytes(tuned)}: SO_SNDBUF and SO_RCVBUF set on both ends before connect "
            f"(the kernel doubles them); --sockbuf-sweep tries other sizes"
        )
    probe = 64 if 64 in tcp else (max(tcp) if tcp else None)
    if sweep and probe is not None:
        for size in SWEEP_SOCK_BUF_SIZES:
            with baselines.TcpReplyPeer(request[probe], sock_buf=size) as peer:
                m = peer.throughput(request[probe], repeats_for(request[probe], quick=quick))
            table.add(
                f"raw_tcp SO_*BUF={format_bytes(size)}", blocks_label(probe, geometry), m.gbps, "GB/s",
                baseline="raw_tcp", baseline_value=tcp[probe],
            )
        progress("socket buffer sweep")

    gloo_counts = [c for c in counts if fits_in_memory(table, "gloo", c, baselines.gloo_footprint(c, geometry))]
    if gloo_counts:
        # The slowest baseline by far: quick runs take the median of two at large sizes.
        repeats = {c: repeats_for(request[c], quick=quick, min_repeats=2 if quick else None) for c in gloo_counts}
        results, info = baselines.gloo_send_recv_sizes(repeats, geometry=geometry)
        for c, m in results.items():
            table.add(
                "gloo gather/send/recv/scatter", blocks_label(c, geometry), m.gbps, "GB/s",
                baseline="raw_tcp" if c in tcp else None, baseline_value=tcp.get(c),
            )
        table.note(
            f"gloo: 2 spawned ranks, torch threads per rank {info['torch_threads']}, "
            f"cache {info['cache_blocks']} blocks x {geometry.num_tensors} tensors per rank; "
            "timed by the receiver from its 'go' message to the end of the scatter; blocks verified after timing"
        )
        progress("gloo")
    table.note(str(peak_rss()))
    table.note(load.describe())


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    table = Table(f"aio_datadist baselines ({mode_label(args)}; GB = 1e9 B; value = median)", machine=machine_info())
    measure(table, block_counts(args), quick=args.quick, sweep=args.sockbuf_sweep, verbose=args.verbose)
    emit(table, args.format)
    return 0


if __name__ == "__main__":
    sys.exit(main())
