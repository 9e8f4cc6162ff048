"""An asyncio program that returns from ``main`` with a TCP transfer in flight and no ``finalize``, for
``reliability/test_orphan_links.py``: argv ``pull|push asyncio|uvloop``. It prints, after the run returned,
how long the run took and whether both endpoints were finalized by the loop's shutdown."""

import asyncio
import json
import sys
import time

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

BIG = CacheDesc(2, (64, 1 << 20), DataType.DT_INT8, Placement.HOST)  # 128 MiB: still moving when main returns
KEEP: list[object] = []


def options(listen: bool, v2: bool) -> dict[str, str]:
    config = LLMConfig()
    config.device_id = 0
    config.transport = "tcp"
    config.enable_cache_manager = v2
    if listen:
        config.listen_ip_info = "127.0.0.1:0"
    return config.generate_options()


async def main(case: str) -> None:
    v2 = case == "push"
    prompt, decoder = LLMDataDist(LLMRole.PROMPT, 1), LLMDataDist(LLMRole.DECODER, 2)
    KEEP.extend([prompt, decoder])  # kept to the end: only the loop's shutdown can finalize them
    await prompt.init(options(True, v2))
    await decoder.init(options(False, v2))
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 1
    cluster.append_remote_ip_info(*prompt.listen_address)
    assert (await decoder.link_clusters([cluster], 3000))[0] == 0
    blocks = list(range(64))
    if case == "pull":
        prompt.kv_cache_manager.allocate_blocks_cache(BIG, BlocksCacheKey(1, 0))
        dst = decoder.kv_cache_manager.allocate_blocks_cache(BIG)
        moving = decoder.kv_cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, blocks, blocks, timeout=20000)
    else:
        memory = [torch.zeros(64, 1 << 20, dtype=torch.int8) for _ in range(4)]
        KEEP.append(memory)
        prompt.cache_manager.register_blocks_cache(BIG, [t.data_ptr() for t in memory[:2]], BlocksCacheKey(1, 0),
                                                   remote_accessible=True)
        src = decoder.cache_manager.register_blocks_cache(BIG, [t.data_ptr() for t in memory[2:]])
        moving = decoder.cache_manager.push_blocks(BlocksCacheKey(1, 0), src, blocks, blocks, timeout=20000)
    KEEP.append(asyncio.ensure_future(moving))
    await asyncio.sleep(0.01)


case, loop = sys.argv[1], sys.argv[2]
started = time.monotonic()
if loop == "uvloop":
    import uvloop

    uvloop.run(main(case))
else:
    asyncio.run(main(case))
finalized = [dd._endpoint.finalized for dd in KEEP[:2]]  # type: ignore[attr-defined]  # noqa: SLF001
print(json.dumps({"run_s": round(time.monotonic() - started, 2), "finalized": finalized}), flush=True)
