"""The receiving end of same-host shares, as a separate process, for attacks that would crash it.

``seal_race ATTEMPTS``: opens ATTEMPTS share sockets (socket pairs), hands the
other ends to ``_share_attacker.py seal_race`` and, on each, waits for the
attacker's record; when the share maps the region, it copies the region's
last row out as a pull or a same-host push does (``_core.copy_now`` over the
region's segments). The thread that checks a received fd is preempted for
200 ms after each of its syscalls on it (``fstat``, ``fcntl``), as a loaded
host may do to any thread at any point. Prints one JSON object with what
happened; a region mapped past the end of its file kills this process with
SIGBUS instead.

``hugetlb``: opens one share socket (a socket pair), hands the other end to
``_share_attacker.py hugetlb`` and waits for its record; when the share maps the
region, asks the attacker to punch a hole in it and take the host's free huge
pages, then copies the region's last row (the hole) out as a pull does. Prints
one JSON object with what happened and why the share was dropped, if it was;
a read of the hole with no huge page left kills this process with SIGBUS.

``address_space SHARES`` (or ``map_count SHARES``): opens SHARES share sockets,
hands the other ends to ``_share_attacker.py address_space`` (``map_count``) and serves them all until the attacker
says what it holds; then allocates a 64 MiB cache region (``HostRegion``, as
``allocate_cache`` does) and reports whether it could, and how many bytes of
peers' regions it has mapped.
"""

from __future__ import annotations

import array
import asyncio
import ctypes
import json
import logging
import os
import socket
import subprocess
import sys
import time
from typing import Any

from aio_datadist import _core
from aio_datadist.devices import host
from aio_datadist.transport.local import LocalShare

ATTACKER = os.path.join(os.path.dirname(__file__), "_share_attacker.py")
PREEMPTED_S = 0.2


class _Preempted:
    """A module seen through this proxy pauses after each call of the names it wraps."""

    def __init__(self, module: Any, *names: str) -> None:
        self._module, self._names = module, names

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if name not in self._names:
            return value

        def call(*args: Any) -> Any:
            try:
                return value(*args)
            finally:
                time.sleep(PREEMPTED_S)
        return call


async def attempt(sock: socket.socket, report: dict) -> None:
    lost: list[bool] = []
    share = LocalShare(sock, on_lost=lambda: lost.append(True))
    try:
        deadline = time.monotonic() + 5.0
        while 7 not in share.regions and not lost and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        region = share.regions.get(7)
        if region is None:
            report["refused" if lost else "nothing"] += 1
            return
        report["mapped"] += 1
        last = bytearray(region.row_bytes)
        dst = array.array("Q", [ctypes.addressof((ctypes.c_char * len(last)).from_buffer(last)), len(last)])
        src = _core.segments(region.tensor_bases(0, 1), array.array("q", [region.rows - 1]), region.row_bytes, 0,
                             region.row_bytes)
        print(json.dumps({"copying": region.size}), flush=True)
        _core.copy_now(_core.zip_segments(dst, src))
        report["read"] += 1
    finally:
        share.close()


def seal_race(attempts: int) -> dict:
    host.os = _Preempted(os, "fstat")  # type: ignore[assignment]
    host.fcntl = _Preempted(host.fcntl, "fcntl")  # type: ignore[assignment]
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(attempts)]
    theirs = [b.fileno() for _, b in pairs]
    proc = subprocess.Popen([sys.executable, ATTACKER, "seal_race", *map(str, theirs)], pass_fds=theirs,
                            stdout=subprocess.DEVNULL)
    for _, b in pairs:
        b.close()
    report = {"mapped": 0, "refused": 0, "nothing": 0, "read": 0}
    try:
        loop = asyncio.new_event_loop()
        try:
            for ours, _ in pairs:
                loop.run_until_complete(attempt(ours, report))
        finally:
            loop.close()
    finally:
        proc.wait(timeout=30)
    return report


async def hugetlb() -> dict:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = await asyncio.create_subprocess_exec(sys.executable, ATTACKER, "hugetlb", str(theirs.fileno()),
                                                pass_fds=[theirs.fileno()], stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE)
    theirs.close()
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: warnings.append(rec.getMessage())  # type: ignore[method-assign]
    logging.getLogger("aio_datadist").addHandler(handler)
    lost: list[bool] = []
    share = LocalShare(ours, on_lost=lambda: lost.append(True))
    report: dict[str, Any] = {"mapped": 0, "refused": 0, "nothing": 0, "read": 0}
    try:
        assert proc.stdout is not None and proc.stdin is not None
        said = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
        report["attacker"] = said
        if "unavailable" in said:
            return report
        deadline = time.monotonic() + 5.0
        while 7 not in share.regions and not lost and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        region = share.regions.get(7)
        report["why"] = warnings
        if region is None:
            report["refused" if lost else "nothing"] += 1
            return report
        report["mapped"] += 1
        proc.stdin.write(b"punch\n")
        await proc.stdin.drain()
        report["attacker after"] = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
        print(json.dumps(report), flush=True)  # what we know, should the read below kill us
        hole = bytearray(region.row_bytes)
        dst = array.array("Q", [ctypes.addressof((ctypes.c_char * len(hole)).from_buffer(hole)), len(hole)])
        src = _core.segments(region.tensor_bases(0, 1), array.array("q", [region.rows - 1]), region.row_bytes, 0,
                             region.row_bytes)
        _core.copy_now(_core.zip_segments(dst, src))
        report["read"] += 1
        return report
    finally:
        share.close()
        logging.getLogger("aio_datadist").removeHandler(handler)
        if proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def address_space(shares: int, mode: str = "address_space") -> dict:
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(shares)]
    theirs = [b.fileno() for _, b in pairs]
    proc = await asyncio.create_subprocess_exec(sys.executable, ATTACKER, mode, *map(str, theirs),
                                                pass_fds=theirs, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE)
    for _, b in pairs:
        b.close()
    live = [LocalShare(ours, on_lost=lambda: None) for ours, _ in pairs]
    try:
        assert proc.stdout is not None and proc.stdin is not None
        said = json.loads(await asyncio.wait_for(proc.stdout.readline(), 120))
        mapped = sum(region.size for share in live for region in share.regions.values())
        regions = sum(len(share.regions) for share in live)
        dropped = sum(share.closed for share in live)
        refused = sum(len(share.refused) for share in live)
        try:
            host.HostRegion(64 << 20)
            allocated = "yes"
        except (OSError, MemoryError) as exc:
            allocated = f"no: {exc}"
        proc.stdin.close()
        await asyncio.wait_for(proc.wait(), 30)
        return {"attacker holds": said["held"], "mapped": mapped, "regions": regions, "shares dropped": dropped,
                "refused": refused, "64 MiB allocated": allocated, "attacker says": said}
    finally:
        for share in live:
            share.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


if __name__ == "__main__":
    if sys.argv[1] == "seal_race":
        print(json.dumps(seal_race(int(sys.argv[2]))), flush=True)
    elif sys.argv[1] == "hugetlb":
        print(json.dumps(asyncio.run(hugetlb())), flush=True)
    else:
        print(json.dumps(asyncio.run(address_space(int(sys.argv[2]), sys.argv[1]))), flush=True)
