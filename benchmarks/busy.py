"""Who is busy while concurrent pulls run: ``python -m benchmarks.busy [--concurrent 64] [--seconds 6] [--load]``.

The 64-concurrent row of ``benchmarks.suite`` asks for more transfers per
second than one raw TCP round trip after another. On two cores that is a
question of CPU: this program says where it goes. A PROMPT process
(``benchmarks.breakdown``'s peer) and the DECODER (this process) are linked
over TCP; the DECODER runs batches of ``--concurrent`` 1-block (2 MiB) pulls
on the one link for ``--seconds``, in ``--rounds`` stretches that alternate
with stretches of raw TCP round trips of the same bytes (``benchmarks.
baselines``). Printed, per case: transfers per second, the CPU each process
spent per transfer (user and system, from ``/proc``), and how busy each
thread of the two processes was (the share of one core), so a thread that
bounds the rate stands out, and the context switches per transfer. With
``--load`` a busy-loop child process (``benchmarks._spinner``, not pinned)
spins through every stretch, as in the suite's loaded pass, and its share of
the cores is printed too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import Sequence

from benchmarks import breakdown as bd
from benchmarks._peer import Peer
from benchmarks._spinner import Spinner
from benchmarks._workload import KvGeometry
from benchmarks.baselines import TcpReplyPeer

TICK = os.sysconf("SC_CLK_TCK")


def _switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of every thread of ``pid`` so far."""
    vol = invol = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        vol += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        invol += int(line.split()[1])
        except FileNotFoundError:
            continue
    return vol, invol


def _times(pid: int) -> dict[str, tuple[str, float, float]]:
    """``{thread id: (name, user s, system s)}`` of every thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out[tid] = (name, int(fields[11]) / TICK, int(fields[12]) / TICK)
    return out


class _Sample:
    """CPU of two processes over a stretch: per process (user, system) and per thread busy seconds."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.start = {who: _times(pid) for who, pid in pids.items()}
        self.switches0 = {who: _switches(pid) for who, pid in pids.items()}
        self.switches: dict[str, tuple[int, int]] = {}

    def stop(self) -> dict[str, dict[str, tuple[str, float, float]]]:
        out: dict[str, dict[str, tuple[str, float, float]]] = {}
        for who, pid in self.pids.items():
            (v1, i1), (v0, i0) = _switches(pid), self.switches0[who]
            self.switches[who] = (v1 - v0, i1 - i0)
        for who, pid in self.pids.items():
            end, start = _times(pid), self.start[who]
            out[who] = {}
            for tid, (name, user, system) in end.items():
                _, user0, system0 = start.get(tid, (name, 0.0, 0.0))  # a thread started meanwhile: from 0
                out[who][tid] = (name, user - user0, system - system0)
        return out


def _add(total: dict[str, dict[str, list[float]]], sample: dict[str, dict[str, tuple[str, float, float]]]) -> None:
    for who, threads in sample.items():
        for tid, (name, user, system) in threads.items():
            acc = total.setdefault(who, {}).setdefault(f"{name} ({tid})", [0.0, 0.0])
            acc[0] += user
            acc[1] += system


async def _main(concurrent: int, seconds: float, rounds: int, spinner: Spinner | None) -> None:
    from aio_datadist import LLMDataDist, LLMRole

    nbytes = KvGeometry().request_bytes(1)
    with TcpReplyPeer(nbytes) as raw, Peer(bd._prompt_peer, "tcp", timeout=600.0, name="prompt") as prompt:
        port = await prompt.recv_async(120.0)
        async with LLMDataDist(LLMRole.DECODER, bd.DECODER_ID) as dd:
            cache, key = await bd.link_decoder(dd, port, "tcp")
            kv = dd.kv_cache_manager
            blocks = min(concurrent, bd.CACHE_BLOCKS)

            async def pulls(until: float) -> int:
                n = 0
                while time.perf_counter() < until:
                    await asyncio.gather(*(kv.pull_blocks(key, cache, [i % blocks], [i % blocks])
                                           for i in range(n, n + concurrent)))
                    n += concurrent
                return n

            def round_trips(until: float) -> int:
                n = 0
                while time.perf_counter() < until:
                    raw.request(nbytes)
                    n += 1
                return n

            await pulls(time.perf_counter() + 0.5)  # warm-up
            round_trips(time.perf_counter() + 0.5)
            pids = {"requester": os.getpid(), "owner": prompt.pid or 0}
            raw_pids = {"requester": os.getpid(), "owner": raw.pid}
            stretch = seconds / rounds
            cases: dict[str, tuple[list[float], dict[str, dict[str, list[float]]], list[int]]] = {
                name: ([], {}, []) for name in ("raw", "pulls")}
            switches: dict[str, dict[str, list[int]]] = {name: {} for name in cases}
            spun: dict[str, float] = dict.fromkeys(cases, 0.0)
            for _ in range(rounds):
                for name in ("raw", "pulls"):
                    with spinner.running() if spinner is not None else contextlib.nullcontext():
                        spin0 = spinner.cpu_seconds() if spinner is not None else 0.0
                        sample = _Sample(raw_pids if name == "raw" else pids)
                        t0 = time.perf_counter()
                        if name == "raw":
                            n = await asyncio.to_thread(round_trips, t0 + stretch)
                        else:
                            n = await pulls(t0 + stretch)
                        wall = time.perf_counter() - t0
                        rates, threads, counts = cases[name]
                        rates.append(n / wall)
                        _add(threads, sample.stop())
                        counts.append(n)
                        if spinner is not None:
                            spun[name] += spinner.cpu_seconds() - spin0
                    for who, (vol, invol) in sample.switches.items():
                        acc = switches[name].setdefault(who, [0, 0])
                        acc[0] += vol
                        acc[1] += invol
        prompt.send("exit")

    wall_each = seconds  # both cases ran for ``seconds`` in all
    raw_rate = statistics.median(cases["raw"][0])
    load = "" if spinner is None else f"; {spinner.describe()} spins throughout"
    print(f"# {concurrent} concurrent 1-block (2 MiB) TCP pulls on one link vs raw round trips one at a time; "
          f"{rounds} alternating stretches of {stretch:.1f} s each{load}\n")
    print("| case | transfers/s (median) | / raw | CPU us per transfer, requester (user + sys) "
          "| CPU us per transfer, owner (user + sys) | context switches per transfer, requester / owner "
          "(voluntary + involuntary) | spinner, cores |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, label in (("raw", "raw TCP round trips, one at a time"), ("pulls", f"{concurrent} concurrent pulls")):
        rates, threads, counts = cases[name]
        total = sum(counts)
        cols = []
        for who in ("requester", "owner"):
            user = sum(v[0] for v in threads[who].values())
            system = sum(v[1] for v in threads[who].values())
            cols.append(f"{(user + system) / total * 1e6:.0f} ({user / total * 1e6:.0f} + {system / total * 1e6:.0f})")
        rate = statistics.median(rates)
        sw = " / ".join(f"{v / total:.1f} + {i / total:.1f}" for v, i in
                        (switches[name].get(who, [0, 0]) for who in ("requester", "owner")))
        spin = f"{spun[name] / seconds:.2f}" if spinner is not None else "-"
        print(f"| {label} | {rate:.0f} | {rate / raw_rate:.2f}x | {cols[0]} | {cols[1]} | {sw} | {spin} |")
    print("\n| case | process | thread | busy (share of one core) |")
    print("|---|---|---|---:|")
    for name in ("raw", "pulls"):
        for who, per_thread in cases[name][1].items():
            for thread, (user_s, system_s) in sorted(per_thread.items(), key=lambda t: -sum(t[1])):
                busy = (user_s + system_s) / wall_each
                if busy >= 0.01:
                    print(f"| {name} | {who} | {thread} | {busy:.0%} |")
    print("\nthe raw case's requester thread is this process's worker thread; CPU comes in clock ticks "
          f"(1/{TICK} s), summed over all stretches")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.busy", description=__doc__.splitlines()[0])
    parser.add_argument("--concurrent", type=int, default=64, help="pulls per batch (default 64)")
    parser.add_argument("--seconds", type=float, default=6.0, help="seconds per case, all stretches (default 6)")
    parser.add_argument("--rounds", type=int, default=4, help="alternating stretches per case (default 4)")
    parser.add_argument("--load", action="store_true",
                        help="a busy-loop child process (benchmarks._spinner, not pinned) spins during every stretch")
    args = parser.parse_args(argv)
    if args.concurrent < 1 or args.seconds <= 0 or args.rounds < 1:
        parser.error("--concurrent and --rounds must be >= 1, --seconds > 0")
    with contextlib.ExitStack() as stack:
        spinner = stack.enter_context(Spinner()) if args.load else None
        asyncio.run(_main(args.concurrent, args.seconds, args.rounds, spinner))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
