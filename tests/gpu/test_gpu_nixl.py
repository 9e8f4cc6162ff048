"""NIXL between two processes on one GPU: device caches registered as VRAM, a pull and a push by NIXL.

The owner runs in its own (spawned) process with a CUDA endpoint on a NIXL
link; both ends' device caches are registered with their agent as ``VRAM``
on GPU 0 and offered with ``OFFER_VRAM``. Checks: byte-exact rows, the
transport taken (``nixl``), no staging reason, NIXL transfers posted, the
owner's bytes after the push.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from _owner_process import BLOCKS, cuda_options, expected, owner_at, owner_process, rows

from aio_datadist import BlocksCacheKey, LLMDataDist, LLMRole
from aio_datadist.testing import link_to, nixl_agent_of

try:
    from peers import NIXL_MISSING
except ImportError:  # run from tests/gpu alone
    NIXL_MISSING = ""

pytestmark = pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING or "nixl")


def options(listen: bool) -> dict[str, str]:
    return cuda_options(listen, "nixl")


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
    async with owner_process(_owner, 31) as (conn, (port, off, registered)):
        assert off is None and registered, f"the owner did not register its cache as VRAM: {off}"
        async with LLMDataDist(LLMRole.DECODER, 2) as dd:
            await dd.init(options(False))
            local = dd.kv_cache_manager.allocate_blocks_cache(BLOCKS)
            agent = nixl_agent_of(dd)
            await agent.registered(local)
            assert agent.vram_off is None and agent.local[local.cache_id].mem == "VRAM"
            before = rows(local)
            await dd.link_clusters([owner_at(port)], timeout=20000)
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
        conn.send(b"done")
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, conn.poll, 60)
        theirs_now = conn.recv()
        assert bool((theirs_now[0][40] == 0x5A).all())
        assert torch.equal(theirs_now[0][:40], expected(31)[0][:40])
