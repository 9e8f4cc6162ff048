"""``enable_remote_cache_accessible``: whether peers may read and write an endpoint's caches.

As in LLM-DataDist's CacheManager engine (which forces it on), an options
dict without ``llm.EnableRemoteCacheAccessible`` means on. An endpoint that
sets it to False still links, and still pulls from and pushes to peers that
have it on, but answers every peer request for its own caches with
``LLM_FEATURE_NOT_ENABLED`` before a byte moves, and shares none of its
caches with a same-host peer.
"""

from __future__ import annotations

import pytest
import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheIndex,
    CacheKey,
    DataType,
    LayerSynchronizer,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferConfig,
)
from aio_datadist.testing import engine_state, link_to, nixl_agent_of, registry_of
from peers import DECODER_ID, PROMPT_ID, TRANSPORTS, cluster_info, endpoint, fill, options, port_of, snapshot

NIXL = [t for t in TRANSPORTS if t not in ("tcp", "local")]

pytestmark = pytest.mark.asyncio

S = LLMStatusCode
ROWS = CacheDesc(4, (3, 256), DataType.DT_FLOAT16, Placement.HOST)
BLOCKS = CacheDesc(4, (8, 4, 16), DataType.DT_FLOAT16, Placement.HOST)


def closed_off(options: dict) -> dict:
    return {**options, "llm.EnableRemoteCacheAccessible": "0"}


async def refused(awaitable) -> str:
    with pytest.raises(LLMException) as info:
        await awaitable
    assert info.value.status_code == S.LLM_FEATURE_NOT_ENABLED
    assert "EnableRemoteCacheAccessible" in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("transport", ["tcp", "auto", *NIXL])
async def test_a_closed_off_prompt_serves_no_cache_but_still_pushes(transport):
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as prompt, \
            endpoint(LLMRole.DECODER, DECODER_ID, transport=transport) as dec:
        await prompt.init(closed_off(options(listen=True, transport=transport)))
        pm, dm = prompt.kv_cache_manager, dec.kv_cache_manager
        rows = pm.allocate_cache(ROWS, [CacheKey(PROMPT_ID, 1)])
        p_blocks = pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID))
        values = fill(rows, 1)
        block_values = fill(p_blocks, 2)
        d_rows = dm.allocate_cache(ROWS)
        d_blocks = dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID))
        assert (await dec.link_clusters([cluster_info(PROMPT_ID, port_of(prompt))]))[0] == S.LLM_SUCCESS
        before = snapshot(d_rows)
        await refused(dm.pull_cache(CacheKey(PROMPT_ID, 1), d_rows))
        await refused(dm.pull_blocks(BlocksCacheKey(PROMPT_ID), d_blocks, [0, 1], [0, 1]))
        assert all(torch.equal(d, b) for d, b in zip(d_rows.tensors, before))
        if transport == "auto":  # the decoder was given no mapping of the prompt's memory
            assert link_to(dec, PROMPT_ID).local.region(rows.cache_id) is None
        if transport == "nixl":  # nor the NIXL metadata that would let it read the prompt's memory
            assert link_to(dec, PROMPT_ID).nixl.caches == {}
            assert not link_to(dec, PROMPT_ID).nixl.agent_loaded  # (the offers alone passed without this)
        # its own pushes to a peer that is open still go, and the key it did not serve is still bound
        await pm.push_blocks(BlocksCacheKey(DECODER_ID), p_blocks, [3], [5])
        assert all(torch.equal(d[5], v[3]) for d, v in zip(d_blocks.tensors, block_values))
        if transport == "nixl":  # a NIXL WRITE whose notification reached a peer that never saw our metadata
            assert nixl_agent_of(prompt).engine.posted == 1
            # nor a cache registered after the link (offered by registration, not by the link's set-up)
            late = pm.allocate_cache(ROWS, [CacheKey(PROMPT_ID, 2)])
            await nixl_agent_of(prompt).registered(late)
            await refused(dm.pull_cache(CacheKey(PROMPT_ID, 2), d_rows))  # its answer follows any offer
            assert link_to(dec, PROMPT_ID).nixl.offers_in.declared == {}
        assert registry_of(prompt).by_key((1, 2**64 - 1, 0)) is not None
        assert engine_state(prompt)["claimed keys"] == 0  # refused before its key was claimed
        assert all(torch.equal(t, v) for t, v in zip(rows.tensors, values))


@pytest.mark.parametrize("transport", ["tcp", "auto", *NIXL])
async def test_a_closed_off_decoder_takes_no_push_but_still_pulls(transport):
    async with endpoint(LLMRole.PROMPT, PROMPT_ID, listen=True, transport=transport) as prompt, \
            LLMDataDist(LLMRole.DECODER, DECODER_ID) as dec:
        await dec.init(closed_off(options(transport=transport)))
        pm, dm = prompt.kv_cache_manager, dec.kv_cache_manager
        rows = pm.allocate_cache(ROWS, [CacheKey(PROMPT_ID, 1)])
        p_blocks = pm.allocate_blocks_cache(BLOCKS)
        values = fill(rows, 3)
        fill(p_blocks, 4)
        d_rows = dm.allocate_cache(ROWS)
        d_blocks = dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID))
        assert (await dec.link_clusters([cluster_info(PROMPT_ID, port_of(prompt))]))[0] == S.LLM_SUCCESS
        before = snapshot(d_blocks)
        await refused(pm.push_blocks(BlocksCacheKey(DECODER_ID), p_blocks, [0, 1], [2, 3]))
        assert all(torch.equal(d, b) for d, b in zip(d_blocks.tensors, before))
        if transport == "auto":
            assert link_to(prompt, DECODER_ID).local.region(d_blocks.cache_id) is None
        if transport == "nixl":
            assert link_to(prompt, DECODER_ID).nixl.caches == {}
        await dm.pull_cache(CacheKey(PROMPT_ID, 1), d_rows, batch_index=1)
        assert all(torch.equal(d[1], v[0]) for d, v in zip(d_rows.tensors, values))
        if transport == "nixl":
            assert nixl_agent_of(dec).engine.posted == 1


class Ready(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


@pytest.mark.parametrize("transport", ["tcp", "auto"])
async def test_a_closed_off_decoder_refuses_every_key_kind_and_shares_caches_made_after_linking_neither(transport):
    """Every kind of target, not only a blocks key: a push by cache id and index, a layer-wise push by raw
    addresses (``TransferConfig``); and a cache allocated after the link is no more shared than one allocated
    before (the tests above push by blocks key only, and allocate everything before linking)."""
    async with endpoint(LLMRole.PROMPT, PROMPT_ID, listen=True, transport=transport) as prompt, \
            LLMDataDist(LLMRole.DECODER, DECODER_ID) as dec:
        await dec.init(closed_off(options(transport=transport)))
        pm, dm = prompt.kv_cache_manager, dec.kv_cache_manager
        p_rows = pm.allocate_cache(ROWS, [CacheKey(PROMPT_ID, 1)])
        p_blocks = pm.allocate_blocks_cache(BLOCKS)
        fill(p_rows, 5)
        fill(p_blocks, 6)
        assert (await dec.link_clusters([cluster_info(PROMPT_ID, port_of(prompt))]))[0] == S.LLM_SUCCESS
        d_rows = dm.allocate_cache(ROWS)  # after the link
        d_blocks = dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID))
        fill(d_rows, 7)
        fill(d_blocks, 8)
        before = snapshot(d_rows) + snapshot(d_blocks)
        if transport == "auto":
            assert link_to(prompt, DECODER_ID).local.region(d_blocks.cache_id) is None
            assert link_to(prompt, DECODER_ID).local.region(d_rows.cache_id) is None
        await refused(pm.push_cache(CacheIndex(DECODER_ID, d_rows.cache_id, 1), p_rows))
        await refused(pm.push_blocks(CacheIndex(DECODER_ID, d_blocks.cache_id), p_blocks, [0], [1]))
        await refused(pm.push_blocks(BlocksCacheKey(DECODER_ID), p_blocks, [0], [1]))
        addrs = list(d_blocks.tensor_addrs[:2])
        task = pm.transfer_cache_async(p_blocks, Ready(), [TransferConfig(DECODER_ID, addrs, range(0, 1))], [0], [1])
        try:
            result = await task
        except LLMException as exc:
            result = [exc.status_code]
        assert result == [S.LLM_FEATURE_NOT_ENABLED], result
        assert all(torch.equal(a, b) for a, b in zip(d_rows.tensors + d_blocks.tensors, before, strict=True))
