"""Device IPC between two processes on one GPU: a pull through the device IPC plane.

The owner runs in its own (spawned) process with a CUDA endpoint on a
same-host link; its library-allocated cache is a driver VMM allocation
exported over the share socket, which this process maps read-only. Checks:
byte-exact rows, the transport taken (``local``), no fallback reason, and
the owner's own bytes unchanged afterwards.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from _owner_process import BLOCKS, cuda_options, expected, owner_at, owner_process, rows

from aio_datadist import BlocksCacheKey, LLMDataDist, LLMRole
from aio_datadist.testing import runtime_of, usable_link


def options(listen: bool) -> dict[str, str]:
    return cuda_options(listen, "local", device_ipc="on")  # CUDA exports are off by default (aio.DeviceIpc=auto)


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
    async with owner_process(_owner, 21) as (conn, (port, exported)):
        assert exported, "the owner's cache is not a VMM export (see its log for the reason)"
        async with LLMDataDist(LLMRole.DECODER, 2) as dd:
            await dd.init(options(False))
            local = dd.kv_cache_manager.allocate_blocks_cache(BLOCKS)
            before = rows(local)
            await dd.link_clusters([owner_at(port)], timeout=10000)
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
        conn.send(b"done")
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, conn.poll, 60) and conn.recv() is True
