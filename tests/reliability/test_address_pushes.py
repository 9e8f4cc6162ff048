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
from aio_datadist import owner as owner_module
from aio_datadist.wire import ReqFlag, Target

OWNER, PEER = 51, 52
DESC = CacheDesc(2, (16, 64), DataType.DT_FLOAT16, Placement.HOST)  # 2 tensors of 16 blocks of 128 bytes


def push(address, addrs: list[int], blocks: list[int]) -> object:
    """One raw-address push of 1 byte per (address, block), or per address with no blocks: the count pushed, or
    the refusal's code."""
    fields = dict(channel=0, target_kind=int(Target.ADDRS), cluster_id=OWNER, cache_id=0, key_req_id=0, prefix_id=0,
                  model_id=0, batch_index=0, layer_first=-1, layer_last=-1, tensor_num_per_layer=2,
                  tensor_count=len(addrs), data_type=int(DESC.data_type.value), offset=1, nbytes=1,
                  flags=int(ReqFlag.BLOCKS) if blocks else 0, timeout_ms=2000, rows=tuple(addrs + blocks))
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


class _Planner:
    """The owner's ``_core`` with its run planner (``segments``) counted."""

    def __init__(self, core: object) -> None:
        self._core, self.planned = core, []

    def __getattr__(self, name: str) -> object:
        return getattr(self._core, name)

    def segments(self, addrs, blocks, *rest):
        self.planned.append((len(addrs), len(blocks)))
        return self._core.segments(addrs, blocks, *rest)


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_push_of_three_addresses_is_refused_with_nothing_planned(monkeypatch):
    """The bound is one layer's two addresses, and it is checked before any run is planned: 3 addresses (the
    first count past it) and 4096 are refused with the planner never called, and 2 are planned once. The test
    above checks the refusal of 4096 only, and passed with a bound of 64 or the check after the planning
    (audit, 2026-12-07). A push with no blocks is bound too, and before its addresses are looked up (the loop
    that builds addresses x blocks offsets): it passed with the bound checked only with blocks, or after that loop
    (audit, 2026-12-07)."""
    planner, looked, find = _Planner(owner_module._core), [], owner_module._find_tensor
    monkeypatch.setattr(owner_module, "_core", planner)
    monkeypatch.setattr(owner_module, "_find_tensor", lambda rt, a, b: looked.append(a) or find(rt, a, b))
    async with endpoint(LLMRole.PROMPT, OWNER, listen=True, transport="tcp") as owner:
        cache = owner.kv_cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(OWNER))
        base0, base1 = cache.tensor_addrs
        before = [t.clone() for t in cache.tensors]
        for addrs, blocks in (([base0, base1, base0 + 1], [3]), ([base0, base1, base0 + 1], []),
                              ([base0 + 1] * 4096, [0] * 2048)):
            refused = await asyncio.wait_for(asyncio.to_thread(push, port_of(owner), addrs, blocks), 10)
            assert refused == LLMStatusCode.LLM_PARAM_INVALID
            assert planner.planned == [] and looked == [], "a refused request was planned"
        assert all(t.equal(b) for t, b in zip(cache.tensors, before, strict=True))
        pushed = await asyncio.wait_for(asyncio.to_thread(push, port_of(owner), [base0, base1], [3]), 10)
        assert pushed == 2 and planner.planned == [(2, 1)]
        assert [int(t.view(torch.uint8).view(-1)[3]) for t in cache.tensors] == [0x11, 0x11]
