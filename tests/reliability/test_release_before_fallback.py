"""A pull whose same-host read without asking gives the transfer back to asking (the owner stopped listing the
cache) after the caller released its destination: the release is seen, nothing is written (row 268).

Before, the release happened while the reader awaited its loop turn, before the transfer watched the cache for a
release; the reader returned to asking without checking, the asked pull then copied into the caller's memory
after ``deallocate_cache`` returned, and the pull said it succeeded."""
from __future__ import annotations

import asyncio

import pytest
import torch
from peers import PROMPT_ID, fill, linked_pair

from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMException, Placement
from aio_datadist.testing import usable_link


async def _outcome(call: asyncio.Future) -> str:
    try:
        await asyncio.wait_for(call, 10)
    except LLMException as exc:
        return exc.status_code.name
    return "succeeded"


@pytest.mark.asyncio
@pytest.mark.usefixtures("fork_server")
async def test_a_ledger_read_that_falls_back_to_asking_after_the_release_writes_nothing() -> None:
    """The pull reads without asking (ledger); in the loop pass before its copy, the owner re-binds the blocks
    key to a new cache (the ledger no longer lists the old one: the read falls back to asking) and the caller
    releases its registered destination. The pull must fail LLM_KV_CACHE_NOT_EXIST and write nothing into
    the caller's memory after deallocate_cache returned."""
    blocks = CacheDesc(4, (16, 8, 256), DataType.DT_FLOAT16, Placement.HOST)
    key = BlocksCacheKey(PROMPT_ID, 0)
    local = {"transport": "local"}
    async with linked_pair(link=False, prompt_config=local, decoder_config=local) as pair:
        old = pair.pm.allocate_blocks_cache(blocks, key)
        fill(old, 4)
        mine = [torch.zeros(blocks.shape, dtype=torch.float16) for _ in range(blocks.num_tensors)]
        dst = pair.dm.register_blocks_cache(blocks, mine)
        await pair.link()
        share = usable_link(pair.decoder, PROMPT_ID).local
        assert share is not None and share.listed_region(0) is not None  # the pull reads without asking
        pull = asyncio.ensure_future(pair.dm.pull_blocks(key, dst, [3, 0, 15], [1, 2, 3]))
        await asyncio.sleep(0)  # the pull waits for its loop turn before the copy
        pair.pm.deallocate_cache(old)  # the owner re-binds its key: the ledger no longer lists the old cache
        new = pair.pm.allocate_blocks_cache(blocks, key)
        for t in new.tensors:
            t.fill_(5.0)
        pair.dm.deallocate_cache(dst)  # the caller has its memory back
        for t in mine:
            t.fill_(7.0)
        outcome = await _outcome(pull)
        await asyncio.sleep(0.3)
        changed = sum(int((t != 7.0).sum()) for t in mine)
        assert (outcome, changed) == ("LLM_KV_CACHE_NOT_EXIST", 0)
