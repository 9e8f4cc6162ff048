"""A device that never gets past its work before ``finalize`` gives up waiting (``runtime.QUIESCE_S``,
0.3 s here): run by ``test_device_finalize.py`` in a process of its own, since what it keeps is kept
for the life of the process by design; prints one JSON line."""

from __future__ import annotations

import asyncio
import json
import time
import warnings

from peers import PROMPT_ID, fill, linked_pair

from aio_datadist import BlocksCacheKey, CacheDesc, DataType, Placement
from aio_datadist import runtime as runtime_module
from aio_datadist.testing import runtime_of

BLOCKS = CacheDesc(4, (6, 3, 512), DataType.DT_FLOAT16, Placement.DEVICE)
HOST = {"device_type": "host"}


async def main() -> dict:
    runtime_module.QUIESCE_S = 0.3
    out: dict = {}
    async with linked_pair(prompt_config=HOST, decoder_config=HOST) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        fill(src, 9)
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        backend = runtime_of(pair.decoder).devices
        gate = backend.stream.gate()  # never opened before finalize: the device is "stuck"
        pull = asyncio.ensure_future(pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, list(range(6)),
                                                         list(range(6)), timeout=20000))
        await asyncio.sleep(0.2)
        started = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            await pair.decoder.finalize()
        out["finalize_s"] = round(time.monotonic() - started, 2)
        out["resource_warning"] = any(issubclass(w.category, ResourceWarning) for w in caught)
        kept = runtime_module.ABANDONED
        out["kept_caches"] = len(kept[0][0]) if kept else 0
        out["kept_is_dst"] = bool(kept) and [id(t) for t in kept[0][0][0][0]] == [id(t) for t in dst.tensors]
        out["kept_work"] = len(kept[0][1]) if kept else 0
        gate.open()  # the device goes on, into memory that is still allocated
        await asyncio.wait([pull], timeout=5)
        out["pull_ended"] = pull.done()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())), flush=True)
