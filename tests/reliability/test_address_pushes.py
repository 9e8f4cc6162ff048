"""A raw-address push (``transfer_cache_async`` by ``dst_addrs``) names one layer's K and V: the owner refuses
one naming more before it plans anything. Its plan is addresses x blocks runs, so one 48 KiB request of 4096
addresses and 2048 blocks held the owner's loop for about 0.8 s (a 512 KiB one, 2**30 runs, for minutes and
16 GiB)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from _harness import endpoint
from _rawpeer import RawLink, Refused
from peers import port_of

from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMRole, LLMStatusCode, Placement
from aio_datadist.wire import ReqFlag, Target

OWNER, PEER = 51, 52
DESC = CacheDesc(2, (16, 64), DataType.DT_FLOAT16, Placement.HOST)  # 2 tensors of 16 blocks of 128 bytes


def push(address, addrs: list[int], blocks: list[int]) -> object:
    """One raw-address push of 1 byte per (address, block): the count pushed, or the refusal's code."""
    fields = dict(channel=0, target_kind=int(Target.ADDRS), cluster_id=OWNER, cache_id=0, key_req_id=0, prefix_id=0,
                  model_id=0, batch_index=0, layer_first=-1, layer_last=-1, tensor_num_per_layer=2,
                  tensor_count=len(addrs), data_type=int(DESC.data_type.value), offset=1, nbytes=1,
                  flags=int(ReqFlag.BLOCKS), timeout_ms=2000, rows=tuple(addrs + blocks))
    with RawLink(address, PEER, OWNER, None) as raw:
        raw.connect()
        try:
            return raw.push(fields, lambda n: b"\x11" * n)
        except Refused as refusal:
            return refusal.code


@pytest.mark.asyncio(loop_factories=["asyncio"])  # the owner's planning, not the loop, is under test
async def test_a_push_naming_more_than_a_layers_addresses_is_refused_before_it_is_planned():
    async with endpoint(LLMRole.PROMPT, OWNER, listen=True, transport="tcp") as owner:
        cache = owner.kv_cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(OWNER))
        base = cache.tensor_addrs[0]
        before = [t.clone() for t in cache.tensors]
        refused = await asyncio.wait_for(asyncio.to_thread(push, port_of(owner), [base + 1] * 4096, [0] * 2048), 10)
        assert refused == LLMStatusCode.LLM_PARAM_INVALID
        assert all(t.equal(b) for t, b in zip(cache.tensors, before))
        # One layer's K and V still go: 1 byte at block 3 (of 1-byte blocks here) of tensor 0 and tensor 1.
        pushed = await asyncio.wait_for(asyncio.to_thread(push, port_of(owner), list(cache.tensor_addrs), [3]), 10)
        assert pushed == 2
        assert [int(t.view(torch.uint8).view(-1)[3]) for t in cache.tensors] == [0x11, 0x11]
