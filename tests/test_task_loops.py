"""Layer-wise transfers, their CacheTask, EventLayerSynchronizer and the link and transfer coroutines used off
the endpoint's loop: from a helper loop (``asyncio.run`` in a worker thread), with no running loop, or (a
synchronizer's close) from the prefill thread."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from _v2peer import v2_options
from peers import DECODER_ID, PROMPT_ID, cluster_info, endpoint, port_of
from test_layerwise import (
    BLOCKS,
    DST_BLOCKS,
    LAYERS,
    SRC_BLOCKS,
    Gate,
    Ready,
    Setup,
    blocks_config,
    code_of,
    layer_landed,
    setup,
)

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKeyByIdAndIndex,
    EventLayerSynchronizer,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)

pytestmark = pytest.mark.asyncio

SUCCESS = LLMStatusCode.LLM_SUCCESS
FAILED = LLMStatusCode.LLM_FAILED


async def in_helper_loop(make: Callable[[], Awaitable[Any]], bound_s: float = 5.0) -> tuple[Any, float]:
    """What ``asyncio.run(make())`` returned or raised in a worker thread, and how long it took; the test's own
    loop keeps running meanwhile."""
    out: dict[str, Any] = {}

    async def bounded() -> Any:
        return await asyncio.wait_for(make(), bound_s)

    def run() -> None:
        start = time.monotonic()
        try:
            out["result"] = asyncio.run(bounded())
        except BaseException as exc:  # the test looks at it
            out["result"] = exc
        out["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=run)
    thread.start()
    async with asyncio.timeout(bound_s + 5):
        while thread.is_alive():
            await asyncio.sleep(0.005)
    return out["result"], out["elapsed"]


def refused(result: Any) -> bool:
    return isinstance(result, LLMException) and result.status_code == FAILED


async def awaited(what: Any) -> Any:
    """``await what`` (a task, a watch, a layer's future) in the caller's loop."""
    return await what


@contextlib.asynccontextmanager
async def quiet_setup() -> AsyncIterator[Setup]:
    """``test_layerwise.setup`` with a 5 s heartbeat on both ends: nothing but the code under test wakes the loop."""
    async with contextlib.AsyncExitStack() as stack:
        prompt = await stack.enter_async_context(
            endpoint(LLMRole.PROMPT, PROMPT_ID, listen=True, heartbeat_interval=5000))
        dd = await stack.enter_async_context(endpoint(LLMRole.DECODER, DECODER_ID, heartbeat_interval=5000))
        dst = dd.kv_cache_manager.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID, 0))
        assert await dd.link_clusters([cluster_info(PROMPT_ID, port_of(prompt))]) == (SUCCESS, [SUCCESS])
        yield Setup(prompt, [dd], [dst])


# -- transfers and links from another loop ---------------------------------------------------------------


async def test_transfer_cache_async_from_a_helper_loop_is_refused_with_nothing_sent() -> None:
    """Before, every byte landed and the task then reported LLM_TIMEOUT: its layers' answers were set from the
    endpoint's thread on futures of the helper loop, which nothing woke."""
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]

        async def transfer() -> Any:
            return await s.pm.transfer_cache_async(src, Ready(), [blocks_config()], SRC_BLOCKS, DST_BLOCKS)

        result, _ = await in_helper_loop(transfer)
        assert refused(result), repr(result)
        assert not any(layer_landed(dst, src, layer, DST_BLOCKS, SRC_BLOCKS) for layer in range(LAYERS))
        task = s.pm.transfer_cache_async(src, Ready(), [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        assert await asyncio.wait_for(task, 5) == [SUCCESS]  # from the endpoint's loop it works


async def test_transfer_and_link_coroutines_from_a_helper_loop_are_refused() -> None:
    """Pushes, pulls, copies and the link calls, each refused before anything is sent or dialled (before, a push
    timed out after its bytes landed, a link made there died with the helper loop, a probe timed out)."""
    async with setup() as s:
        src, dst, decoder = s.blocks_src(), s.dsts[0], s.decoders[0]
        s.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "push_blocks": lambda: s.pm.push_blocks(BlocksCacheKey(DECODER_ID, 0), src, [1], [2], timeout=500),
            "pull_blocks": lambda: s.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, [1], [3], timeout=500),
            "copy_blocks": lambda: s.pm.copy_blocks(src, {1: [5]}, timeout=500),
            "check_link_status": lambda: decoder.check_link_status(PROMPT_ID),
            "unlink_clusters": lambda: decoder.unlink_clusters([cluster_info(PROMPT_ID, port_of(s.prompt))]),
        }
        for name, call in calls.items():
            result, _ = await in_helper_loop(call, bound_s=2.0)
            assert refused(result), f"{name}: {result!r}"
        assert await decoder.unlink_clusters([cluster_info(PROMPT_ID, port_of(s.prompt))]) == (SUCCESS, [SUCCESS])
        result, _ = await in_helper_loop(lambda: decoder.link_clusters([cluster_info(PROMPT_ID, port_of(s.prompt))]))
        assert refused(result), f"link_clusters: {result!r}"
        # nothing was dialled (audit, 2026-12-07: it passed with the check after the dial): no link on either end
        assert await code_of(decoder.check_link_status(PROMPT_ID)) == LLMStatusCode.LLM_NOT_YET_LINK
        assert await decoder.link_clusters([cluster_info(PROMPT_ID, port_of(s.prompt))]) == (SUCCESS, [SUCCESS])


async def test_cache_manager_coroutines_from_a_helper_loop_are_refused() -> None:
    """The CacheManager's transfers run through the KvCacheManager's: refused too (not LLM_NOT_YET_LINK), its
    transfer_cache_async included, and swap_blocks and a copy of device blocks on the host backend (audit,
    2026-12-07: they passed with the check in the KvCacheManager's transfer_cache_async only, or after the device
    copies' branch)."""
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as dd:
        await dd.init({**v2_options(), "aio.DeviceType": "host"})  # type: ignore[arg-type]
        cm = dd.cache_manager
        blocks = cm.allocate_blocks_cache(BLOCKS)
        rows = cm.allocate_cache(BLOCKS)
        device = cm.allocate_blocks_cache(CacheDesc(BLOCKS.num_tensors, BLOCKS.shape, BLOCKS.data_type,
                                                    Placement.DEVICE))
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "push_blocks": lambda: cm.push_blocks(BlocksCacheKey(DECODER_ID, 0), blocks, [1], [2], timeout=500),
            "push_cache": lambda: cm.push_cache(CacheKeyByIdAndIndex(DECODER_ID, 1, 0), rows, timeout=500),
            "pull_cache": lambda: cm.pull_cache(CacheKeyByIdAndIndex(DECODER_ID, 1, 0), rows, timeout=500),
            "copy_cache": lambda: cm.copy_cache(rows, rows, 0, 1, timeout=500),
            "swap_blocks": lambda: cm.swap_blocks(blocks, device, {1: 2}, timeout=500),
            "copy_blocks": lambda: cm.copy_blocks(device, {1: [5]}, timeout=500),
            # its own entry into the layer-wise transfer (not the KvCacheManager's transfer_cache_async)
            "transfer_cache_async": lambda: awaited(cm.transfer_cache_async(blocks, Ready(), [blocks_config()],
                                                                            [1], [2])),
        }
        for name, call in calls.items():
            result, _ = await in_helper_loop(call, bound_s=2.0)
            assert refused(result), f"{name}: {result!r}"


async def test_link_unlink_and_switch_role_from_a_helper_loop_are_refused() -> None:
    """The v2 link calls and switch_role, refused from a helper loop before their arguments are looked at and
    the role left as it was (audit, 2026-12-07: none was called from a helper loop)."""
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as dd:
        await dd.init(v2_options(listen=True))  # type: ignore[arg-type]
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "link": lambda: dd.link("comm", {PROMPT_ID: 0}, "{}"),
            "unlink": lambda: dd.unlink(1),
            "switch_role": lambda: dd.switch_role(LLMRole.DECODER),
        }
        for name, call in calls.items():
            result, _ = await in_helper_loop(call, bound_s=2.0)
            assert refused(result), f"{name}: {result!r}"
        assert dd.role is LLMRole.PROMPT


# -- a CacheTask waited on from another loop -----------------------------------------------------------------


async def test_a_finished_task_answers_another_loop_at_once() -> None:
    """Before, get_results(ms) from a helper loop waited out ms though the task had ended (None: for ever)."""
    async with setup() as s:
        task = s.pm.transfer_cache_async(s.blocks_src(), Ready(), [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        early = task.layer(0)  # asked for while pending (a view), awaited once done
        assert not early.done()
        assert await asyncio.wait_for(task, 5) == [SUCCESS]
        for wait in (lambda: task.get_results(1000), lambda: task.synchronize(1000), lambda: task.get_results(),
                     lambda: awaited(task.layer(0)), lambda: awaited(early)):
            result, elapsed = await in_helper_loop(wait, bound_s=2.0)
            assert result in ([SUCCESS], SUCCESS, None), repr(result)
            assert elapsed < 0.5, f"a finished task's answer took {elapsed:.2f} s"


async def test_awaiting_a_finished_task_answers_another_loop_at_once() -> None:
    """``await task`` from a helper loop, once the task ended: its results, at once (audit, 2026-12-07: the test
    above awaited only the task's methods and a layer's future there)."""
    async with setup() as s:
        task = s.pm.transfer_cache_async(s.blocks_src(), Ready(), [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        assert await asyncio.wait_for(task, 5) == [SUCCESS]
        result, elapsed = await in_helper_loop(lambda: awaited(task), bound_s=2.0)
        assert result == [SUCCESS], repr(result)
        assert elapsed < 0.5, f"a finished task's answer took {elapsed:.2f} s"


async def test_waiting_from_another_loop_for_a_running_task_is_refused() -> None:
    """Before, synchronize(ms) from a helper loop was not woken when the task ended: it ran out ms and reported
    the time-out code for a transfer that had succeeded; awaiting a pending layer's future raised a bare
    RuntimeError (row 271)."""
    async with setup() as s:
        gate = Gate()
        task = s.pm.transfer_cache_async(s.blocks_src(), gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        for wait in (lambda: task.synchronize(1000), lambda: task.get_results(1000), lambda: task,
                     lambda: awaited(task.layer(0)),
                     # asyncio's helpers reach the view through get_loop / add_done_callback, not __await__
                     lambda: asyncio.wait_for(task.layer(0), 1), lambda: asyncio.gather(task.layer(0)),
                     lambda: asyncio.wait({task.layer(0)}, timeout=1)):
            result, elapsed = await in_helper_loop(wait, bound_s=2.0)
            assert refused(result), repr(result)
            assert elapsed < 0.5, f"refused after {elapsed:.2f} s"
        gate.open(*range(LAYERS))
        assert await asyncio.wait_for(task, 5) == [SUCCESS]  # the task went on


async def test_cancel_threadsafe_from_another_thread_cancels_the_transfer_on_its_loop() -> None:
    """``CacheTask.cancel_threadsafe()`` from a worker thread (as a signal handler or the blocking facade's cancel
    does) hands the cancel to the task's loop: the transfer waiting for its first layer ends cancelled, and no
    layer moves; once the task is over, it does nothing."""
    async with setup() as s:
        gate, src = Gate(), s.blocks_src()
        task = s.pm.transfer_cache_async(src, gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        await gate.asked_for(0)
        worker = threading.Thread(target=task.cancel_threadsafe)
        worker.start()
        worker.join(5)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        assert task.done() and not layer_landed(s.dsts[0], src, 0, DST_BLOCKS, SRC_BLOCKS)
        task.cancel_threadsafe()  # over: nothing to do


async def test_a_layer_future_is_refused_where_it_is_awaited_not_where_it_was_asked_for() -> None:
    """A helper loop may ask for ``task.layer(i)`` and hand the wait to the endpoint's loop, as the refusal says
    to; a future asked for on the endpoint's loop and awaited on a helper loop is refused (``LLM_FAILED``), not
    asyncio's bare ``RuntimeError`` (both found by review of row 271)."""
    async with setup() as s:
        gate = Gate()
        task = s.pm.transfer_cache_async(s.blocks_src(), gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        home = asyncio.get_running_loop()

        async def handed_home() -> Any:
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(awaited(task.layer(0)), home))

        handed = asyncio.ensure_future(in_helper_loop(handed_home, bound_s=3.0))
        await asyncio.sleep(0.05)
        gate.open(*range(LAYERS))
        result, _ = await handed
        assert result is None, repr(result)
        later = Gate()
        task = s.pm.transfer_cache_async(s.blocks_src(), later, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        view = task.layer(0)  # asked for here
        result, _ = await in_helper_loop(lambda: awaited(view), bound_s=2.0)
        assert refused(result), repr(result)
        later.open(*range(LAYERS))
        assert await asyncio.wait_for(task, 5) == [SUCCESS]


async def test_waiting_for_a_push_watch_from_another_loop_is_refused() -> None:
    """Before, a bare RuntimeError (``await watch``, a layer's future) or ValueError (``wait(ms)``); a thread
    with no loop running may still poll a layer (row 271)."""
    async with setup() as s:
        with s.dm.watch_pushes(s.dsts[0], DST_BLOCKS) as watch:
            for wait in (lambda: awaited(watch), lambda: watch.wait(1000), lambda: awaited(watch.layer(0))):
                result, elapsed = await in_helper_loop(wait, bound_s=2.0)
                assert refused(result), repr(result)
                assert elapsed < 0.5, f"refused after {elapsed:.2f} s"
            polled: list[Any] = []
            thread = threading.Thread(target=lambda: polled.append(watch.layer(0).done()))
            thread.start()
            thread.join(5)
            assert polled == [False]


# -- EventLayerSynchronizer off the loop -----------------------------------------------------------------------


async def test_a_synchronizer_made_on_a_helper_loop_is_refused() -> None:
    """Before, its futures lived on the helper loop: every layer recorded, the transfer still waited out
    timeout_ms and failed ('layer_synchronizer returned False'); with timeout_ms=None it hung. Refused before
    its layers are expected (audit, 2026-12-07: it passed with the check after, which left them pending)."""
    async with setup() as s:
        async def make() -> EventLayerSynchronizer:
            return EventLayerSynchronizer(s.prompt, LAYERS, timeout_ms=300)

        completions = s.prompt._require_runtime().completions
        pending = completions.pending_count()
        result, _ = await in_helper_loop(make)
        assert refused(result), repr(result)
        assert completions.pending_count() == pending, "a refused synchronizer left its layers expected"


async def test_a_synchronizer_made_with_no_running_loop_is_refused() -> None:
    """Before, a bare RuntimeError."""
    async with setup() as s:
        out: list[BaseException] = []

        def make() -> None:
            try:
                EventLayerSynchronizer(s.prompt, LAYERS)
            except BaseException as exc:  # the test looks at it
                out.append(exc)

        thread = threading.Thread(target=make)
        thread.start()
        thread.join(5)
        assert out and refused(out[0]), repr(out)


@pytest.mark.parametrize("prefill_loop", [False, True])
async def test_closing_the_synchronizer_in_the_prefill_thread_stops_the_transfer_at_once(prefill_loop: bool) -> None:
    """The prefill thread records layer 0, then fails and leaves ``with sync:``; the transfer waiting for layer 1
    (timeout_ms=None) stops at once with LLM_PARAM_INVALID. Before, the close cancelled the loop's future from that
    thread without waking the loop: the transfer went on waiting until something else woke it (the heartbeat).
    A prefill thread running a loop of its own is off the endpoint's loop too (audit, 2026-12-07: it passed with
    a cancel made directly wherever some loop ran)."""
    async with quiet_setup() as s:
        src = s.blocks_src()
        sync = EventLayerSynchronizer(s.prompt, LAYERS, timeout_ms=None)
        task = s.pm.transfer_cache_async(src, sync, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        closed: list[float] = []

        def prefill() -> None:
            with sync:
                sync.record(0)
                time.sleep(0.05)  # layer 1's compute fails: leaving the block closes the synchronizer
                closed.append(time.monotonic())  # before the close: the transfer may end before this thread runs on

        async def prefill_on_its_loop() -> None:
            prefill()

        thread = threading.Thread(target=(lambda: asyncio.run(prefill_on_its_loop())) if prefill_loop else prefill)
        thread.start()
        await asyncio.wait_for(task.layer(0), 5)
        result = await asyncio.wait_for(task.synchronize(), 1.0)
        stopped = time.monotonic()
        thread.join(5)
        lag = stopped - closed[0]
        assert result == LLMStatusCode.LLM_PARAM_INVALID
        assert lag < 0.3, f"the transfer stopped {lag:.2f} s after the synchronizer was closed"
