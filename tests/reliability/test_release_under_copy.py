"""No byte after a release returned: local copies and same-host reads into a registered cache.

A registered cache is the caller's memory: once ``deallocate_cache`` (v1) or ``unregister_cache`` (v2) returned,
the caller may reuse or unmap it. Copies of our own into it are stopped inside that call and fail
``LLM_KV_CACHE_NOT_EXIST`` (``docs/reliability.md`` row 206):

- a ``copy_blocks`` queued on the copy threads behind other copies (before: it ran afterwards and succeeded);
- a ``swap_blocks`` from a device cache (host backend) queued on the copy stream behind other work: the release
  waits until the stream has done the queued copy (before: it returned at once and the copy landed after);
- a same-host pull that reads without asking (read ledger), released while it waited for its loop turn (before:
  its copy started after the release returned), also when the read gives the pull back to asking (row 268).

And ``aio.RegisteredMemoryCap`` counts what a host cache maps (whole pages per tensor), not what it asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from _v2peer import v2_options
from peers import PROMPT_ID, fill, linked_pair

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    KvCache,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aio_datadist.testing import runtime_of, usable_link

MIB = 1 << 20
S = LLMStatusCode
BLOCKS = CacheDesc(4, (16, 8, 256), DataType.DT_FLOAT16, Placement.HOST)  # the same-host reads' caches
KEY = BlocksCacheKey(PROMPT_ID, 0)


async def _outcome(call: asyncio.Future) -> str:
    try:
        await call
    except LLMException as exc:
        return exc.status_code.name
    return "succeeded"


@pytest.mark.loops_take_turns
@pytest.mark.parametrize("api", ["v1", "v2"])
@pytest.mark.asyncio
async def test_a_local_copy_into_a_registered_cache_is_stopped_by_its_release(api: str) -> None:
    if api == "v1":
        cfg = LLMConfig()
        cfg.copy_threads = 1
        options = cfg.generate_options()
    else:
        options = {**v2_options(), "aio.CopyThreads": "1"}
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(options)
        kv = dd.kv_cache_manager if api == "v1" else dd.cache_manager
        big = kv.allocate_blocks_cache(CacheDesc(1, (2, 32 * MIB), DataType.DT_INT8, Placement.HOST))
        mine = [torch.ones((8, 4096), dtype=torch.int8) for _ in range(2)]  # block 0, the source, holds 1
        reg = kv.register_blocks_cache(CacheDesc(2, (8, 4096), DataType.DT_INT8, Placement.HOST), mine)
        ahead = asyncio.gather(*(kv.copy_blocks(big, {0: [1]}, timeout=30_000) for _ in range(4)))
        await asyncio.sleep(0)  # the long copies are queued first
        copy = asyncio.ensure_future(kv.copy_blocks(reg, {0: [5]}, timeout=30_000))
        await asyncio.sleep(0)  # queued behind them: not started
        if api == "v1":
            kv.deallocate_cache(reg)
        else:
            kv.unregister_cache(reg.cache_id)
        for t in mine:
            t[5].fill_(9)  # the caller reuses block 5
        await ahead
        assert await _outcome(copy) == "LLM_KV_CACHE_NOT_EXIST"
        await asyncio.sleep(0.3)
        assert all(bool((t[5] == 9).all()) for t in mine)


@pytest.mark.asyncio
async def test_a_running_local_copy_into_a_registered_cache_is_over_when_its_release_returns() -> None:
    """The copy runs (its first bytes landed) when the cache is released: the release cancels it and waits until no
    copy thread works on it (``HostCopyEngine.wait``); a cancel alone leaves the running chunk writing."""
    cfg = LLMConfig()
    cfg.copy_threads = 1
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(cfg.generate_options())
        kv = dd.kv_cache_manager
        for _ in range(5):  # until the release meets the copy running (a loaded loop may see it end first)
            mine = [torch.zeros((2, 96 * MIB), dtype=torch.int8)]
            mine[0][0].fill_(1)  # block 0, the source
            reg = kv.register_blocks_cache(CacheDesc(1, (2, 96 * MIB), DataType.DT_INT8, Placement.HOST), mine)
            copy = asyncio.ensure_future(kv.copy_blocks(reg, {0: [1]}, timeout=30_000))
            for _ in range(5000):
                if mine[0][1, 0] != 0:
                    break
                await asyncio.sleep(0.001)
            kv.deallocate_cache(reg)
            left = runtime_of(dd).copier.pending()  # read at once: no copy thread may work on the job any more
            outcome = await _outcome(copy)
            if outcome == "LLM_KV_CACHE_NOT_EXIST":
                break
        assert (outcome, left) == ("LLM_KV_CACHE_NOT_EXIST", 0)


@pytest.mark.parametrize("method", ["batch", "staged"])
@pytest.mark.asyncio
async def test_a_swap_into_a_registered_host_cache_is_waited_for_by_its_release(method: str, monkeypatch) -> None:
    """The device copy cannot be recalled: the release blocks until the stream (held 0.3 s here) has done it.
    Queued whole and done before the release returned, the swap moved every byte by then: a success. A staged
    swap queues chunk after chunk: its first device copy done is not the swap done; it is cut (nothing lands)."""
    async with LLMDataDist(LLMRole.MIX, 1) as dd:
        await dd.init({"aio.DeviceType": "host"})
        if method == "staged":
            monkeypatch.setattr(type(runtime_of(dd).devices), "batch_copies", property(lambda self: False))
        kv = dd.kv_cache_manager
        dev = kv.allocate_blocks_cache(CacheDesc(2, (8, 256), DataType.DT_INT8, Placement.DEVICE))
        for t in dev.tensors:
            t.fill_(1)
        mine = [torch.zeros((8, 256), dtype=torch.int8) for _ in range(2)]
        reg = kv.register_blocks_cache(CacheDesc(2, (8, 256), DataType.DT_INT8, Placement.HOST), mine)
        gate = runtime_of(dd).devices.stream.gate()  # the swap queues behind this point of the copy stream
        opener = threading.Timer(0.3, gate.open)
        try:
            swap = asyncio.ensure_future(kv.swap_blocks(dev, reg, {1: 5}, timeout=5000))
            await asyncio.sleep(0.05)
            assert all(int(t[5].count_nonzero()) == 0 for t in mine)  # not copied yet
            opener.start()
            kv.deallocate_cache(reg)  # returns once the queued copy is done
            if method == "batch":
                assert all(bool((t[5] == 1).all()) for t in mine)
            for t in mine:
                t[5].fill_(9)
            assert await _outcome(swap) == ("succeeded" if method == "batch" else "LLM_KV_CACHE_NOT_EXIST")
            await asyncio.sleep(0.3)
            assert all(bool((t[5] == 9).all()) for t in mine)
        finally:
            opener.cancel()
            gate.open()


@contextlib.asynccontextmanager
async def ledger_pull() -> AsyncIterator[tuple[Any, KvCache, list[torch.Tensor], KvCache, asyncio.Future]]:
    """A same-host pull into a registered blocks cache that reads without asking (read ledger), at its loop turn
    before the copy: ``(pair, the owner's cache, the caller's memory, the caller's cache, the pull)``."""
    local = {"transport": "local"}
    async with linked_pair(link=False, prompt_config=local, decoder_config=local) as pair:
        old = pair.pm.allocate_blocks_cache(BLOCKS, KEY)
        fill(old, 4)
        mine = [torch.zeros(BLOCKS.shape, dtype=torch.float16) for _ in range(BLOCKS.num_tensors)]
        dst = pair.dm.register_blocks_cache(BLOCKS, mine)
        await pair.link()
        share = usable_link(pair.decoder, PROMPT_ID).local
        assert share is not None and share.listed_region(0) is not None  # the pull reads without asking
        pull = asyncio.ensure_future(pair.dm.pull_blocks(KEY, dst, [3, 0, 15], [1, 2, 3]))
        await asyncio.sleep(0)  # at its loop turn before the copy: nothing copied yet
        yield pair, old, mine, dst, pull


@pytest.mark.asyncio
@pytest.mark.usefixtures("fork_server")
async def test_a_same_host_read_into_a_cache_released_before_its_copy_copies_nothing() -> None:
    async with ledger_pull() as (pair, _, mine, dst, pull):
        pair.dm.deallocate_cache(dst)
        for t in mine:
            t.fill_(7.0)  # the caller reuses it
        assert await _outcome(pull) == "LLM_KV_CACHE_NOT_EXIST"
        await asyncio.sleep(0.3)
        assert all(bool((t == 7.0).all()) for t in mine)


@pytest.mark.asyncio
@pytest.mark.usefixtures("fork_server")
async def test_a_ledger_read_that_falls_back_to_asking_after_the_release_writes_nothing() -> None:
    """In the loop pass before the copy, the owner binds its blocks key to a new cache (the ledger no longer
    lists the old one: the read gives the pull back to asking) and the caller releases its destination (row
    268). Before, the asked pull watched a cache already released, copied into the caller's memory after
    ``deallocate_cache`` returned and said it succeeded."""
    async with ledger_pull() as (pair, old, mine, dst, pull):
        pair.pm.deallocate_cache(old)
        for t in pair.pm.allocate_blocks_cache(BLOCKS, KEY).tensors:
            t.fill_(5.0)
        pair.dm.deallocate_cache(dst)
        for t in mine:
            t.fill_(7.0)
        outcome = await _outcome(pull)
        await asyncio.sleep(0.3)
        assert (outcome, sum(int((t != 7.0).sum()) for t in mine)) == ("LLM_KV_CACHE_NOT_EXIST", 0)


@pytest.mark.asyncio
async def test_the_registered_memory_cap_counts_the_pages_a_host_cache_maps() -> None:
    """64 caches of 16 one-byte tensors map 64 x 16 pages; before, the cap counted 1024 bytes for them."""
    cfg = LLMConfig()
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init({**cfg.generate_options(), "aio.RegisteredMemoryCap": str(64 * 1024)})
        kv = dd.kv_cache_manager
        tiny = CacheDesc(16, (1,), DataType.DT_INT8, Placement.HOST)
        page = 4096
        made = 0
        with pytest.raises(LLMException) as refused:
            for _ in range(64):
                kv.allocate_cache(tiny)
                made += 1
        assert refused.value.status_code == S.LLM_OUT_OF_MEMORY, refused.value
        assert made == 64 * 1024 // (16 * page)


@pytest.mark.loops_take_turns
@pytest.mark.parametrize("how", ["cancel", "timeout"])
@pytest.mark.asyncio
async def test_a_callers_own_cancel_of_a_swap_stays_a_cancel_when_a_release_comes_meanwhile(how: str) -> None:
    """The caller cancels its swap (``task.cancel()`` / ``asyncio.timeout``) while the swap's copy waits on the
    stream, then releases the registered cache before the cancel settled: the caller still gets its own
    ``CancelledError`` / ``TimeoutError`` (before, ``LLM_KV_CACHE_NOT_EXIST``; found by review)."""
    async with LLMDataDist(LLMRole.MIX, 1) as dd:
        await dd.init({"aio.DeviceType": "host"})
        kv = dd.kv_cache_manager
        dev = kv.allocate_blocks_cache(CacheDesc(2, (8, 256), DataType.DT_INT8, Placement.DEVICE))
        mine = [torch.zeros((8, 256), dtype=torch.int8) for _ in range(2)]
        reg = kv.register_blocks_cache(CacheDesc(2, (8, 256), DataType.DT_INT8, Placement.HOST), mine)
        gate = runtime_of(dd).devices.stream.gate()
        opener = threading.Timer(0.3, gate.open)
        try:
            if how == "cancel":
                swap = asyncio.ensure_future(kv.swap_blocks(dev, reg, {1: 5}, timeout=5000))
                await asyncio.sleep(0.05)
                swap.cancel()
            else:
                async def bounded() -> None:
                    async with asyncio.timeout(0.05):
                        await kv.swap_blocks(dev, reg, {1: 5}, timeout=5000)

                swap = asyncio.ensure_future(bounded())
                await asyncio.sleep(0.1)  # the caller's timeout fired; the swap settles behind the gate
                assert not swap.done()
            opener.start()
            kv.deallocate_cache(reg)
            with pytest.raises(asyncio.CancelledError if how == "cancel" else TimeoutError):
                await swap
            assert runtime_of(dd).registry.serving_count() == 0
        finally:
            opener.cancel()
            gate.open()


@pytest.mark.asyncio
@pytest.mark.usefixtures("fork_server")
async def test_a_keyed_same_host_pull_released_after_its_copy_ended_fails_and_leaves_the_key() -> None:
    """The copy of a keyed same-host pull into a registered cache is over before the cache is released, the
    pull not yet back: the pull fails ``LLM_KV_CACHE_NOT_EXIST`` and says so to the owner, which keeps the key
    for the next pull. Before, its ``DONE`` went as a success (the owner consumed the key) while the pull
    failed: the bytes were lost to everyone (found by review)."""
    desc = CacheDesc(4, (1, 32 << 20), DataType.DT_UINT8, Placement.HOST)  # 128 MiB: not copied inline
    local = {"transport": "local"}
    async with linked_pair(prompt_config=local, decoder_config=local) as pair:
        key = CacheKey(PROMPT_ID, 7)
        for t in pair.pm.allocate_cache(desc, [key]).tensors:
            t.fill_(5)
        mine = [torch.zeros((1, 32 << 20), dtype=torch.uint8) for _ in range(4)]
        dst = pair.dm.register_cache(desc, mine)
        copier = runtime_of(pair.decoder).copier
        pull = asyncio.ensure_future(pair.dm.pull_cache(key, dst, timeout=10_000))
        async with asyncio.timeout(5):
            while not copier.pending():
                await asyncio.sleep(0)
        deadline = time.monotonic() + 5
        while copier.pending() and time.monotonic() < deadline:  # the loop held: the copy ends meanwhile
            time.sleep(0.001)
        assert all(bool((t == 5).all()) for t in mine)
        pair.dm.deallocate_cache(dst)
        assert await _outcome(pull) == "LLM_KV_CACHE_NOT_EXIST"
        again = pair.dm.allocate_cache(desc)
        assert await _outcome(pair.dm.pull_cache(key, again, timeout=10_000)) == "succeeded"
        assert all(bool((t == 5).all()) for t in again.tensors)
