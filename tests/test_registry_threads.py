"""The registry changed from another thread than the endpoint's loop's (row 360).

A release fails the push watches of the cache (futures of the endpoint's loop) and cuts the transfers served
against it, a new cache is offered to the links' same-host peers: only the loop's own thread may do that. From a
worker thread while that loop runs each is refused (``LLM_FAILED``, nothing changed); with the loop not running,
any thread may allocate, register and release.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from peers import DECODER_ID, PROMPT_ID, endpoint, options
from test_cache_manager import BLOCKS, S, register, rejected, v2_endpoint

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    MemInfo,
    Memtype,
    Placement,
)
from aio_datadist.testing import registry_of

HOST = CacheDesc(2, (4, 64), DataType.DT_UINT8, Placement.HOST)


async def _from_a_worker(call: Callable[[], Any]) -> BaseException | None:
    """What ``call`` raised in a worker thread (None: it returned) while this loop keeps running."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            out.append(None)
        except BaseException as exc:  # noqa: BLE001 (the test reads it)
            out.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 5
    while worker.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    worker.join(0.1)
    assert out, "the call did not return within 5 s"
    return out[0]


def _refused(exc: BaseException | None) -> bool:
    return isinstance(exc, LLMException) and exc.status_code is S.LLM_FAILED and "event loop" in str(exc)


@pytest.mark.asyncio
@pytest.mark.usefixtures("fork_server")
@pytest.mark.parametrize("how", ["unregister_cache", "deallocate_blocks_cache"])
async def test_a_v2_release_from_a_worker_thread_is_refused_and_the_watch_still_wakes_on_the_loop(how):
    """Before, the watch's futures were failed from the worker thread: the task awaiting the watch slept until
    something else woke the loop (without a timeout, for ever on an idle endpoint). Found by a hunt."""
    async with v2_endpoint(LLMRole.DECODER, DECODER_ID) as dd:
        cm = dd.cache_manager
        blocks, _ = register(cm, BLOCKS, 1, BlocksCacheKey(DECODER_ID, 0))
        watch = cm.watch_pushes(blocks, [0])
        waiter = asyncio.ensure_future(asyncio.shield(watch))
        release = ((lambda: cm.unregister_cache(blocks.cache_id)) if how == "unregister_cache" else
                   (lambda: cm.deallocate_blocks_cache(blocks)))
        assert _refused(await _from_a_worker(release))
        assert blocks.alive and registry_of(dd).all_caches() == [blocks] and not watch.done()  # nothing changed
        started = time.monotonic()
        release()  # on the loop: the watch fails at once
        with rejected(S.LLM_KV_CACHE_NOT_EXIST):
            await asyncio.wait_for(waiter, 1)
        assert time.monotonic() - started < 0.5


@pytest.mark.asyncio
async def test_v1_releases_from_a_worker_thread_are_refused_and_change_nothing():
    async with endpoint(LLMRole.PROMPT, PROMPT_ID) as dd:
        km = dd.kv_cache_manager
        key = CacheKey(PROMPT_ID, req_id=7)
        cache = km.allocate_cache(HOST, [key])
        assert _refused(await _from_a_worker(lambda: km.remove_cache_key(key)))
        assert _refused(await _from_a_worker(lambda: km.deallocate_cache(cache)))
        registry = registry_of(dd)
        assert registry.all_caches() == [cache] and registry.bound_to(key, cache)  # still offered
        km.deallocate_cache(cache)
        km.remove_cache_key(key)  # the last reference: the memory goes
        assert registry.all_caches() == []


@pytest.mark.asyncio
async def test_allocating_or_registering_from_a_worker_thread_is_refused_and_adds_nothing():
    async with endpoint(LLMRole.PROMPT, PROMPT_ID) as dd:
        km = dd.kv_cache_manager
        memory = [torch.zeros(4, 64, dtype=torch.uint8) for _ in range(2)]
        assert _refused(await _from_a_worker(lambda: km.allocate_blocks_cache(HOST)))
        assert _refused(await _from_a_worker(lambda: km.allocate_cache(HOST, [CacheKey(PROMPT_ID, req_id=1)])))
        assert _refused(await _from_a_worker(lambda: km.register_blocks_cache(HOST, memory)))
        assert registry_of(dd).all_caches() == []
        km.register_blocks_cache(HOST, memory)  # on the loop
        assert len(registry_of(dd).all_caches()) == 1


def test_with_the_endpoints_loop_not_running_any_thread_may_allocate_and_release():
    loop = asyncio.new_event_loop()
    try:
        dd = LLMDataDist(LLMRole.PROMPT, PROMPT_ID)
        loop.run_until_complete(dd.init(options()))
        km = dd.kv_cache_manager
        made: list[Any] = []
        worker = threading.Thread(target=lambda: made.append(km.allocate_blocks_cache(HOST)))
        worker.start()
        worker.join(5)
        assert len(made) == 1 and registry_of(dd).all_caches() == made
        cache = made[0]
        done: list[bool] = []
        worker = threading.Thread(target=lambda: (km.deallocate_cache(cache), done.append(True)))
        worker.start()
        worker.join(5)
        assert done == [True] and registry_of(dd).all_caches() == []
        loop.run_until_complete(dd.finalize())
    finally:
        loop.close()


@pytest.mark.asyncio
async def test_remap_from_a_worker_thread_is_refused_and_withdraws_nothing():
    """``remap_registered_memory`` withdraws each cache it covers and offers it again: from a worker thread while
    the loop runs that is refused as a release is (``LLM_FAILED``), and the cache stays offered."""
    async with v2_endpoint(LLMRole.PROMPT, PROMPT_ID) as dd:
        cm = dd.cache_manager
        rows, _ = register(cm, BLOCKS, 1, BlocksCacheKey(PROMPT_ID, 0))
        withdrawn: list[Any] = []
        registry = registry_of(dd)
        on_free = registry.on_free
        registry.on_free = lambda cache: (withdrawn.append(cache), on_free(cache))
        remap = lambda: cm.remap_registered_memory(MemInfo(Memtype.MEM_TYPE_DEVICE, rows.tensor_addrs[0], 64))  # noqa: E731
        assert _refused(await _from_a_worker(remap))
        assert withdrawn == [] and registry.all_caches() == [rows]
        remap()  # on the loop: withdrawn and offered again
        assert withdrawn == [rows] and registry.all_caches() == [rows]
