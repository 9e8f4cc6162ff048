"""Raw loopback TCP against fixed send buffers: ``python -m benchmarks.sock_buffers [--rounds 8] [--modes ...]``.

A question for the stream transport, asked of the raw socket alone: does a
data channel move faster with a fixed ``SO_SNDBUF`` than with the buffer the
kernel tunes (``net.ipv4.tcp_wmem``)? The library leaves the kernel's tuning
on; ``benchmarks.baselines.TCP_TUNED_SOCK_BUF`` recorded that fixed buffers
on both ends made large transfers faster on an earlier VM.

One replier process per mode (a forked child that sends the first N bytes of
a 128 MiB buffer for each 8-byte request), one connection each, opened
before any is timed; this process asks each in turn, in a rotating order,
for ``--per`` round trips of 2 and 8 MiB and ``--big-per`` of 128 MiB per
round, and prints the median round trip per mode and size against the
kernel-tuned one. Modes: ``auto`` (nothing set), ``sndNk`` / ``sndNm`` (a
fixed ``SO_SNDBUF`` of N KiB / MiB on the replier, set before its first
send; the kernel doubles it), ``perjob`` (the replier sets 256 KiB before
each transfer of 16 MiB or more and 4 MiB before a smaller one: what a
sender could do per job, as the option can be changed but not handed back
to the kernel's tuning).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import sys
import time
from collections.abc import Callable, Sequence

BUF = 128 << 20
SIZES = (2 << 20, 8 << 20, 128 << 20)
IO_TIMEOUT_S = 30.0
_REQ = struct.Struct("<Q")


def _sndbuf_for(mode: str) -> int | Callable[[int], int] | None:
    if mode == "auto":
        return None
    if mode == "perjob":
        return lambda n: 256 << 10 if n >= 16 << 20 else 4 << 20
    if mode.startswith("snd") and mode[-1] in "km" and mode[3:-1].isdigit():
        return int(mode[3:-1]) << (10 if mode[-1] == "k" else 20)
    raise SystemExit(f"unknown mode {mode!r} (auto, perjob, sndNk, sndNm)")


def _timeouts(sock: socket.socket) -> None:
    tv = struct.pack("ll", int(IO_TIMEOUT_S), 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _replier(listener: socket.socket, sndbuf: int | Callable[[int], int] | None) -> None:
    conn, _ = listener.accept()
    listener.close()
    _timeouts(conn)
    if isinstance(sndbuf, int):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    data = bytearray(BUF)
    data[::4096] = bytes(range(256)) * (BUF // 4096 // 256)
    view, current = memoryview(data), None
    while True:
        head = b""
        while len(head) < _REQ.size:
            got = conn.recv(_REQ.size - len(head))
            if not got:
                return
            head += got
        (n,) = _REQ.unpack(head)
        if callable(sndbuf) and sndbuf(n) != current:
            current = sndbuf(n)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, current)
        conn.sendall(view[:n])


def _round_trip(sock: socket.socket, dst: memoryview, n: int) -> float:
    t0 = time.perf_counter()
    sock.sendall(_REQ.pack(n))
    got = 0
    while got < n:
        k = sock.recv_into(dst[got:n], n - got)
        if k == 0:
            raise ConnectionError("the replier went away")
        got += k
    return time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sock_buffers", description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="auto,snd256k,snd1m,snd4m,perjob")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--per", type=int, default=25, help="round trips of 2 and 8 MiB per mode and round")
    parser.add_argument("--big-per", type=int, default=2, help="round trips of 128 MiB per mode and round")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if "auto" not in modes:
        modes.insert(0, "auto")
    plans = {m: _sndbuf_for(m) for m in modes}
    children: list[int] = []
    conns: dict[str, socket.socket] = {}
    try:
        for mode in modes:  # every replier forks before any connection exists: none holds another's socket
            listener = socket.socket()
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    _replier(listener, plans[mode])
                except BaseException:
                    code = 1
                os._exit(code)
            children.append(pid)
            conns[mode] = socket.create_connection(listener.getsockname(), timeout=IO_TIMEOUT_S)
            conns[mode].settimeout(None)
            _timeouts(conns[mode])
            listener.close()
        dst = memoryview(bytearray(BUF))
        samples: dict[tuple[str, int], list[float]] = {}
        for r in range(args.rounds + 1):  # round 0 warms up
            shift = r % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                for n in SIZES:
                    reps = args.big_per if n >= 64 << 20 else args.per
                    took = [_round_trip(conns[mode], dst, n) for _ in range(reps)]
                    if r:
                        samples.setdefault((mode, n), []).extend(took)
    finally:
        for sock in conns.values():
            sock.close()
        for pid in children:
            os.waitpid(pid, 0)
    print(f"raw loopback TCP round trips, {args.rounds} rounds (medians; ratio = speed against the kernel-tuned "
          "send buffer)")
    print("| size | " + " | ".join(modes) + " |\n|---|" + "---:|" * len(modes))
    for n in SIZES:
        auto = statistics.median(samples[("auto", n)])
        cells = [f"{statistics.median(samples[(m, n)]) * 1e6:.0f} us ({auto / statistics.median(samples[(m, n)]):.2f}x)"
                 for m in modes]
        print(f"| {n >> 20} MiB | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
