"""pull_cache, pull_blocks, push_blocks and push_cache between a linked PROMPT and DECODER."""

from __future__ import annotations

import asyncio

import pytest
import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheIndex,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    KvCacheExtParam,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from peers import (
    TRANSPORT,
    TRANSPORTS,
    BLOCKS_DESC,
    CACHE_DESC,
    DECODER_ID,
    PROMPT_ID,
    cluster_info,
    endpoint,
    fill,
    linked_pair,
    port_of,
    snapshot,
)

S = LLMStatusCode
NO_ID = 2**64 - 1
pytestmark = pytest.mark.asyncio


@pytest.fixture(autouse=True, params=TRANSPORTS)
def transport(request):
    """Every transfer here runs over TCP data channels, same-host shared memory and NIXL."""
    TRANSPORT["default"] = request.param
    yield request.param
    TRANSPORT["default"] = "tcp"


async def expect_code(code: LLMStatusCode, awaitable) -> LLMException:
    with pytest.raises(LLMException) as exc:
        await awaitable
    assert exc.value.status_code == code, exc.value
    return exc.value


# -- pull_cache -------------------------------------------------------------------


async def test_pull_cache_by_key_and_by_id_and_index():
    async with linked_pair() as pair:
        src = pair.pm.allocate_cache(CACHE_DESC, [CacheKey(PROMPT_ID, 10), CacheKey(PROMPT_ID, 11)])
        values = fill(src, 1)
        dst = pair.dm.allocate_cache(CACHE_DESC)
        before = snapshot(dst)

        await pair.dm.pull_cache(CacheKey(PROMPT_ID, 11), dst, batch_index=2)
        for d, v, b in zip(dst.tensors, values, before):
            assert torch.equal(d[2], v[1]) and torch.equal(d[:2], b[:2])

        await pair.dm.pull_cache(CacheKeyByIdAndIndex(PROMPT_ID, src.cache_id, 2), dst)  # an unkeyed row
        await pair.dm.pull_cache(CacheKey(cluster_id=PROMPT_ID, req_id=10), dst, 1)
        for d, v in zip(dst.tensors, values):
            assert torch.equal(d[0], v[2]) and torch.equal(d[1], v[0]) and torch.equal(d[2], v[1])


async def test_pull_cache_size_moves_the_head_of_each_row():
    async with linked_pair() as pair:
        src = pair.pm.allocate_cache(CACHE_DESC, [CacheKey(PROMPT_ID, 10)])
        values = fill(src, 1)
        dst = pair.dm.allocate_cache(CACHE_DESC)
        before = snapshot(dst)
        await pair.dm.pull_cache(CacheKey(PROMPT_ID, 10), dst, batch_index=1, size=100)  # bytes per tensor
        for d, v, b in zip(dst.tensors, values, before):
            assert torch.equal(d[1, :50], v[0, :50])
            assert torch.equal(d[1, 50:], b[1, 50:]) and torch.equal(d[0], b[0]) and torch.equal(d[2], b[2])
        # a smaller row on the decoder: size picks how much of the larger remote row to take
        small = pair.dm.allocate_cache(CacheDesc(4, (1, 64), DataType.DT_FLOAT16, Placement.HOST))
        await pair.dm.pull_cache(CacheKeyByIdAndIndex(PROMPT_ID, src.cache_id, 0), small, size=128)
        assert all(torch.equal(d[0], v[0, :64]) for d, v in zip(small.tensors, values))


async def test_pull_cache_layer_ranges():
    async with linked_pair() as pair:
        src = pair.pm.allocate_cache(CACHE_DESC)
        values = fill(src, 1)
        dst = pair.dm.allocate_cache(CACHE_DESC)
        key = CacheKeyByIdAndIndex(PROMPT_ID, src.cache_id, 1)
        empty = torch.zeros_like(dst.tensors[0])
        # layer 1 (tensors 2, 3) into layer 0 (tensors 0, 1)
        await pair.dm.pull_cache(key, dst, 0, src_layer_range=range(1, 2), dst_layer_range=range(0, 1))
        got = dst.tensors
        assert torch.equal(got[0][0], values[2][1]) and torch.equal(got[1][0], values[3][1])
        assert torch.equal(got[2], empty) and torch.equal(got[3], empty)
        # one tensor per layer: tensors 1..2 into tensors 2..3; only a source range: same-length dst
        await pair.dm.pull_cache(key, dst, 1, src_layer_range=range(1, 3), dst_layer_range=range(2, 4),
                                 tensor_num_per_layer=1)
        assert torch.equal(got[2][1], values[1][1]) and torch.equal(got[3][1], values[2][1])
        dst2 = pair.dm.allocate_cache(CACHE_DESC)
        await pair.dm.pull_cache(key, dst2, 2, src_layer_range=range(0, 2))  # both layers, tensors 0..3
        assert all(torch.equal(d[2], v[1]) for d, v in zip(dst2.tensors, values))
        # a 2-tensor decoder cache takes layer 1 of a 4-tensor prompt cache
        half = pair.dm.allocate_cache(CacheDesc(2, (3, 256), DataType.DT_FLOAT16, Placement.HOST))
        await pair.dm.pull_cache(key, half, 0, src_layer_range=range(1, 2), dst_layer_range=range(0, 1))
        assert torch.equal(half.tensors[0][0], values[2][1]) and torch.equal(half.tensors[1][0], values[3][1])


# -- pull_blocks -------------------------------------------------------------------


async def test_pull_blocks_by_blocks_key():
    async with linked_pair(link=False) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(PROMPT_ID, 3))
        dst = pair.dm.allocate_blocks_cache(BLOCKS_DESC)
        await pair.link()
        values = fill(src, 1)
        before = snapshot(dst)
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 3), dst, [0, 3, 5, 6], [7, 1, 2, 3])
        for d, v, b in zip(dst.tensors, values, before):
            assert torch.equal(d[7], v[0]) and torch.equal(d[1], v[3])
            assert torch.equal(d[2:4], v[5:7])  # a contiguous run on both sides
            assert torch.equal(d[0], b[0]) and torch.equal(d[4:7], b[4:7])
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 3), dst, list(range(8)), list(range(8)))
        assert all(torch.equal(d, v) for d, v in zip(dst.tensors, values))


async def test_pull_blocks_layer_ranges():
    async with linked_pair() as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(PROMPT_ID))
        values = fill(src, 1)
        dst = pair.dm.allocate_blocks_cache(BLOCKS_DESC)
        got = dst.tensors
        empty = torch.zeros_like(got[0])
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [4], [5],
                                  src_layer_range=range(0, 1), dst_layer_range=range(1, 2))
        assert torch.equal(got[2][5], values[0][4]) and torch.equal(got[3][5], values[1][4])
        assert torch.equal(got[0], empty) and torch.equal(got[1], empty)
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [1, 2], [1, 2],
                                  src_layer_range=range(3, 4), dst_layer_range=range(0, 1), tensor_num_per_layer=1)
        assert torch.equal(got[0][1:3], values[3][1:3])
        assert torch.equal(got[1], empty)


async def test_pull_contiguous_cache_into_blocks():
    """A CacheKey (or id and index) and empty src_blocks: one remote row spread over dst_blocks."""
    async with linked_pair() as pair:
        # one row of CACHE_DESC (512 B per tensor) is four blocks of BLOCKS_DESC (128 B)
        src = pair.pm.allocate_cache(CACHE_DESC, [CacheKey(PROMPT_ID, 10), CacheKey(PROMPT_ID, 11)])
        values = fill(src, 1)
        dst = pair.dm.allocate_blocks_cache(BLOCKS_DESC)
        before = snapshot(dst)
        await pair.dm.pull_blocks(CacheKey(PROMPT_ID, 11), dst, (), [6, 0, 3, 5])
        for d, v, b in zip(dst.tensors, values, before):
            row = v[1].view(4, 4, 16)
            assert torch.equal(d[6], row[0]) and torch.equal(d[0], row[1])
            assert torch.equal(d[3], row[2]) and torch.equal(d[5], row[3])
            assert torch.equal(d[1:3], b[1:3]) and torch.equal(d[4], b[4]) and torch.equal(d[7], b[7])
        # by id and index, the first two blocks' worth of row 2 only, and one layer
        await pair.dm.pull_blocks(CacheKeyByIdAndIndex(PROMPT_ID, src.cache_id, 2), dst, [], [1, 2],
                                  src_layer_range=range(1, 2), dst_layer_range=range(1, 2))
        for index in (2, 3):
            row = values[index][2].view(4, 4, 16)
            assert torch.equal(dst.tensors[index][1:3], row[0:2])
        await expect_code(S.LLM_KV_CACHE_NOT_EXIST, pair.dm.pull_blocks(CacheKey(PROMPT_ID, 11), dst, (), [0]))


# -- push_blocks, push_cache ---------------------------------------------------------


async def test_push_blocks_to_cache_index_and_blocks_key():
    async with linked_pair(link=False) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS_DESC)
        dst = pair.dm.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(DECODER_ID, 4))
        await pair.link()
        values = fill(src, 1)
        before = snapshot(dst)
        await pair.pm.push_blocks(CacheIndex(DECODER_ID, dst.cache_id), src, [0, 1, 7], [5, 6, 0])
        for d, v, b in zip(dst.tensors, values, before):
            assert torch.equal(d[5:7], v[0:2]) and torch.equal(d[0], v[7]) and torch.equal(d[1:5], b[1:5])
        await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID, 4), src, [3], [7])
        assert all(torch.equal(d[7], v[3]) for d, v in zip(dst.tensors, values))


async def test_push_blocks_ext_param_layer_ranges():
    """KvCacheExtParam ranges are inclusive pairs, as in the C++ PushKvBlocks."""
    async with linked_pair() as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS_DESC)
        values = fill(src, 1)
        dst = pair.dm.allocate_blocks_cache(BLOCKS_DESC)
        got = dst.tensors
        empty = torch.zeros_like(got[0])
        target = CacheIndex(DECODER_ID, dst.cache_id)
        await pair.pm.push_blocks(target, src, [2], [3], KvCacheExtParam((1, 1), (0, 0)))
        assert torch.equal(got[0][3], values[2][2]) and torch.equal(got[1][3], values[3][2])
        assert torch.equal(got[2], empty) and torch.equal(got[3], empty)
        await pair.pm.push_blocks(target, src, [4, 5], [4, 5], KvCacheExtParam((0, 1), (2, 3), 1))
        assert torch.equal(got[2][4:6], values[0][4:6]) and torch.equal(got[3][4:6], values[1][4:6])
        await pair.pm.push_blocks(target, src, [6], [6], KvCacheExtParam((0, 1), (0, 1), 2))  # all layers
        await pair.pm.push_blocks(target, src, [7], [7], KvCacheExtParam((-1, -1), (-1, -1), 4))
        assert all(torch.equal(d[6:8], v[6:8]) for d, v in zip(got, values))
        # a 2-tensor (one layer) decoder cache takes layer 1 of the prompt's blocks
        one_layer = pair.dm.allocate_blocks_cache(CacheDesc(2, (8, 4, 16), DataType.DT_FLOAT16, Placement.HOST))
        await pair.pm.push_blocks(CacheIndex(DECODER_ID, one_layer.cache_id), src, [1], [2],
                                  KvCacheExtParam((1, 1), (0, 0)))
        assert torch.equal(one_layer.tensors[0][2], values[2][1]) and torch.equal(one_layer.tensors[1][2], values[3][1])


async def test_push_cache():
    async with linked_pair() as pair:
        src = pair.pm.allocate_cache(CACHE_DESC)
        values = fill(src, 1)
        dst = pair.dm.allocate_cache(CACHE_DESC)
        before = snapshot(dst)
        await pair.pm.push_cache(CacheIndex(DECODER_ID, dst.cache_id, 1), src, src_batch_index=2)
        for d, v, b in zip(dst.tensors, values, before):
            assert torch.equal(d[1], v[2]) and torch.equal(d[0], b[0]) and torch.equal(d[2], b[2])
        await pair.pm.push_cache(CacheKeyByIdAndIndex(DECODER_ID, dst.cache_id, 2), src, 0,
                                 KvCacheExtParam((0, 0), (1, 1)))
        got = dst.tensors
        assert torch.equal(got[2][2], values[0][0]) and torch.equal(got[3][2], values[1][0])
        assert torch.equal(got[0][2], before[0][2]) and torch.equal(got[1][2], before[1][2])


async def test_mix_role_pulls_and_pushes():
    async with endpoint(LLMRole.MIX, PROMPT_ID, listen=True) as a, endpoint(LLMRole.MIX, DECODER_ID) as b:
        a_cache = a.kv_cache_manager.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(PROMPT_ID))
        b_cache = b.kv_cache_manager.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(DECODER_ID))
        assert (await b.link_clusters([cluster_info(PROMPT_ID, port_of(a))]))[0] == S.LLM_SUCCESS
        a_values, b_values = fill(a_cache, 1), fill(b_cache, 2)
        await b.kv_cache_manager.pull_blocks(BlocksCacheKey(PROMPT_ID), b_cache, [0], [1])
        await b.kv_cache_manager.push_blocks(BlocksCacheKey(PROMPT_ID), b_cache, [2], [3])
        await a.kv_cache_manager.pull_blocks(BlocksCacheKey(DECODER_ID), a_cache, [4], [5])
        await a.kv_cache_manager.push_blocks(BlocksCacheKey(DECODER_ID), a_cache, [6], [7])
        for at, bt, av, bv in zip(a_cache.tensors, b_cache.tensors, a_values, b_values):
            assert torch.equal(bt[1], av[0]) and torch.equal(at[3], bv[2])
            assert torch.equal(at[5], bv[4]) and torch.equal(bt[7], av[6])


async def test_concurrent_transfers_on_one_link():
    """More transfers at once than the link has data channels, both directions."""
    async with linked_pair() as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(PROMPT_ID))
        rows = pair.pm.allocate_cache(CACHE_DESC, [CacheKey(PROMPT_ID, r) for r in range(3)])
        dst = pair.dm.allocate_blocks_cache(BLOCKS_DESC)
        dst_rows = pair.dm.allocate_cache(CACHE_DESC)
        pushed = pair.dm.allocate_blocks_cache(BLOCKS_DESC)
        values, row_values = fill(src, 1), fill(rows, 2)
        await asyncio.gather(
            *(pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [b], [7 - b]) for b in range(8)),
            *(pair.dm.pull_cache(CacheKey(PROMPT_ID, r), dst_rows, 2 - r) for r in range(3)),
            *(pair.pm.push_blocks(CacheIndex(DECODER_ID, pushed.cache_id), src, [b], [b]) for b in range(8)),
        )
        for d, p, v in zip(dst.tensors, pushed.tensors, values):
            assert torch.equal(d, v.flip(0)) and torch.equal(p, v)
        assert all(torch.equal(d, v.flip(0)) for d, v in zip(dst_rows.tensors, row_values))


# -- keys -------------------------------------------------------------------------------


async def test_a_pull_by_key_consumes_the_key():
    async with linked_pair() as pair:
        src = pair.pm.allocate_cache(CACHE_DESC, [CacheKey(PROMPT_ID, 10), CacheKey(PROMPT_ID, 11)])
        fill(src, 1)
        dst = pair.dm.allocate_cache(CACHE_DESC)
        await pair.dm.pull_cache(CacheKey(PROMPT_ID, 10), dst)
        await expect_code(S.LLM_KV_CACHE_NOT_EXIST, pair.dm.pull_cache(CacheKey(PROMPT_ID, 10), dst))
        # a pull by id and index of a keyed row consumes that row's key as well ...
        await pair.dm.pull_cache(CacheKeyByIdAndIndex(PROMPT_ID, src.cache_id, 1), dst)
        await expect_code(S.LLM_KV_CACHE_NOT_EXIST, pair.dm.pull_cache(CacheKey(PROMPT_ID, 11), dst))
        # ... while the cache itself stays addressable by id until deallocated
        await pair.dm.pull_cache(CacheKeyByIdAndIndex(PROMPT_ID, src.cache_id, 1), dst)
        pair.pm.deallocate_cache(src)
        await expect_code(S.LLM_KV_CACHE_NOT_EXIST,
                          pair.dm.pull_cache(CacheKeyByIdAndIndex(PROMPT_ID, src.cache_id, 1), dst))


async def test_a_deallocated_cache_lives_until_its_keys_are_pulled():
    async with linked_pair() as pair:
        src = pair.pm.allocate_cache(CACHE_DESC, [CacheKey(PROMPT_ID, 10), CacheKey(PROMPT_ID, 11)])
        values = fill(src, 1)
        pair.pm.deallocate_cache(src)
        dst = pair.dm.allocate_cache(CACHE_DESC)
        by_id = CacheKeyByIdAndIndex(PROMPT_ID, src.cache_id, 0)
        await expect_code(S.LLM_KV_CACHE_NOT_EXIST, pair.dm.pull_cache(by_id, dst))  # its id is gone
        await pair.dm.pull_cache(CacheKey(PROMPT_ID, 11), dst, 0)
        await pair.dm.pull_cache(CacheKey(PROMPT_ID, 10), dst, 1)
        for d, v in zip(dst.tensors, values):
            assert torch.equal(d[0], v[1]) and torch.equal(d[1], v[0])
        await expect_code(S.LLM_KV_CACHE_NOT_EXIST, pair.dm.pull_cache(CacheKey(PROMPT_ID, 10), dst))
        assert src.alive is False  # its memory went with its last key


async def test_a_layer_range_pull_consumes_the_key_once_every_tensor_was_pulled():
    async with linked_pair() as pair:
        src = pair.pm.allocate_cache(CACHE_DESC, [CacheKey(PROMPT_ID, 10)])
        values = fill(src, 1)
        dst = pair.dm.allocate_cache(CACHE_DESC)
        key = CacheKey(PROMPT_ID, 10)
        await pair.dm.pull_cache(key, dst, src_layer_range=range(0, 1), dst_layer_range=range(0, 1))
        await pair.dm.pull_cache(key, dst, src_layer_range=range(0, 1), dst_layer_range=range(0, 1))
        await pair.dm.pull_cache(key, dst, src_layer_range=range(3, 4), dst_layer_range=range(3, 4),
                                 tensor_num_per_layer=1)
        await pair.dm.pull_cache(key, dst, src_layer_range=range(2, 3), dst_layer_range=range(2, 3),
                                 tensor_num_per_layer=1)  # the last tensor: the key goes
        await expect_code(S.LLM_KV_CACHE_NOT_EXIST, pair.dm.pull_cache(key, dst))
        assert all(torch.equal(d[0], v[0]) for d, v in zip(dst.tensors, values))


async def test_registered_caches_and_prefix_keys_keep_their_keys():
    async with linked_pair() as pair:
        memory = [torch.zeros(CACHE_DESC.shape, dtype=torch.float16) for _ in range(4)]
        registered = pair.pm.register_cache(CACHE_DESC, memory, [CacheKey(PROMPT_ID, 10)])
        values = fill(registered, 1)
        prefix = CacheKey(PROMPT_ID, NO_ID, prefix_id=7)
        owned = pair.pm.allocate_cache(CACHE_DESC, [prefix])
        fill(owned, 2)
        dst = pair.dm.allocate_cache(CACHE_DESC)
        for _ in range(2):
            await pair.dm.pull_cache(CacheKey(PROMPT_ID, 10), dst)
            await pair.dm.pull_cache(prefix, dst, 1)
        assert all(torch.equal(d[0], v[0]) for d, v in zip(dst.tensors, values))
        pair.pm.remove_cache_key(prefix)
        await expect_code(S.LLM_KV_CACHE_NOT_EXIST, pair.dm.pull_cache(prefix, dst))


async def test_remove_cache_key():
    async with linked_pair() as pair:
        src = pair.pm.allocate_cache(CACHE_DESC, [CacheKey(PROMPT_ID, 10), CacheKey(PROMPT_ID, 11)])
        dst = pair.dm.allocate_cache(CACHE_DESC)
        pair.pm.remove_cache_key(CacheKey(PROMPT_ID, 10))
        pair.pm.remove_cache_key(CacheKey(PROMPT_ID, 10))  # no longer bound: a no-op
        await expect_code(S.LLM_KV_CACHE_NOT_EXIST, pair.dm.pull_cache(CacheKey(PROMPT_ID, 10), dst))
        await pair.dm.pull_cache(CacheKey(PROMPT_ID, 11), dst)
        with pytest.raises(LLMException) as exc:
            pair.dm.remove_cache_key(CacheKey(PROMPT_ID, 11))  # a DECODER offers no keys to remove
        assert exc.value.status_code == S.LLM_PARAM_INVALID
        assert src.cache_id == 1


async def test_one_key_pulled_twice_at_once_goes_to_one_puller():
    async with linked_pair() as pair:
        src = pair.pm.allocate_cache(CACHE_DESC, [CacheKey(PROMPT_ID, 10)])
        values = fill(src, 1)
        first = pair.dm.allocate_cache(CACHE_DESC)
        second = pair.dm.allocate_cache(CACHE_DESC)
        outcomes = await asyncio.gather(pair.dm.pull_cache(CacheKey(PROMPT_ID, 10), first),
                                        pair.dm.pull_cache(CacheKey(PROMPT_ID, 10), second),
                                        return_exceptions=True)
        winners = [o for o in outcomes if o is None]
        losers = [o for o in outcomes if isinstance(o, LLMException)]
        assert len(winners) == 1 and len(losers) == 1
        assert losers[0].status_code == S.LLM_KV_CACHE_NOT_EXIST
        got = first if outcomes[0] is None else second
        assert all(torch.equal(d[0], v[0]) for d, v in zip(got.tensors, values))
        await expect_code(S.LLM_KV_CACHE_NOT_EXIST, pair.dm.pull_cache(CacheKey(PROMPT_ID, 10), first))


async def test_a_pull_that_fails_mid_transfer_keeps_the_key():
    async with linked_pair() as pair:
        big = CacheDesc(64, (2, 256, 1024), DataType.DT_FLOAT16, Placement.HOST)  # 32 MiB per row
        src = pair.pm.allocate_cache(big, [CacheKey(PROMPT_ID, 10)])
        dst = pair.dm.allocate_cache(big)
        with pytest.raises(LLMException) as err:
            await pair.dm.pull_cache(CacheKey(PROMPT_ID, 10), dst, timeout=1)
        assert err.value.status_code == S.LLM_TIMEOUT
        await pair.dm.pull_cache(CacheKey(PROMPT_ID, 10), dst, timeout=20000)  # still bound, pulls now
        await expect_code(S.LLM_KV_CACHE_NOT_EXIST, pair.dm.pull_cache(CacheKey(PROMPT_ID, 10), dst))
        del src
