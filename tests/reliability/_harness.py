"""Shared pieces of the reliability suite: endpoints, leak accounting, canary arenas.

- :func:`options` / :func:`endpoint`: an endpoint configured by ``LLMConfig``
  attribute names (``transport="tcp"``, ``shared_secret=...``).
- :func:`state` / :func:`settle`: what an endpoint holds (pending tokens,
  native jobs, registered bytes, claimed keys) and a bounded wait until it
  holds no more than a baseline, open fds included.
- :class:`Arena`: caches carved out of one host tensor with random canary
  bytes before, between and after every cache tensor; a shadow copy says
  what every byte must hold, so any stray write (or one missing) is found.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import random
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    KvCache,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)
from aio_datadist.testing import engine_state
from peers import LOCALHOST

S = LLMStatusCode
ENDED = (S.LLM_LINK_FAILED, S.LLM_TIMEOUT)


def options(*, listen: bool = False, **config: Any) -> dict[str, str]:
    """Options of a loopback endpoint; ``config`` names :class:`LLMConfig` attributes."""
    cfg = LLMConfig()
    cfg.device_id = 0
    if listen:
        cfg.listen_ip_info = f"{LOCALHOST}:0"
    for name, value in config.items():
        setattr(cfg, name, value)
    return cfg.generate_options()


@contextlib.asynccontextmanager
async def endpoint(role: LLMRole, cluster_id: int, *, listen: bool = False,
                   **config: Any) -> AsyncIterator[LLMDataDist]:
    async with LLMDataDist(role, cluster_id) as dd:
        await dd.init(options(listen=listen, **config))
        yield dd


# -- leak accounting ------------------------------------------------------------

_LOOP_OWNED = ("/dev/urandom", "pipe:", "/dev/null")  # uvloop opens /dev/null once, for EMFILE handling

#: fds of live peer processes (command pipe, fork server status socket): theirs, not an endpoint's.
PROCESS_FDS: set[int] = set()


def open_fds() -> set[str]:
    """This process's fds other than the pipes and urandom event loops keep (as the top conftest),
    and other than those of the peer processes a test is running."""
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        if int(name) in PROCESS_FDS:
            continue
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if not any(s in target for s in _LOOP_OWNED):
            fds.add(f"{name}->{target}")
    return fds


def state(dd: LLMDataDist) -> dict[str, int]:
    """What an endpoint holds that a finished transfer must have given back (see ``engine_state``)."""
    return engine_state(dd)


def baseline_of(dd: LLMDataDist) -> tuple[dict[str, int], set[str]]:
    """``(state(dd), open_fds())`` for :func:`settle`, taken after a collection: memory an earlier test left
    in unreachable cycles (a traceback's frames keep whole coroutines on Python 3.12) is freed now, so its
    memfd does not close during this test and read as an fd this test lost."""
    gc.collect()
    return state(dd), open_fds()


async def settle(dd: LLMDataDist, baseline: dict[str, int], fds: set[str] | None = None,
                 within: float = 2.0) -> None:
    """Wait (bounded) until ``dd`` holds exactly ``baseline`` again, and ``fds`` are open."""
    deadline = time.monotonic() + within
    collected = False
    while True:
        now, now_fds = state(dd), open_fds()
        if now == baseline and (fds is None or now_fds == fds):
            return
        if now == baseline and not collected:
            gc.collect()  # memory kept by a reference cycle (an exception's traceback) goes now
            collected = True
            continue
        if time.monotonic() > deadline:
            extra = sorted(now_fds - fds) if fds is not None else []
            gone = sorted(fds - now_fds) if fds is not None else []
            raise AssertionError(f"endpoint {dd.cluster_id} did not settle: {now} != {baseline}; "
                                 f"fds extra {describe_sockets(extra)} missing {gone}")
        await asyncio.sleep(0.01)


def describe_sockets(fds: list[str]) -> list[str]:
    """``fd->socket:[inode]`` entries with their TCP endpoints and state, when /proc knows them."""
    known: dict[str, str] = {}
    for table in ("tcp", "tcp6", "unix"):
        try:
            with open(f"/proc/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            p = line.split()
            if table == "unix" and len(p) >= 7:
                known[p[6]] = f"unix {p[7] if len(p) > 7 else ''}"
            elif len(p) > 9:
                known[p[9]] = f"{table} {p[1]} -> {p[2]} state {p[3]}"
    out = []
    for fd in fds:
        inode = fd.split("socket:[")[1].rstrip("]") if "socket:[" in fd else None
        out.append(f"{fd} ({known.get(inode, '?')})" if inode else fd)
    return out


async def code_of(awaitable: Any) -> LLMStatusCode | None:
    """None if ``awaitable`` succeeds, else its ``LLMException``'s code."""
    try:
        await awaitable
    except LLMException as exc:
        return exc.status_code
    return None


def rss_bytes(pid: int | None = None) -> int:
    with open(f"/proc/{pid or 'self'}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# -- canary arenas ----------------------------------------------------------------


class Arena:
    """Host memory for registered caches, with canaries around every cache tensor.

    ``layout`` lists the descs; each tensor gets a random gap (64 to 960
    bytes) of canary bytes before it, and one more gap ends the arena. All
    bytes start random (seeded); :attr:`shadow` holds what they must be.
    """

    def __init__(self, descs: Sequence[CacheDesc], seed: int) -> None:
        rng = random.Random(seed)
        spans: list[list[tuple[int, int]]] = []
        pos = 0
        self.canaries: list[tuple[int, int]] = []
        for desc in descs:
            tensors = []
            for _ in range(desc.num_tensors):
                gap = 64 * rng.randint(1, 15)
                self.canaries.append((pos, gap))
                pos += gap
                tensors.append((pos, desc.size))
                pos += (desc.size + 63) // 64 * 64
            spans.append(tensors)
        self.canaries.append((pos, 256))
        pos += 256
        gen = torch.Generator().manual_seed(seed)
        self.buf = torch.randint(0, 256, (pos,), dtype=torch.uint8, generator=gen)
        self.shadow = self.buf.clone()
        self.descs = list(descs)
        self.spans = spans
        self.base = self.buf.data_ptr()
        self.caches: list[KvCache] = []

    def addrs(self, index: int) -> list[int]:
        return [self.base + off for off, _ in self.spans[index]]

    def register(self, kv: Any, index: int, *, keys: Sequence[CacheKey] = (), blocks: bool = False,
                 blocks_key: BlocksCacheKey | None = None) -> KvCache:
        desc = self.descs[index]
        if blocks:
            cache = kv.register_blocks_cache(desc, self.addrs(index), blocks_key)
        else:
            cache = kv.register_cache(desc, self.addrs(index), list(keys))
        self.caches.append(cache)
        return cache

    def tensor_bytes(self, index: int, tensor: int) -> torch.Tensor:
        off, size = self.spans[index][tensor]
        return self.buf[off:off + size]

    def shadow_bytes(self, index: int, tensor: int) -> torch.Tensor:
        off, size = self.spans[index][tensor]
        return self.shadow[off:off + size]

    def registered(self, start: int, end: int) -> bool:
        """Whether the absolute address range ``[start, end)`` lies inside one cache tensor."""
        for tensors in self.spans:
            for off, size in tensors:
                if self.base + off <= start and end <= self.base + off + size:
                    return True
        return False

    def canaries_intact(self) -> bool:
        return all(torch.equal(self.buf[o:o + n], self.shadow[o:o + n]) for o, n in self.canaries)

    def intact(self) -> bool:
        """Every byte is what the shadow says (canaries and cache bytes alike)."""
        return torch.equal(self.buf, self.shadow)

    def first_difference(self) -> str:
        diff = (self.buf != self.shadow).nonzero()
        if not len(diff):
            return "none"
        at = int(diff[0])
        where = next((f"canary at {o}" for o, n in self.canaries if o <= at < o + n), "cache bytes")
        return f"{len(diff)} bytes differ, first at offset {at} ({where})"
