"""Polling a CacheTask's layer (``task.layer(i).done()``) keeps nothing, as ``PushWatch.layer`` (docs/async.md);
the futures it hands out still behave as before: each its own, cancelling one cancels nothing else."""

from __future__ import annotations

import asyncio
import gc
import warnings

import pytest
from test_layerwise import DST_BLOCKS, LAYERS, SRC_BLOCKS, Gate, blocks_config, setup

from aio_datadist import LLMException, LLMStatusCode

pytestmark = pytest.mark.asyncio

SUCCESS = LLMStatusCode.LLM_SUCCESS


def live_futures() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch's deprecated module attributes warns
        warnings.simplefilter("ignore", FutureWarning)
        return sum(isinstance(o, asyncio.Future) for o in gc.get_objects())


async def test_polling_a_pending_layer_keeps_nothing_per_poll() -> None:
    """Before, each call kept a shield future and a callback on the layer until it completed. A poll by
    ``asyncio.wait(..., timeout=0)`` keeps nothing either (audit, 2026-12-07: only ``done()`` was polled)."""
    async with setup() as s:
        gate = Gate()
        task = s.pm.transfer_cache_async(s.blocks_src(), gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        before = live_futures()
        for _ in range(3000):  # a scheduler step polling whether layer 0 is in place yet
            assert not task.layer(0).done()
        kept = live_futures() - before
        for _ in range(100):  # the usual non-blocking poll: its wait takes the callback back, nothing is held
            assert not (await asyncio.wait({task.layer(0)}, timeout=0))[0]
        assert not task._views.holding(), f"{task._views.holding()} views held after 100 timed-out waits"
        gate.open(*range(LAYERS))
        assert await asyncio.wait_for(task, 5) == [SUCCESS]
        assert kept < 50, f"{kept} futures kept alive by 3000 polls of a pending layer"


async def test_polling_hangs_nothing_on_the_layer_and_a_dropped_view_with_a_callback_still_calls_it() -> None:
    """The layer's future carries one done-callback however often it is polled, and a view given a callback and
    dropped is held by the task until it settles (audit, 2026-12-07: the test above counted futures only)."""
    async with setup() as s:
        gate = Gate()
        task = s.pm.transfer_cache_async(s.blocks_src(), gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        for _ in range(2000):
            assert not task.layer(0).done()
        gc.collect()
        held = len(task._progress.layers[0]._callbacks or ())
        assert held < 10, f"the pending layer's future holds {held} callbacks after 2000 polls"
        called: asyncio.Future = asyncio.get_running_loop().create_future()
        task.layer(1).add_done_callback(called.set_result)  # dropped at once: the task holds it for its callback
        gc.collect()
        gate.open(*range(LAYERS))
        assert await asyncio.wait_for(task, 5) == [SUCCESS]
        view = await asyncio.wait_for(called, 2)
        assert view.exception() is None


async def test_layer_futures_stay_independent_and_awaited_ones_are_kept() -> None:
    async with setup() as s:
        gate = Gate()
        task = s.pm.transfer_cache_async(s.blocks_src(), gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        first, second = task.layer(0), task.layer(0)
        assert first is not second
        first.cancel()  # a caller giving up its wait cancels neither the layer nor another caller's future
        waiter = asyncio.ensure_future(task.layer(1))  # only the waiting task refers to its layer future
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(task.layer(0), 0.01)  # cancelled by wait_for
        gc.collect()
        gate.open(*range(LAYERS))
        await asyncio.wait_for(second, 5)
        assert await asyncio.wait_for(waiter, 5) is None
        assert await asyncio.wait_for(task, 5) == [SUCCESS]
        assert task.layer(0).done() and task.layer(0).result() is None


async def test_layer_futures_end_as_the_transfer_does() -> None:
    async with setup() as s:
        gate = Gate({1: False})  # layer 1's synchronizer says False: the transfer fails there
        task = s.pm.transfer_cache_async(s.blocks_src(), gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        failed, never = task.layer(1), task.layer(2)
        gate.open(*range(LAYERS))
        for fut in (failed, never):
            with pytest.raises(LLMException) as info:
                await asyncio.wait_for(fut, 5)
            assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert await task.synchronize(5000) == LLMStatusCode.LLM_PARAM_INVALID
        gate = Gate()
        task = s.pm.transfer_cache_async(s.blocks_src(), gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        pending = task.layer(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(pending, 5)
        assert await task.synchronize(5000) == LLMStatusCode.LLM_FAILED
        assert task.layer(3).cancelled()
