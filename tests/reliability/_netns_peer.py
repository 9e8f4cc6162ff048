"""An endpoint process inside a network namespace, for ``test_netns.py``.

:class:`NetnsPeer` forks a process from the reliability suite's fork server
(torch and aio_datadist preloaded: tens of ms instead of seconds) that enters
the named network namespace (``setns``, as ``ip netns exec`` does) before it
opens any socket, so it sees only that namespace's interfaces, addresses and
abstract unix sockets. It then runs one endpoint, driven over a pipe:

- ``prompt``: listens on ``ADDRESS:0`` with a blocks cache bound to
  ``BlocksCacheKey(PROMPT_ID, 0)`` and filled with ``pattern(DESC, SEED)``;
  sends ``{"port": ...}``; answers ``state`` with its links.
- ``decoder``: waits for the prompt's port, links with ``link_clusters``'
  default timeout, pulls every block in reverse order, checks the bytes and
  sends a record of all that, its links included.
- ``exit`` (both): finalize, then send the log records of ``aio_datadist``
  (``LEVEL logger message``) and exit.

The process exits by itself if the test process dies or ``LIFETIME_S`` passes.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
import traceback
from typing import Any

import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    Placement,
    link_dials,
)
from aio_datadist.testing import links_of, nixl_agent_of
from peers import DECODER_ID, PROMPT_ID, _next_command, fill, pattern, wait_readable

import _harness

DESC = CacheDesc(4, (16, 8, 256), DataType.DT_FLOAT16, Placement.HOST)  # 16 blocks of 4 KiB per tensor
SEED = 41
LIFETIME_S = 40.0
CLONE_NEWNET = 0x40000000
_CTX = multiprocessing.get_context("forkserver")


class NetnsPeer:
    """The test's side of one endpoint process in namespace ``ns`` (see the module docstring)."""

    def __init__(self, ns: str, role: str, address: str, transport: str, loop: str) -> None:
        self._conn, child = _CTX.Pipe(duplex=True)
        self._process = _CTX.Process(target=_main, args=(child, ns, role, address, transport, loop, os.getpid()),
                                     name=f"netns-{role}", daemon=True)
        self._process.start()
        child.close()
        self._fds = {self._conn.fileno(), self._process.sentinel}
        _harness.PROCESS_FDS.update(self._fds)
        self.log: list[str] = []
        self._done = False

    async def recv(self, timeout: float = 20.0) -> Any:
        await wait_readable(self._conn, timeout)
        try:
            kind, value = self._conn.recv()
        except EOFError:
            raise AssertionError(f"the {self._process.name} process ended early") from None
        if kind == "error":
            raise AssertionError(f"the {self._process.name} process failed:\n{value}")
        return value

    def send(self, *command: Any) -> None:
        self._conn.send(command)

    async def stop(self) -> None:
        """``exit`` (finalize), collect its log, reap; killed if it does not end in time. Idempotent."""
        if self._done:
            return
        self._done = True
        try:
            if self._process.is_alive():
                self.send("exit")
                self.log = await self.recv(timeout=10.0)
        finally:
            deadline = time.monotonic() + 5.0
            while self._process.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if self._process.is_alive():
                self._process.kill()
            self._process.join(5.0)
            self._process.close()
            self._conn.close()
            _harness.PROCESS_FDS.difference_update(self._fds)

    def warnings(self, logger: str) -> list[str]:
        return [line for line in self.log if line.startswith(f"WARNING {logger} ")]


# -- the child's side -------------------------------------------------------------------------------


def _enter(ns: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _watch(parent: int) -> None:
    deadline = time.monotonic() + LIFETIME_S
    while time.monotonic() < deadline:
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    os._exit(70)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name} {record.getMessage()}")


def _main(conn: multiprocessing.connection.Connection, ns: str, role: str, address: str, transport: str,
          loop: str, parent: int) -> None:
    threading.Thread(target=_watch, args=(parent,), daemon=True).start()
    torch.set_num_threads(1)
    lines = _Lines()
    logger = logging.getLogger("aio_datadist")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    factory = None
    if loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    try:
        _enter(ns)
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(_serve(conn, role, address, transport))
        conn.send(("log", lines.lines))
    except BaseException:
        conn.send(("error", traceback.format_exc() + "\n".join(lines.lines)))
    conn.close()
    os._exit(0)  # skip interpreter teardown (torch's costs about 1 s)


def _state(dd: LLMDataDist) -> dict[str, Any]:
    plane = nixl_agent_of(dd)
    links = {}
    for cid, link in links_of(dd).items():
        peer = link.nixl
        links[cid] = {"nixl": peer is not None and peer.usable(), "declined": None if peer is None else peer.declined,
                      "local": link.local is not None, "broken": link.broken is not None}
    return {"links": links, "posted": 0 if plane is None else plane.engine.posted}


async def _serve(conn: multiprocessing.connection.Connection, role: str, address: str, transport: str) -> None:
    config = LLMConfig()
    config.device_id = 0
    config.transport = transport
    if role == "prompt":
        config.listen_ip_info = f"{address}:0"
    prompt = role == "prompt"
    async with LLMDataDist(LLMRole.PROMPT if prompt else LLMRole.DECODER, PROMPT_ID if prompt else DECODER_ID) as dd:
        await dd.init(config.generate_options())
        kv = dd.kv_cache_manager
        if prompt:
            fill(kv.allocate_blocks_cache(DESC, BlocksCacheKey(PROMPT_ID, 0)), SEED)
            conn.send(("ok", {"port": dd.listen_address[1]}))
        else:
            dst = kv.allocate_blocks_cache(DESC)
        while True:
            command, *args = await _next_command(conn)
            if command == "exit":
                return
            if command == "state":
                conn.send(("ok", _state(dd)))
            elif command == "link":
                conn.send(("ok", await _link_and_pull(dd, dst, address, args[0])))


async def _link_and_pull(dd: LLMDataDist, dst: Any, address: str, port: int) -> dict[str, Any]:
    kv = dd.kv_cache_manager
    shares: list[str] = []  # same-host share attempts: made when the peer has our boot id
    real_connect = link_dials.connect_share

    async def connect_share(*args: Any) -> Any:
        try:
            sock = await real_connect(*args)
        except BaseException as exc:
            shares.append(f"failed: {type(exc).__name__}: {exc}")
            raise
        shares.append("connected")
        return sock

    link_dials.connect_share = connect_share
    info = LLMClusterInfo()
    info.remote_cluster_id = PROMPT_ID
    info.append_remote_ip_info(address, port)
    started = time.monotonic()
    status, codes = await dd.link_clusters([info])  # the default timeout: 3000 ms
    record: dict[str, Any] = {"status": int(status), "codes": [int(c) for c in codes],
                              "link_s": time.monotonic() - started, "shares": shares}
    if codes == [0]:
        blocks = list(range(DESC.shape[0]))
        await kv.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, blocks, blocks[::-1])
        want = pattern(DESC, SEED)
        record["verified"] = all(bool((d.flip(0) == w).all()) for d, w in zip(dst.tensors, want))
        record["bytes"] = sum(t.numel() * t.element_size() for t in dst.tensors)
    record.update(_state(dd))
    return record
