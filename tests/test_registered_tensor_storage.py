"""A registered cache keeps the memory it names alive, whatever the caller does to its own tensor object.

A framework may point its tensor at other memory while the cache is registered (``t.data = x``,
``t.set_(x)``). The cache holds its own alias of the registered storage, so that memory stays mapped and
the next copy writes into it. Before, the cache held the caller's tensor object itself: the swap dropped
the registered memory's last reference and the copy wrote into unmapped memory (SIGSEGV). The copy runs
in a forked child, so such a crash fails the test instead of the test run.
"""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from aio_datadist import CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole, Placement
from peers import alone_in_a_mapping, mapped, process_context


#: 64 MiB: above glibc's largest mmap threshold (32 MiB), so freeing it unmaps it and a stray write faults.
DESC = CacheDesc(1, (4, 16 << 20), DataType.DT_INT8, Placement.HOST)


async def _swap_then_copy(conn, how: str) -> None:
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(LLMConfig().generate_options())
        kv = dd.kv_cache_manager
        mine = alone_in_a_mapping(DESC.shape)
        mine[0].fill_(7)
        cache = kv.register_blocks_cache(DESC, [mine])
        registered = cache.tensor_addrs[0]
        elsewhere = torch.zeros(DESC.shape, dtype=torch.int8)
        if how == "data":
            mine.data = elsewhere
        else:
            mine.set_(elsewhere)
        await kv.copy_blocks(cache, {0: [1]})
        view = kv.get_cache_tensors(cache)[0]
        conn.send((view.data_ptr() == registered, bool((view[1] == 7).all()), int(elsewhere.count_nonzero())))
        kv.deallocate_cache(cache)


def _child(conn, how: str) -> None:
    asyncio.run(_swap_then_copy(conn, how))


@pytest.mark.usefixtures("fork_server")
@pytest.mark.parametrize("how", ["data", "set_"])
def test_a_caller_that_swaps_its_registered_tensors_storage_leaves_the_cache_its_memory(how):
    ctx = process_context()
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(theirs, how))
    proc.start()
    theirs.close()
    try:
        got = mine.recv() if mine.poll(20) else None
    except EOFError:  # the child died before it answered
        got = None
    finally:
        proc.join(20)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
        mine.close()
    assert proc.exitcode == 0, f"the child exited with {proc.exitcode}"
    at_registered, copied, written_elsewhere = got
    assert at_registered  # get_cache_tensors shows the registered memory, not the caller's new one
    assert copied and written_elsewhere == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("release", ["deallocate", "finalize"])
async def test_a_released_cache_kept_by_the_caller_lets_go_of_the_registered_memory(release: str) -> None:
    """Once the cache is released (``deallocate_cache``, ``finalize``) the memory is the caller's again: a caller
    that keeps the cache object and points its own tensor elsewhere frees the memory. Before, the cache's alias
    kept the caller's 64 MiB mapped for as long as the cache object lived (found by review)."""
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    await dd.init(LLMConfig().generate_options())
    try:
        kv = dd.kv_cache_manager
        mine = alone_in_a_mapping(DESC.shape)
        cache = kv.register_blocks_cache(DESC, [mine])
        address = cache.tensor_addrs[0]
        if release == "deallocate":
            kv.deallocate_cache(cache)
    finally:
        await dd.finalize()
    mine.data = torch.zeros(1, dtype=torch.int8)
    gc.collect()
    assert not mapped(address), "the released cache keeps the caller's memory allocated"
    assert cache.device == torch.device("cpu") and cache.tensor_addrs == []
