"""NIXL between two processes on one GPU: device caches registered as VRAM, a pull and a push by NIXL.

The owner runs in its own (spawned) process with a CUDA endpoint on a NIXL
link; both ends' device caches are registered with their agent as ``VRAM``
on GPU 0 and offered with ``OFFER_VRAM``. Checks: byte-exact rows, the
transport taken (``nixl``), no staging reason, NIXL transfers posted, the
owner's bytes after the push.
"""

from __future__ import annotations

import asyncio
import multiprocessing

import pytest
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
)
from aio_datadist.testing import link_to, nixl_agent_of

try:
    from peers import NIXL_MISSING
except ImportError:  # run from tests/gpu alone
    NIXL_MISSING = ""

pytestmark = pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING or "nixl")
BLOCKS = CacheDesc(8, (64, 16, 8, 128), DataType.DT_FLOAT16, Placement.DEVICE)


def options(listen: bool) -> dict[str, str]:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.device_type = "cuda"
    cfg.transport = "nixl"
    if listen:
        cfg.listen_ip_info = "127.0.0.1:0"
    return cfg.generate_options()


def expected(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (64, 32768), dtype=torch.uint8, generator=gen) for _ in range(8)]


def rows(cache) -> list[torch.Tensor]:
    return [t.view(torch.uint8).view(64, -1).cpu() for t in cache.tensors]


def _owner(conn, seed: int) -> None:
    async def main() -> None:
        async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
            await dd.init(options(True))
            cache = dd.kv_cache_manager.allocate_blocks_cache(BLOCKS, BlocksCacheKey(1, 0))
            for t, want in zip(cache.tensors, expected(seed), strict=True):
                t.view(torch.uint8).view(64, -1).copy_(want)  # on the current stream: the owner fences it
            agent = nixl_agent_of(dd)
            await agent.registered(cache)
            conn.send((dd.listen_address[1], agent.vram_off, cache.cache_id in agent.local))
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, conn.recv)  # the peer pulled and pushed
            conn.send([r.clone() for r in rows(cache)])
    asyncio.run(main())


@pytest.mark.asyncio
async def test_a_device_cache_pull_and_push_between_processes_go_by_nixl_vram():
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    owner = ctx.Process(target=_owner, args=(theirs, 31))
    owner.start()
    try:
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, mine.poll, 120), "the owner process never started"
        port, off, registered = mine.recv()
        assert off is None and registered, f"the owner did not register its cache as VRAM: {off}"
        async with LLMDataDist(LLMRole.DECODER, 2) as dd:
            await dd.init(options(False))
            local = dd.kv_cache_manager.allocate_blocks_cache(BLOCKS)
            agent = nixl_agent_of(dd)
            await agent.registered(local)
            assert agent.vram_off is None and agent.local[local.cache_id].mem == "VRAM"
            before = rows(local)
            info = LLMClusterInfo()
            info.remote_cluster_id = 1
            info.append_remote_ip_info("127.0.0.1", port)
            await dd.link_clusters([info], timeout=20000)
            peer = link_to(dd, 1).nixl
            async with asyncio.timeout(10):
                while not peer.caches:
                    await asyncio.sleep(0.01)
            src_blocks, dst_blocks = [63, 0, 31, 7], [1, 2, 3, 60]
            await dd.kv_cache_manager.pull_blocks(BlocksCacheKey(1, 0), local, src_blocks, dst_blocks)
            want = expected(31)
            got = rows(local)
            for t in range(8):
                w = before[t].clone()
                for s, d in zip(src_blocks, dst_blocks, strict=True):
                    w[d] = want[t][s]
                assert torch.equal(got[t], w), t
            local.tensors[0].view(torch.uint8).view(64, -1)[9].fill_(0x5A)  # on our stream: we fence it
            await dd.kv_cache_manager.push_blocks(BlocksCacheKey(1, 0), local, [9], [40])
            stats = dd.stats().links[1]
            assert stats.kinds["pull"].transport == "nixl" and stats.kinds["push"].transport == "nixl"
            assert stats.nixl_vram_off is None
            assert agent.engine.posted >= 2
        mine.send(b"done")
        assert await loop.run_in_executor(None, mine.poll, 60)
        theirs_now = mine.recv()
        assert bool((theirs_now[0][40] == 0x5A).all())
        assert torch.equal(theirs_now[0][:40], expected(31)[0][:40])
    finally:
        owner.join(60)
        if owner.is_alive():
            owner.kill()
            owner.join()
        mine.close()
        theirs.close()
    assert owner.exitcode == 0
