"""A device that never gets past its work before ``finalize`` gives up waiting (``runtime.QUIESCE_S``,
0.3 s here): run by ``test_device_finalize.py`` in a process of its own, since what it keeps is kept
for the life of the process by design; prints one JSON line. ``python device_stuck_child.py pull``: the
work is a pull's; ``... failed-submission``: a copy of a submission that failed after enqueueing it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import sys
import time
import warnings
import weakref

import torch

from peers import PROMPT_ID, fill, linked_pair

from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMException, Placement
from aio_datadist import runtime as runtime_module
from aio_datadist.devices.copies import cache_side, enqueue_rows
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


async def failed_submission() -> dict:
    """The only work left on the stuck stream is a copy of a submission that failed after enqueueing it: the
    memory it touches is held by the backend, which finalize must keep, without blocking past its bound."""
    runtime_module.QUIESCE_S = 0.3
    out: dict = {}
    async with linked_pair(prompt_config=HOST, decoder_config=HOST) as pair:
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        backend = runtime_of(pair.decoder).devices
        gate = backend.stream.gate()
        buf = torch.zeros(BLOCKS.size, dtype=torch.uint8)
        side = cache_side(dst, [0], 0, 64)

        def enqueue_then_fail() -> None:
            enqueue_rows(backend, side, side, 64, "batch", buf)
            raise RuntimeError("the driver refused the second batch")

        with contextlib.suppress(LLMException):
            backend.enqueue_and_notify(0, enqueue_then_fail, 0, buf, "a failed submission")
        held = weakref.ref(buf)
        buf = backend = None  # only the backend holds it now
        started = time.monotonic()
        await pair.decoder.finalize()
        out["finalize_s"] = round(time.monotonic() - started, 2)
        gc.collect()
        out["kept_held"] = held() is not None
        out["abandoned"] = len(runtime_module.ABANDONED)
        gate.open()
    return out


if __name__ == "__main__":
    work = failed_submission if sys.argv[1:] == ["failed-submission"] else main
    print(json.dumps(asyncio.run(work())), flush=True)
