"""How close a 1-block pull can get: ``python -m benchmarks.floor [--n N] [--blocks B] [--hot] [--load]``.

Four ways to move the same bytes between two processes on loopback, in
alternating rounds, each with the wall time per transfer and the CPU time
each process spent on it (user + system, from ``/proc``):

- ``raw, hot``: ``benchmarks.baselines``'s round trip (a 32-byte request on a
  blocking socket, ``sendall`` of one hot buffer, ``recv_into`` one hot buffer):
  the baseline of the issue-19 table.
- ``raw, moving``: the same, but each transfer reads and writes the next rows
  of a cache-sized buffer, as the library's pulls do (their memory is cold).
- ``asyncio floor``: the least an asyncio design does for a posted pull: a
  request on a control socket, the answer on a data socket, both ends on an
  event loop (``sock_sendall``, ``sock_recv_into``), no checks, no plan, no
  header; moving rows.
- ``pull_blocks``: the library's TCP pull (``benchmarks.breakdown``'s peers),
  moving rows.

The gap between the floor and the library is the library's own work; the
gap between the raw rows is what cold memory costs; the CPU columns say
what a transfer costs the two cores the 64-concurrent row shares.

``--hot`` moves the same rows every time in the asyncio floor and the pull
(as ``benchmarks.suite``'s latency rows do, against the hot raw baseline), so
the table also says how far the suite's pull is from the floor of its own
arrangement.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from benchmarks import breakdown as bd
from benchmarks._peer import Peer
from benchmarks._spinner import Spinner
from benchmarks._workload import KvGeometry

CACHE_BLOCKS = bd.CACHE_BLOCKS
REQUEST = 32


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pair() -> tuple[socket.socket, socket.socket]:
    server = socket.create_server(("127.0.0.1", 0))
    try:
        client = socket.create_connection(server.getsockname()[:2])
        accepted, _ = server.accept()
    finally:
        server.close()
    for s in (client, accepted):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client, accepted


def _raw_server(conn: Connection, sock: socket.socket, nbytes: int, moving: bool) -> None:
    import numpy as np

    src = np.ones(nbytes * (CACHE_BLOCKS if moving else 1), np.uint8)
    view = memoryview(src)
    k = 0
    while True:
        request = sock.recv(REQUEST, socket.MSG_WAITALL)
        if len(request) < REQUEST:
            return
        i = k % CACHE_BLOCKS if moving else 0
        sock.sendall(view[i * nbytes:(i + 1) * nbytes])
        k += 1


def _floor_server(conn: Connection, control: socket.socket, data: socket.socket, nbytes: int) -> None:
    import numpy as np

    src = np.ones(nbytes * CACHE_BLOCKS, np.uint8)
    view = memoryview(src)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        control.setblocking(False)
        data.setblocking(False)
        while True:
            request = await loop.sock_recv(control, REQUEST)
            if len(request) < 2:
                return
            i = int.from_bytes(request[:2], "little")
            await loop.sock_sendall(data, view[i * nbytes:(i + 1) * nbytes])

    asyncio.run(serve())


class _Case:
    """One way of moving ``nbytes``: ``run(n)`` does n transfers and gives their wall times."""

    name = ""
    peer_pid = 0

    def run(self, n: int) -> list[float]:
        raise NotImplementedError


class _Raw(_Case):
    def __init__(self, nbytes: int, moving: bool) -> None:
        import numpy as np

        self.name = "raw, moving" if moving else "raw, hot (the table's baseline)"
        self.nbytes, self.moving, self.k = nbytes, moving, 0
        self.sock, far = _pair()
        self.peer = Peer(_raw_server, far, nbytes, moving, timeout=600.0, name="raw-server").start()
        self.peer_pid = self.peer.pid or 0
        far.close()
        self.dst = np.zeros(nbytes * (CACHE_BLOCKS if moving else 1), np.uint8)
        self.view = memoryview(self.dst)
        self.sock.settimeout(30.0)

    def run(self, n: int) -> list[float]:
        times, nbytes = [], self.nbytes
        for _ in range(n):
            i = self.k % CACHE_BLOCKS if self.moving else 0
            self.k += 1
            t0 = time.perf_counter()
            self.sock.sendall(bytes(REQUEST))
            got = 0
            while got < nbytes:
                got += self.sock.recv_into(self.view[i * nbytes + got:(i + 1) * nbytes])
            times.append(time.perf_counter() - t0)
        return times

    def close(self) -> None:
        self.sock.close()
        self.peer.close()


class _Floor(_Case):
    def __init__(self, nbytes: int, loop: asyncio.AbstractEventLoop, hot: bool) -> None:
        import numpy as np

        self.name = "asyncio floor, hot" if hot else "asyncio floor, moving"
        self.nbytes, self.k, self.loop, self.hot = nbytes, 0, loop, hot
        self.control, far_control = _pair()
        self.data, far_data = _pair()
        self.peer = Peer(_floor_server, far_control, far_data, nbytes, timeout=600.0, name="floor-server").start()
        self.peer_pid = self.peer.pid or 0
        far_control.close()
        far_data.close()
        self.control.setblocking(False)
        self.data.setblocking(False)
        self.dst = np.zeros(nbytes * CACHE_BLOCKS, np.uint8)
        self.view = memoryview(self.dst)

    async def run_async(self, n: int) -> list[float]:
        loop, times, nbytes = self.loop, [], self.nbytes
        for _ in range(n):
            i = 0 if self.hot else self.k % CACHE_BLOCKS
            self.k += 1
            t0 = time.perf_counter()
            await loop.sock_sendall(self.control, i.to_bytes(2, "little") + bytes(REQUEST - 2))
            got = 0
            while got < nbytes:
                got += await loop.sock_recv_into(self.data, self.view[i * nbytes + got:(i + 1) * nbytes])
            times.append(time.perf_counter() - t0)
        return times

    def close(self) -> None:
        self.control.close()
        self.data.close()
        self.peer.close()


async def _library(peer: Peer, blocks: int, hot: bool) -> tuple[Any, Callable[[int], Any]]:
    """A DECODER linked over TCP to ``peer`` (a ``benchmarks.breakdown`` prompt) and its pull loop."""
    from aio_datadist import LLMDataDist, LLMRole

    port = await peer.recv_async(120.0)
    dd = LLMDataDist(LLMRole.DECODER, bd.DECODER_ID)
    cache, key = await bd.link_decoder(dd, port, "tcp")
    state = [0]

    async def pulls(n: int) -> list[float]:
        times = []
        for _ in range(n):
            lists = bd._lists(0 if hot else state[0], blocks)
            state[0] += 1
            t0 = time.perf_counter()
            await dd.kv_cache_manager.pull_blocks(key, cache, *lists)
            times.append(time.perf_counter() - t0)
        return times

    return dd, pulls


Row = tuple[str, float, float, float]


async def _main(n: int, rounds: int, blocks: int, hot: bool, spinner: Spinner | None) -> dict[bool, list[Row]]:
    """``{loaded: [(case, wall p50 us, CPU us requester, CPU us owner)]}``; loaded only with a ``spinner``."""
    nbytes = KvGeometry().request_bytes(blocks)
    loop = asyncio.get_running_loop()
    results: dict[tuple[str, bool], tuple[list[float], list[float], list[float]]] = {}
    passes = (False, True) if spinner is not None else (False,)
    raw_hot, raw_moving, floor = _Raw(nbytes, False), _Raw(nbytes, True), _Floor(nbytes, loop, hot)
    with Peer(bd._prompt_peer, "tcp", timeout=600.0, name="prompt") as prompt:
        dd, pulls = await _library(prompt, blocks, hot)
        try:
            cases: list[tuple[str, int, Callable[[int], Any]]] = [
                (raw_hot.name, raw_hot.peer_pid, lambda k: asyncio.to_thread(raw_hot.run, k)),
                (raw_moving.name, raw_moving.peer_pid, lambda k: asyncio.to_thread(raw_moving.run, k)),
                (floor.name, floor.peer_pid, floor.run_async),
                ("pull_blocks TCP, hot" if hot else "pull_blocks TCP, moving", prompt.pid or 0, pulls),
            ]
            me = os.getpid()
            for r in range(rounds + 1):  # round 0 warms up
                for loaded in passes:
                    for name, pid, run in cases[r % len(cases):] + cases[:r % len(cases)]:
                        with spinner.running() if loaded and spinner is not None else contextlib.nullcontext():
                            mine, theirs = _cpu_s(me), _cpu_s(pid)
                            times = await run(n)
                            spent_me, spent_peer = _cpu_s(me) - mine, _cpu_s(pid) - theirs
                        if r:
                            wall, cpu_me, cpu_peer = results.setdefault((name, loaded), ([], [], []))
                            wall.extend(times)
                            cpu_me.append(spent_me)
                            cpu_peer.append(spent_peer)
        finally:
            await dd.finalize()
            prompt.send("exit")
            for case in (raw_hot, raw_moving, floor):
                case.close()
    # CPU time comes in clock ticks (10 ms): summed over every round, per transfer.
    return {loaded: [(name, statistics.median(wall) * 1e6, sum(cpu_me) / len(wall) * 1e6,
                      sum(cpu_peer) / len(wall) * 1e6)
                     for name, (wall, cpu_me, cpu_peer) in ((name, results[name, loaded]) for name, _, _ in cases)]
            for loaded in passes}


def _print_table(rows: list[Row]) -> None:
    print("| case | wall p50 us | / raw, hot | CPU us, requester | CPU us, owner | CPU us, both |")
    print("|---|---:|---:|---:|---:|---:|")
    raw = rows[0][1]
    for name, wall, cpu_me, cpu_peer in rows:
        print(f"| {name} | {wall:.0f} | {wall / raw:.2f}x | {cpu_me:.0f} | {cpu_peer:.0f} | {cpu_me + cpu_peer:.0f} |")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.floor", description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100, help="transfers per case and round (default 100)")
    parser.add_argument("--rounds", type=int, default=8, help="alternating rounds after a warm-up (default 8)")
    parser.add_argument("--blocks", type=int, default=1, help="blocks per transfer (default 1: 2 MiB)")
    parser.add_argument("--hot", action="store_true",
                        help="the asyncio floor and the pull move the same rows every time (the suite's arrangement)")
    parser.add_argument("--load", action="store_true",
                        help="run every case also while a busy-loop child spins, and print the suite's loaded "
                             "criterion for each")
    args = parser.parse_args(argv)
    if not 1 <= args.blocks <= CACHE_BLOCKS // 2:
        parser.error(f"--blocks must be within 1..{CACHE_BLOCKS // 2}")
    if args.n < 1 or args.rounds < 1:
        parser.error("--n and --rounds must be >= 1")
    with contextlib.ExitStack() as stack:
        spinner = stack.enter_context(Spinner()) if args.load else None
        tables = asyncio.run(_main(args.n, args.rounds, args.blocks, args.hot, spinner))
        load = spinner.describe() if spinner is not None else ""
    mib = KvGeometry().request_bytes(args.blocks) >> 20
    print(f"# {mib} MiB on loopback, {args.rounds} alternating rounds x {args.n} "
          "(wall: median; CPU: total / transfers)\n")
    _print_table(tables[False])
    if args.load:
        print(f"\n# the same, while {load} spins\n")
        _print_table(tables[True])
        print("\n| case | quiet / raw, hot | loaded / raw, hot (loaded) | loaded ratio / quiet ratio | "
              "mark (<= 1.3x) |")
        print("|---|---:|---:|---:|---|")
        quiet_raw, loaded_raw = tables[False][0][1], tables[True][0][1]
        for (name, quiet, _, _), (_, loaded, _, _) in zip(tables[False], tables[True]):
            ratio = (loaded / loaded_raw) / (quiet / quiet_raw)
            print(f"| {name} | {quiet / quiet_raw:.2f}x | {loaded / loaded_raw:.2f}x | {ratio:.2f}x | "
                  f"{'pass' if ratio <= 1.3 else 'FAIL'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
