"""Device IPC between two processes on one GPU: a pull through the device IPC plane.

The owner runs in its own (spawned) process with a CUDA endpoint on a
same-host link; its library-allocated cache is a driver VMM allocation
exported over the share socket, which this process maps read-only. Checks:
byte-exact rows, the transport taken (``local``), no fallback reason, and
the owner's own bytes unchanged afterwards.
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
from aio_datadist.testing import runtime_of, usable_link

BLOCKS = CacheDesc(8, (64, 16, 8, 128), DataType.DT_FLOAT16, Placement.DEVICE)


def options(listen: bool) -> dict[str, str]:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.device_type = "cuda"
    cfg.device_ipc = "on"  # CUDA exports are off by default (aio.DeviceIpc=auto)
    cfg.transport = "local"
    if listen:
        cfg.listen_ip_info = "127.0.0.1:0"
    return cfg.generate_options()


def expected(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (64, 32768), dtype=torch.uint8, generator=gen) for _ in range(8)]


def _owner(conn, seed: int) -> None:
    async def main() -> None:
        async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
            await dd.init(options(True))
            cache = dd.kv_cache_manager.allocate_blocks_cache(BLOCKS, BlocksCacheKey(1, 0))
            for t, want in zip(cache.tensors, expected(seed), strict=True):
                t.view(torch.uint8).view(64, -1).copy_(want)
            torch.cuda.synchronize()
            conn.send((dd.listen_address[1], cache.device_export is not None))
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, conn.recv)  # the puller is done
            got = cache.tensors[0].view(torch.uint8).view(64, -1).cpu()
            conn.send(torch.equal(got, expected(seed)[0]))  # nothing of ours was written by the peer
    asyncio.run(main())


@pytest.mark.asyncio
async def test_a_pull_from_a_peer_process_on_the_same_gpu_goes_by_device_ipc():
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    owner = ctx.Process(target=_owner, args=(theirs, 21))
    owner.start()
    try:
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, mine.poll, 120), "the owner process never started"
        port, exported = mine.recv()
        assert exported, "the owner's cache is not a VMM export (see its log for the reason)"
        async with LLMDataDist(LLMRole.DECODER, 2) as dd:
            await dd.init(options(False))
            local = dd.kv_cache_manager.allocate_blocks_cache(BLOCKS)
            before = [t.view(torch.uint8).view(64, -1).cpu() for t in local.tensors]
            info = LLMClusterInfo()
            info.remote_cluster_id = 1
            info.append_remote_ip_info("127.0.0.1", port)
            await dd.link_clusters([info], timeout=10000)
            src_blocks, dst_blocks = [63, 0, 31, 7], [1, 2, 3, 60]
            await dd.kv_cache_manager.pull_blocks(BlocksCacheKey(1, 0), local, src_blocks, dst_blocks)
            stats = dd.stats().links[1]
            assert stats.kinds["pull"].transport == "local", stats.device_ipc_off
            assert stats.device_ipc_off is None
            want = expected(21)
            for t in range(8):
                w = before[t].clone()
                for s, d in zip(src_blocks, dst_blocks, strict=True):
                    w[d] = want[t][s]
                assert torch.equal(local.tensors[t].view(torch.uint8).view(64, -1).cpu(), w), t
            # The peer's cache is mapped here (read-only: cuMemSetAccess PROT_READ); the owner checks its bytes.
            peer = usable_link(dd, 1).local.device_regions
            assert peer and all(p.mapping.address for p in peer.values())
            assert runtime_of(dd).completions.pending_count() == 0
        mine.send(b"done")
        assert await loop.run_in_executor(None, mine.poll, 60) and mine.recv() is True
    finally:
        owner.join(60)
        if owner.is_alive():
            owner.kill()
            owner.join()
        mine.close()
        theirs.close()
    assert owner.exitcode == 0
