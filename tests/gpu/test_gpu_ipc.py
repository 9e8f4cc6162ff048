"""Same-GPU pulls between two processes through CUDA IPC handles: byte-exact, device to device."""

from __future__ import annotations

import asyncio
import multiprocessing

import pytest
import torch

from aio_datadist import CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole, Placement
from aio_datadist.devices import ipc
from aio_datadist.testing import runtime_of

BLOCKS = CacheDesc(8, (64, 16, 8, 128), DataType.DT_FLOAT16, Placement.DEVICE)


def options() -> dict[str, str]:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.device_type = "cuda"
    return cfg.generate_options()


def expected(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (64, 32768), dtype=torch.uint8, generator=gen) for _ in range(8)]


def _owner(conn, seed: int) -> None:
    async def main() -> None:
        async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
            await dd.init(options())
            cache = dd.kv_cache_manager.allocate_blocks_cache(BLOCKS)
            for t, want in zip(cache.tensors, expected(seed)):
                t.view(torch.uint8).view(64, -1).copy_(want)
            torch.cuda.synchronize()
            conn.send_bytes(ipc.export_cache(cache))
            conn.recv_bytes()  # the puller is done: only now may the memory go
    asyncio.run(main())


@pytest.mark.asyncio
async def test_pull_from_a_peer_process_on_the_same_gpu_is_byte_exact():
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    owner = ctx.Process(target=_owner, args=(theirs, 21))
    owner.start()
    try:
        async with LLMDataDist(LLMRole.DECODER, 2) as dd:
            await dd.init(options())
            rt = runtime_of(dd)
            local = dd.kv_cache_manager.allocate_blocks_cache(BLOCKS)
            local_before = [t.view(torch.uint8).view(64, -1).cpu() for t in local.tensors]
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, mine.poll, 120), "the owner process never exported"
            peer = ipc.open_export(mine.recv_bytes(), rt.device)
            try:
                src_blocks, dst_blocks = [63, 0, 31, 7], [1, 2, 3, 60]
                moved = await ipc.pull_rows(rt, peer, src_blocks, local, dst_blocks, 0, local.layout.row_bytes,
                                            10000, first=2, count=5)
                assert moved == 4 * 5 * 32768
                want = expected(21)
                for t in range(8):
                    got = local.tensors[t].view(torch.uint8).view(64, -1).cpu()
                    w = local_before[t].clone()
                    if 2 <= t < 7:
                        for s, d in zip(src_blocks, dst_blocks):
                            w[d] = want[t][s]
                    assert torch.equal(got, w), t
                with pytest.raises(AssertionError):
                    peer.side([64], 0, 32768)
            finally:
                peer.close()
                del peer
            mine.send_bytes(b"done")
    finally:
        owner.join(60)
        if owner.is_alive():
            owner.kill()
            owner.join()
        mine.close()
        theirs.close()
    assert owner.exitcode == 0
