"""What the two-process GPU tests share: a CUDA endpoint's options, its seeded blocks, the owner process.

The owner runs in a spawned process (a forked one would inherit this
process's CUDA context); :func:`owner_process` starts it, yields this end of
its pipe once it reported (its first message), and always reaps it: joined,
killed past 60 s, and its exit status checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from aio_datadist import CacheDesc, DataType, LLMClusterInfo, LLMConfig, Placement

#: 8 tensors of 64 blocks of 32 KiB on the GPU.
BLOCKS = CacheDesc(8, (64, 16, 8, 128), DataType.DT_FLOAT16, Placement.DEVICE)


def cuda_options(listen: bool, transport: str, **settings: Any) -> dict[str, str]:
    """A CUDA endpoint on GPU 0 (listening on a loopback port when ``listen``), with ``settings`` set."""
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.device_type = "cuda"
    cfg.transport = transport
    for name, value in settings.items():
        setattr(cfg, name, value)
    if listen:
        cfg.listen_ip_info = "127.0.0.1:0"
    return cfg.generate_options()


def expected(seed: int) -> list[torch.Tensor]:
    """The owner's seeded bytes, one ``[64, 32768]`` uint8 tensor per cache tensor."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (64, 32768), dtype=torch.uint8, generator=gen) for _ in range(8)]


def rows(cache: Any) -> list[torch.Tensor]:
    """A cache's tensors as ``[64, 32768]`` uint8 rows, on the host."""
    return [t.view(torch.uint8).view(64, -1).cpu() for t in cache.tensors]


def owner_at(port: int) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = 1
    info.append_remote_ip_info("127.0.0.1", port)
    return info


@contextlib.asynccontextmanager
async def owner_process(target: Callable[[Any, int], None], seed: int) -> AsyncIterator[tuple[Any, Any]]:
    """Run ``target(conn, seed)`` in a spawned process; yields ``(conn, first message)``."""
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    owner = ctx.Process(target=target, args=(theirs, seed))
    owner.start()
    try:
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, mine.poll, 120), "the owner process never started"
        yield mine, mine.recv()
    finally:
        owner.join(60)
        if owner.is_alive():
            owner.kill()
            owner.join()
        mine.close()
        theirs.close()
    assert owner.exitcode == 0
