"""The NIXL reader (a pull without asking, ``transport/nixl_plane._read``) reads nothing into a destination released
while it awaited its loop turn or its ledger word (row 269).

Without NIXL here, the reader runs against a stand-in peer that answers the word at once and records the READ it
is asked to post: the reader's own checks are what is under test. Before, a release in the reader's first loop turn
went unseen and the READ was posted into memory the caller had back.
"""

from __future__ import annotations

import asyncio
import types

import pytest
import torch

from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMException, LLMStatusCode, Placement
from aio_datadist.transport import nixl_plane

from peers import linked_pair

WORD = 7
CACHE_ID = 3


class StandInPeer:
    """What ``_read`` asks of a NIXL peer: a granted cache, a ledger word that holds, READs done at once."""

    def __init__(self, region: object) -> None:
        self.caches = {CACHE_ID: region}
        self.ledger = object()
        self.agent = types.SimpleNamespace(scratch=[WORD], take_scratch=lambda: 0, give_scratch=lambda index: None)
        self.granted = types.SimpleNamespace(read_ended=lambda cache_id: None, tell_read=lambda *args: None)
        self.posted: list[tuple] = []

    def usable(self) -> bool:
        return True

    def read_started(self, cache_id: int) -> bool:
        return True

    def read_word(self, index: int, slot: int, what: str) -> None:
        return None  # done inside the posting call

    def read_rows(self, *args: object) -> None:
        self.posted.append(args)
        return None


@pytest.mark.asyncio
async def test_a_destination_released_in_the_readers_first_turn_gets_no_read() -> None:
    blocks = CacheDesc(2, (4, 256), DataType.DT_FLOAT16, Placement.HOST)
    async with linked_pair(link=False) as pair:
        mine = [torch.zeros(blocks.shape, dtype=torch.float16) for _ in range(blocks.num_tensors)]
        dst = pair.dm.register_blocks_cache(blocks, mine, BlocksCacheKey(2, 0))
        plan = types.SimpleNamespace(local=dst, local_first=0, local_rows=[0], total=512)
        region = types.SimpleNamespace(cache_id=CACHE_ID)
        peer = StandInPeer(region)
        read = asyncio.ensure_future(nixl_plane._read(peer, plan, region, 0, WORD, 0, [1], 2, 1000, "pull"))
        await asyncio.sleep(0)  # the reader waits for its loop turn
        pair.dm.deallocate_cache(dst)
        with pytest.raises(LLMException) as info:
            await asyncio.wait_for(read, 5)
        assert info.value.status_code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        assert peer.posted == []

        again = pair.dm.register_blocks_cache(blocks, mine, BlocksCacheKey(2, 0))  # alive: the READ is posted
        plan.local = again
        assert await asyncio.wait_for(nixl_plane._read(peer, plan, region, 0, WORD, 0, [1], 2, 1000, "pull"), 5)
        assert len(peer.posted) == 1
