"""Transfer errors: every documented code, bad remote requests, timeouts and cancellation.

A refused request leaves the destination untouched; after a timeout or a
cancel the call returns within its bound and the same link carries the next
transfer.
"""

from __future__ import annotations

import asyncio
import gc
import time

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
    LLMStatusCode,
    Placement,
)
from peers import (
    BLOCKS_DESC,
    CACHE_DESC,
    DECODER_ID,
    LOCALHOST,
    PROMPT_ID,
    cluster_info,
    fill,
    linked_pair,
    same,
    snapshot,
)

S = LLMStatusCode
pytestmark = pytest.mark.asyncio

#: 16 tensors of 64 blocks of 32 KiB: a 32 MiB request, long enough to be cut in flight.
BIG_DESC = CacheDesc(16, (64, 16, 8, 128), DataType.DT_FLOAT16, Placement.HOST)
ALL = list(range(64))


async def expect_code(code: LLMStatusCode, awaitable) -> LLMException:
    with pytest.raises(LLMException) as exc:
        await awaitable
    assert exc.value.status_code == code, exc.value
    return exc.value


async def test_not_yet_link():
    async with linked_pair(link=False) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(PROMPT_ID))
        rows = pair.pm.allocate_cache(CACHE_DESC, [CacheKey(PROMPT_ID, 1)])
        dst = pair.dm.allocate_blocks_cache(BLOCKS_DESC)
        dst_rows = pair.dm.allocate_cache(CACHE_DESC)
        calls = lambda: (  # noqa: E731
            pair.dm.pull_cache(CacheKey(PROMPT_ID, 1), dst_rows),
            pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [0], [0]),
            pair.pm.push_blocks(CacheIndex(DECODER_ID, dst.cache_id), src, [0], [0]),
            pair.pm.push_cache(CacheIndex(DECODER_ID, dst_rows.cache_id), rows),
        )
        for call in calls():
            await expect_code(S.LLM_NOT_YET_LINK, call)
        await pair.link()
        await pair.unlink()
        for call in calls():
            await expect_code(S.LLM_NOT_YET_LINK, call)
        await pair.link()
        for call in calls():  # and the pair works once linked again
            await call


async def test_param_invalid_found_locally():
    async with linked_pair() as pair:
        pm, dm = pair.pm, pair.dm
        blocks = dm.allocate_blocks_cache(BLOCKS_DESC)
        rows = dm.allocate_cache(CACHE_DESC)
        p_blocks = pm.allocate_blocks_cache(BLOCKS_DESC)
        p_rows = pm.allocate_cache(CACHE_DESC)
        bkey, ckey = BlocksCacheKey(PROMPT_ID), CacheKey(PROMPT_ID, 1)
        target = CacheIndex(DECODER_ID, blocks.cache_id)
        bad_calls = [
            # roles
            pm.pull_blocks(bkey, p_blocks, [0], [0]),
            pm.pull_cache(ckey, p_rows),
            dm.push_blocks(CacheIndex(PROMPT_ID, 1), blocks, [0], [0]),
            dm.push_cache(CacheIndex(PROMPT_ID, 1), rows),
            # pull_cache
            dm.pull_cache(ckey, rows, batch_index=3),
            dm.pull_cache(ckey, rows, size=0),
            dm.pull_cache(ckey, rows, size=513),
            dm.pull_cache(ckey, blocks),
            dm.pull_cache(bkey, rows),
            dm.pull_cache(CacheKey(PROMPT_ID, 2**64 - 1), rows),  # neither req_id nor prefix_id
            dm.pull_cache(ckey, rows, src_layer_range=range(0, 2, 2)),
            dm.pull_cache(ckey, rows, src_layer_range=range(0, 0)),
            dm.pull_cache(ckey, rows, dst_layer_range=range(2, 3)),  # the decoder has layers 0, 1
            dm.pull_cache(ckey, rows, src_layer_range=range(0, 1), dst_layer_range=range(0, 2)),
            dm.pull_cache(ckey, rows, dst_layer_range=range(0, 1), tensor_num_per_layer=3),
            dm.pull_cache(ckey, rows, tensor_num_per_layer=0),
            dm.pull_cache(ckey, rows, offset=3),
            dm.pull_cache(ckey, rows, timeout=0),
            # pull_blocks
            dm.pull_blocks(bkey, rows, [0], [0]),
            dm.pull_blocks(bkey, blocks, [0], [0], offset=3),  # no such keyword
            dm.pull_blocks(bkey, blocks, [0], []),
            dm.pull_blocks(bkey, blocks, [], [0]),
            dm.pull_blocks(bkey, blocks, [0, 1], [0]),
            dm.pull_blocks(bkey, blocks, [0, 1], [2, 2]),
            dm.pull_blocks(bkey, blocks, [0], [8]),
            dm.pull_blocks(bkey, blocks, [-1], [0]),
            dm.pull_blocks(ckey, blocks, [0], [0]),  # a contiguous source takes no src_blocks
            dm.pull_blocks(CacheIndex(PROMPT_ID, 1), blocks, [0], [0]),
            # push_blocks
            pm.push_blocks(target, p_blocks, [0], [0], KvCacheExtParam((0, 0), (0, 1))),
            pm.push_blocks(target, p_blocks, [0], [0], KvCacheExtParam((2, 2), (0, 0))),
            pm.push_blocks(target, p_blocks, [0], [0], KvCacheExtParam((0, 0), (0, 0), 3)),
            pm.push_blocks(target, p_blocks, [0], [0], ext_param=(0, 0)),
            pm.push_blocks(target, p_blocks, [8], [0]),
            pm.push_blocks(target, p_blocks, [0, 1], [0]),
            pm.push_blocks(target, p_blocks, [0, 1], [3, 3]),
            pm.push_blocks(target, p_blocks, [], []),
            pm.push_blocks(target, p_rows, [0], [0]),
            pm.push_blocks(CacheIndex(DECODER_ID, blocks.cache_id, 1), p_blocks, [0], [0]),
            pm.push_blocks(CacheKey(DECODER_ID, 1), p_blocks, [0], [0]),
            # push_cache
            pm.push_cache(CacheIndex(DECODER_ID, rows.cache_id), p_rows, size=512),
            pm.push_cache(CacheIndex(DECODER_ID, rows.cache_id), p_rows, src_batch_index=3),
            pm.push_cache(CacheIndex(DECODER_ID, rows.cache_id), p_blocks),
            pm.push_cache(BlocksCacheKey(DECODER_ID), p_rows),
        ]
        before = snapshot(blocks) + snapshot(rows)
        for n, call in enumerate(bad_calls):
            try:
                await expect_code(S.LLM_PARAM_INVALID, call)
            except BaseException as exc:
                for rest in bad_calls[n + 1:]:
                    rest.close()
                raise AssertionError(f"bad call #{n}") from exc
        assert same(snapshot(blocks) + snapshot(rows), before)


async def test_bad_remote_requests_leave_the_destination_untouched():
    """What only the owner can check: its caches' ids, keys, block counts and row sizes."""
    async with linked_pair(link=False) as pair:
        p_blocks = pair.pm.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(PROMPT_ID))
        d_blocks = pair.dm.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(DECODER_ID))
        await pair.link()
        # blocks caches made after linking take no part in the compatibility check
        d_wide = pair.dm.allocate_blocks_cache(CacheDesc(8, (8, 4, 16), DataType.DT_FLOAT16, Placement.HOST))
        p_rows = pair.pm.allocate_cache(CACHE_DESC, [CacheKey(PROMPT_ID, 1)])
        p_short = pair.pm.allocate_cache(CacheDesc(4, (3, 128), DataType.DT_FLOAT16, Placement.HOST),
                                         [CacheKey(PROMPT_ID, 2)])
        d_rows = pair.dm.allocate_cache(CACHE_DESC)
        for cache in (p_blocks, d_blocks, d_wide, p_rows, p_short, d_rows):
            fill(cache, cache.cache_id)
        dm, pm = pair.dm, pair.pm
        bad, gone = S.LLM_PARAM_INVALID, S.LLM_KV_CACHE_NOT_EXIST
        p_key, d_key = BlocksCacheKey(PROMPT_ID), BlocksCacheKey(DECODER_ID)
        rows_at = lambda row: CacheKeyByIdAndIndex(PROMPT_ID, p_rows.cache_id, row)  # noqa: E731
        cases = [  # (code, the cluster that refuses, call)
            (bad, PROMPT_ID, dm.pull_blocks(p_key, d_blocks, [3, 8], [0, 1])),  # remote block 8 of 8
            (bad, DECODER_ID, pm.push_blocks(d_key, p_blocks, [0, 1], [7, 8])),
            (bad, DECODER_ID, pm.push_blocks(CacheIndex(DECODER_ID, d_blocks.cache_id), p_blocks, [0], [2**40])),
            (bad, PROMPT_ID, dm.pull_cache(rows_at(3), d_rows)),  # remote row 3 of 3
            (bad, PROMPT_ID, dm.pull_cache(CacheKey(PROMPT_ID, 2), d_rows)),  # rows of 256 B, not 512
            (bad, PROMPT_ID, dm.pull_cache(CacheKeyByIdAndIndex(PROMPT_ID, p_blocks.cache_id, 0), d_rows)),
            (bad, PROMPT_ID, dm.pull_blocks(rows_at(0), d_blocks, [], [0, 1, 2, 3, 4])),  # 5 blocks > a row
            (bad, PROMPT_ID, dm.pull_blocks(p_key, d_wide, [0], [0])),  # 8 tensors here, 4 there
            (bad, PROMPT_ID, dm.pull_blocks(p_key, d_wide, [0], [0], src_layer_range=range(2, 4),
                                            dst_layer_range=range(2, 4))),  # the prompt has 2 layers
            (bad, DECODER_ID, pm.push_blocks(CacheIndex(DECODER_ID, d_rows.cache_id), p_blocks, [0], [0])),
            (bad, DECODER_ID, pm.push_cache(CacheIndex(DECODER_ID, d_blocks.cache_id), p_rows)),
            (bad, DECODER_ID, pm.push_cache(CacheIndex(DECODER_ID, d_rows.cache_id, 3), p_rows)),
            (gone, PROMPT_ID, dm.pull_cache(CacheKey(PROMPT_ID, 99), d_rows)),
            (gone, PROMPT_ID, dm.pull_cache(CacheKeyByIdAndIndex(PROMPT_ID, 99, 0), d_rows)),
            (gone, PROMPT_ID, dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 5), d_blocks, [0], [0])),
            (gone, PROMPT_ID, dm.pull_blocks(CacheKey(PROMPT_ID, 99), d_blocks, [], [0])),
            (gone, DECODER_ID, pm.push_blocks(CacheIndex(DECODER_ID, 99), p_blocks, [0], [0])),
            (gone, DECODER_ID, pm.push_blocks(BlocksCacheKey(DECODER_ID, 5), p_blocks, [0], [0])),
            (gone, DECODER_ID, pm.push_cache(CacheKeyByIdAndIndex(DECODER_ID, 99, 0), p_rows)),
        ]
        before = {c.cache_id: snapshot(c) for c in (d_blocks, d_wide, d_rows)}
        p_before = {c.cache_id: snapshot(c) for c in (p_blocks, p_rows, p_short)}
        for n, (code, owner, call) in enumerate(cases):
            try:
                error = await expect_code(code, call)
                assert f"cluster {owner}: " in str(error)  # refused by the owner, not found locally
            except BaseException as exc:
                for _, _, rest in cases[n + 1:]:
                    rest.close()
                raise AssertionError(f"case #{n}") from exc
        for cache in (d_blocks, d_wide, d_rows):
            assert same(snapshot(cache), before[cache.cache_id])
        for cache in (p_blocks, p_rows, p_short):
            assert same(snapshot(cache), p_before[cache.cache_id])
        # refusals leave the link as it was, and keys in place
        await dm.pull_cache(CacheKey(PROMPT_ID, 2), d_rows, size=256)
        await dm.pull_cache(CacheKey(PROMPT_ID, 1), d_rows)
        await dm.pull_blocks(BlocksCacheKey(PROMPT_ID), d_blocks, [7], [0])
        assert all(torch.equal(d[0], p[7]) for d, p in zip(d_blocks.tensors, p_blocks.tensors))
        assert all(torch.equal(d[0], p[0]) for d, p in zip(d_rows.tensors, p_rows.tensors))


@pytest.mark.parametrize("transport", ["tcp", "local"])
async def test_the_owners_refusals_name_what_the_caller_passed(transport):
    """A row index past the owner's cache, given in the key (CacheKeyByIdAndIndex), was refused as
    'src_blocks' / 'dst_blocks', arguments these calls do not have, and later in the owner's words
    ('dst_cache_key' for v1 push_cache's dst_cache_index_or_key, 'cache_key' for pull_blocks'
    src_cache_key); a src_cache_offset past the owner's row was a "row size mismatch" naming neither
    src_cache_offset nor size. The refusal's ``argument`` is the name too. Same-host (``local``): a push
    is the owner's own copy (``PUSH_LOCAL``), its refusal a plain answer, renamed all the same."""
    config = {"transport": transport}
    async with linked_pair(prompt_config=config, decoder_config=config) as pair:
        p_rows = pair.pm.allocate_cache(CACHE_DESC, [CacheKey(PROMPT_ID, 1)])
        d_rows = pair.dm.allocate_cache(CACHE_DESC)  # rows of 512 B on both ends
        d_blocks = pair.dm.allocate_blocks_cache(BLOCKS_DESC)  # blocks of 128 B: a row fills four
        fill(d_blocks, 5)
        before = snapshot(d_rows), snapshot(p_rows), snapshot(d_blocks)
        cases = [
            ("cache_key.batch_index",
             lambda: pair.dm.pull_cache(CacheKeyByIdAndIndex(PROMPT_ID, p_rows.cache_id, 3), d_rows)),
            ("dst_cache_index_or_key.batch_index",  # the v1 call's name; the owner checks it as dst_cache_key
             lambda: pair.pm.push_cache(CacheKeyByIdAndIndex(DECODER_ID, d_rows.cache_id, 3), p_rows)),
            ("src_cache_key.batch_index",  # a row by its key into blocks: pull_blocks' key is src_cache_key
             lambda: pair.dm.pull_blocks(CacheKeyByIdAndIndex(PROMPT_ID, p_rows.cache_id, 3), d_blocks, [],
                                         [0, 1, 2, 3])),
            ("src_cache_offset",
             lambda: pair.dm.pull_cache(CacheKey(PROMPT_ID, 1), d_rows, 0, 16, src_cache_offset=2**40)),
            ("src_cache_offset",
             lambda: pair.dm.pull_cache(CacheKey(PROMPT_ID, 1), d_rows, 0, 512, src_cache_offset=256)),
        ]
        for arg, call in cases:
            error = await expect_code(S.LLM_PARAM_INVALID, call())
            assert f"invalid argument '{arg}'" in str(error), (arg, str(error))
            assert error.argument == arg, (arg, error.argument)
            assert "blocks'" not in str(error) and "row size mismatch" not in str(error), str(error)
        assert same(snapshot(d_rows), before[0]) and same(snapshot(p_rows), before[1])
        assert same(snapshot(d_blocks), before[2])
        # A size past the owner's (shorter) rows is the caller's `size`; whole rows that differ name the key.
        half = CacheDesc(4, (3, 128), DataType.DT_FLOAT16, Placement.HOST)  # rows of 256 B
        pair.pm.allocate_cache(half, [CacheKey(PROMPT_ID, 2)])
        for arg, call in (("size", lambda: pair.dm.pull_cache(CacheKey(PROMPT_ID, 2), d_rows, 0, 384)),
                          ("cache_key", lambda: pair.dm.pull_cache(CacheKey(PROMPT_ID, 2), d_rows))):
            error = await expect_code(S.LLM_PARAM_INVALID, call())
            assert f"invalid argument '{arg}': row size mismatch" in str(error), (arg, str(error))
            assert error.argument == arg, (arg, error.argument)
        assert same(snapshot(d_rows), before[0])
        await pair.dm.pull_cache(CacheKey(PROMPT_ID, 1), d_rows, 0, 256, src_cache_offset=256)  # the key is still there


async def test_local_caches_that_are_gone():
    async with linked_pair() as pair:
        dst = pair.dm.allocate_blocks_cache(BLOCKS_DESC)
        src = pair.pm.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(PROMPT_ID))
        pair.dm.deallocate_cache(dst)
        await expect_code(S.LLM_KV_CACHE_NOT_EXIST, pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [0], [0]))
        pair.pm.deallocate_cache(src)
        await expect_code(S.LLM_KV_CACHE_NOT_EXIST,
                          pair.pm.push_blocks(CacheIndex(DECODER_ID, 1), src, [0], [0]))
        other = pair.pm.allocate_blocks_cache(BLOCKS_DESC)  # a cache of another endpoint
        await expect_code(S.LLM_KV_CACHE_NOT_EXIST,
                          pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), other, [0], [0]))


# -- timeouts and cancellation -----------------------------------------------------------


async def _big_pair_caches(pair):
    src = pair.pm.allocate_blocks_cache(BIG_DESC, BlocksCacheKey(PROMPT_ID))
    for index, tensor in enumerate(src.tensors):
        tensor.view(64, -1)[:, :2] = torch.tensor([[index, block] for block in range(64)], dtype=torch.float16)
    dst = pair.dm.allocate_blocks_cache(BIG_DESC, BlocksCacheKey(DECODER_ID))
    return src, dst


def _check_big(src, dst) -> None:
    as_words = lambda t: t.view(torch.int64)  # noqa: E731 (a fast bytewise compare)
    assert all(torch.equal(as_words(s), as_words(d)) for s, d in zip(src.tensors, dst.tensors))


async def _next_transfers_work(pair, src, dst) -> None:
    """Several transfers, more than the link has channels, both ways, then everything is in place."""
    small = [pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [b], [b], timeout=5000) for b in range(4)]
    await asyncio.gather(*small, pair.pm.push_blocks(BlocksCacheKey(DECODER_ID), src, [5], [5], timeout=5000))
    for d in dst.tensors:
        d.zero_()
    await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, ALL, ALL, timeout=5000)
    _check_big(src, dst)


async def test_timeout_of_a_pull_and_a_push_then_the_link_still_works():
    async with linked_pair(link=False) as pair:
        src, dst = await _big_pair_caches(pair)
        await pair.link()
        for call in (lambda: pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, ALL, ALL, timeout=2),
                     lambda: pair.pm.push_blocks(BlocksCacheKey(DECODER_ID), src, ALL, ALL, timeout=2)):
            t0 = time.monotonic()
            await expect_code(S.LLM_TIMEOUT, call())
            assert time.monotonic() - t0 < 1.0
            await _next_transfers_work(pair, src, dst)


async def test_sync_kv_timeout_is_the_default():
    async with linked_pair(link=False, decoder_config={"sync_kv_timeout": 2}) as pair:
        src, dst = await _big_pair_caches(pair)
        await pair.link()
        t0 = time.monotonic()
        await expect_code(S.LLM_TIMEOUT, pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, ALL, ALL))
        assert time.monotonic() - t0 < 1.0
        await _next_transfers_work(pair, src, dst)


@pytest.mark.parametrize("how", ["task.cancel", "asyncio.timeout"])
async def test_cancel_in_flight_then_the_link_still_works(how):
    async with linked_pair(link=False) as pair:
        src, dst = await _big_pair_caches(pair)
        await pair.link()
        # cut at different moments: before the owner answers, while bytes flow, around the end
        for delay in (0.0, 0.002, 0.005):
            for transfer in (lambda: pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, ALL, ALL, timeout=5000),
                             lambda: pair.pm.push_blocks(BlocksCacheKey(DECODER_ID), src, ALL, ALL, timeout=5000)):
                t0 = time.monotonic()
                if how == "task.cancel":
                    task = asyncio.ensure_future(transfer())
                    await asyncio.sleep(delay)
                    task.cancel()
                    try:
                        await task
                    except asyncio.CancelledError:
                        assert task.cancelled()
                else:
                    try:
                        async with asyncio.timeout(delay):
                            await transfer()
                    except TimeoutError:
                        pass
                assert time.monotonic() - t0 < 1.0 + delay
                await _next_transfers_work(pair, src, dst)


@pytest.mark.parametrize("who", ["decoder", "prompt"])
async def test_unlink_fails_running_and_waiting_transfers_at_once(who):
    """A one-channel link, eight pulls: one moves bytes, the others wait for the channel."""
    async with linked_pair(link=False, prompt_config={"data_channels": 1}) as pair:
        src, dst = await _big_pair_caches(pair)
        await pair.link()
        pulls = [asyncio.ensure_future(pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, ALL, ALL, timeout=5000))
                 for _ in range(8)]
        await asyncio.sleep(0.002)
        t0 = time.monotonic()
        if who == "decoder":  # this end goes: its calls are not linked any more
            await pair.decoder.unlink_clusters([pair.info], force=True)
            expected = S.LLM_NOT_YET_LINK
        else:  # the other end goes: this end's calls find the link broken
            await pair.prompt.unlink_clusters([cluster_info(DECODER_ID, (LOCALHOST, 1))], force=True)
            expected = S.LLM_LINK_FAILED
        results = await asyncio.gather(*pulls, return_exceptions=True)
        assert time.monotonic() - t0 < 1.0  # nobody waits for the 5 s timeout
        failed = [r for r in results if r is not None]
        assert len(failed) >= 2
        assert all(isinstance(r, LLMException) and r.status_code == expected for r in failed), results


async def test_finalize_fails_transfers_in_flight(caplog):
    for who in ("decoder", "prompt"):
        async with linked_pair(link=False) as pair:
            src, dst = await _big_pair_caches(pair)
            await pair.link()
            transfers = [pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, ALL, ALL, timeout=5000) for _ in range(4)]
            transfers += [pair.pm.push_blocks(BlocksCacheKey(DECODER_ID), src, ALL, ALL, timeout=5000)
                          for _ in range(4)]
            running = asyncio.gather(*transfers, return_exceptions=True)
            await asyncio.sleep(0.002)
            t0 = time.monotonic()
            await getattr(pair, who).finalize()
            results = await running
            assert time.monotonic() - t0 < 1.0
            assert any(r is not None for r in results)
            codes = {S.LLM_NOT_YET_LINK, S.LLM_LINK_FAILED, S.LLM_ENGINE_FINALIZED}
            assert all(r is None or isinstance(r, LLMException) and r.status_code in codes for r in results), results
            del results
    gc.collect()
    assert "never retrieved" not in caplog.text


async def test_too_many_blocks_for_one_request():
    async with linked_pair(link=False) as pair:
        desc = CacheDesc(2, (70000, 8), DataType.DT_FLOAT16, Placement.HOST)
        src = pair.pm.allocate_blocks_cache(desc, BlocksCacheKey(PROMPT_ID))
        dst = pair.dm.allocate_blocks_cache(desc, BlocksCacheKey(DECODER_ID))
        values = fill(src, 1)
        await pair.link()
        many = list(range(70000))
        await expect_code(S.LLM_PARAM_INVALID, pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, many, many))
        await expect_code(S.LLM_PARAM_INVALID, pair.pm.push_blocks(BlocksCacheKey(DECODER_ID), src, many, many))
        most = many[:65536]  # what one request can name
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, most, most)
        assert all(torch.equal(d[:65536], v[:65536]) and not d[65536:].any() for d, v in zip(dst.tensors, values))


async def test_a_pull_that_fails_consumes_no_key():
    async with linked_pair(link=False) as pair:
        src, dst = await _big_pair_caches(pair)
        await pair.link()
        row = CacheDesc(16, (1, 64 * 16 * 8 * 128), DataType.DT_FLOAT16, Placement.HOST)  # one 32 MiB row
        keyed = pair.pm.allocate_cache(row, [CacheKey(PROMPT_ID, 10)])
        for t, tensor in enumerate(keyed.tensors):
            tensor[0, ::4096] = t + 1
        key = CacheKey(PROMPT_ID, 10)
        await expect_code(S.LLM_TIMEOUT, pair.dm.pull_blocks(key, dst, [], ALL, timeout=1))
        small = pair.dm.allocate_cache(CacheDesc(16, (1, 64), DataType.DT_FLOAT16, Placement.HOST))
        await expect_code(S.LLM_PARAM_INVALID, pair.dm.pull_cache(key, small))  # rows differ in size
        task = asyncio.ensure_future(pair.dm.pull_blocks(key, dst, [], ALL, timeout=5000))
        await asyncio.sleep(0)  # the request is out, the answer not in yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await pair.dm.pull_blocks(key, dst, [], ALL, timeout=5000)  # the key is still there
        for t, tensor in enumerate(dst.tensors):
            assert bool((tensor.view(-1)[::4096] == t + 1).all())
        await expect_code(S.LLM_KV_CACHE_NOT_EXIST, pair.dm.pull_blocks(key, dst, [], ALL, timeout=5000))


async def test_a_pull_between_caches_of_different_dtypes_is_refused_by_the_owner():
    async with linked_pair() as pair:
        half = CacheDesc(2, (4, 64), DataType.DT_FLOAT16, Placement.HOST)
        bf16 = CacheDesc(2, (4, 64), DataType.DT_BF16, Placement.HOST)
        src = pair.pm.allocate_cache(half, [CacheKey(PROMPT_ID, 10)])
        fill(src, 1)
        dst = pair.dm.allocate_cache(bf16)
        before = snapshot(dst)
        exc = await expect_code(LLMStatusCode.LLM_PARAM_INVALID, pair.dm.pull_cache(CacheKey(PROMPT_ID, 10), dst))
        assert "data types differ" in str(exc)
        assert same(before, snapshot(dst))
