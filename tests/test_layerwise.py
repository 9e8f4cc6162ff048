"""Layer-wise push (``transfer_cache_async``), its CacheTask and push watches, in one loop.

A PROMPT and a DECODER (or two) run in the test's event loop. Most tests
drive the transfer with a :class:`Gate`, a synchronizer that releases layer
``i`` only when the test says so, so each test can look at the destination
between layers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import numpy
import pytest
import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    EventLayerSynchronizer,
    KvCache,
    LayerSynchronizer,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from aio_datadist.testing import link_to, runtime_of
from peers import DECODER_ID, PROMPT_ID, TRANSPORT, TRANSPORTS, cluster_info, endpoint, fill, port_of, same, snapshot

pytestmark = pytest.mark.asyncio


@pytest.fixture(autouse=True, params=[t for t in TRANSPORTS if t != "local"])
def transport(request):
    """Every layer-wise transfer runs over TCP data channels and over NIXL WRITEs."""
    TRANSPORT["default"] = request.param
    yield request.param
    TRANSPORT["default"] = "tcp"

SUCCESS = LLMStatusCode.LLM_SUCCESS
PARAM_INVALID = LLMStatusCode.LLM_PARAM_INVALID
LAYERS = 4
#: 4 layers (K0, V0, ... K3, V3) of 16 blocks of 128 bytes; 3 rows of 512 bytes.
BLOCKS = CacheDesc(2 * LAYERS, (16, 4, 16), DataType.DT_FLOAT16, Placement.HOST)
ROWS = CacheDesc(2 * LAYERS, (3, 256), DataType.DT_FLOAT16, Placement.HOST)
SRC_BLOCKS = [1, 2, 3, 9]
DST_BLOCKS = [7, 8, 0, 15]
SECOND_DECODER_ID = 3
BOUND_S = 1.0  # how long a cancel or a failure may take to end a task


class Gate(LayerSynchronizer):
    """An ``async def`` synchronizer: layer ``i`` goes once the test calls :meth:`open`."""

    def __init__(self, verdicts: dict[int, Any] | None = None) -> None:
        self.released: dict[int, asyncio.Event] = {}
        self.waiting: dict[int, asyncio.Event] = {}
        self.asked: list[int] = []
        self.verdicts = verdicts or {}  # layer -> False, or an exception to raise

    @staticmethod
    def _event(events: dict[int, asyncio.Event], layer: int) -> asyncio.Event:
        return events.setdefault(layer, asyncio.Event())

    def open(self, *layers: int) -> None:
        for layer in layers:
            self._event(self.released, layer).set()

    async def asked_for(self, layer: int) -> None:
        """Until the transfer waits for ``layer`` (bounded)."""
        async with asyncio.timeout(5):
            await self._event(self.waiting, layer).wait()

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.asked.append(layer_index)
        self._event(self.waiting, layer_index).set()
        await self._event(self.released, layer_index).wait()
        verdict = self.verdicts.get(layer_index, True)
        if isinstance(verdict, BaseException):
            raise verdict
        return verdict


class Ready(LayerSynchronizer):
    """A plain synchronizer: every layer is ready (it runs in a worker thread)."""

    def __init__(self) -> None:
        self.threads: set[str] = set()

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.threads.add(threading.current_thread().name)
        return True


class AsyncReady(LayerSynchronizer):
    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        await asyncio.sleep(0)
        return True


# -- endpoints and caches -------------------------------------------------------


class Setup:
    """PROMPT ``1`` listening, DECODER ``2`` (and ``3``) linked to it, caches on all of them."""

    def __init__(self, prompt: LLMDataDist, decoders: list[LLMDataDist], dsts: list[KvCache]) -> None:
        self.prompt = prompt
        self.decoders = decoders
        self.dsts = dsts  # each decoder's keyed blocks cache
        self.pm = prompt.kv_cache_manager
        self.dm = decoders[0].kv_cache_manager

    def blocks_src(self, seed: int = 1) -> KvCache:
        cache = self.pm.allocate_blocks_cache(BLOCKS)
        fill(cache, seed)
        return cache


@contextlib.asynccontextmanager
async def setup(decoders: int = 1, **prompt_config: Any) -> AsyncIterator[Setup]:
    """Decoders key a blocks cache ``BlocksCacheKey(own id, 0)`` before linking (same block shape)."""
    async with contextlib.AsyncExitStack() as stack:
        prompt = await stack.enter_async_context(endpoint(LLMRole.PROMPT, PROMPT_ID, listen=True, **prompt_config))
        ends, dsts = [], []
        for cluster_id in (DECODER_ID, SECOND_DECODER_ID)[:decoders]:
            dd = await stack.enter_async_context(endpoint(LLMRole.DECODER, cluster_id))
            dsts.append(dd.kv_cache_manager.allocate_blocks_cache(BLOCKS, BlocksCacheKey(cluster_id, 0)))
            status = await dd.link_clusters([cluster_info(PROMPT_ID, port_of(prompt))])
            assert status == (SUCCESS, [SUCCESS])
            ends.append(dd)
        yield Setup(prompt, ends, dsts)


def layer_landed(dst: KvCache, src: KvCache, layer: int, dst_rows: Sequence[int], src_rows: Sequence[int],
                 dst_layer: int | None = None) -> bool:
    d = layer if dst_layer is None else dst_layer
    return all(torch.equal(dst.tensors[2 * d + k][list(dst_rows)], src.tensors[2 * layer + k][list(src_rows)])
               for k in range(2))


def untouched(dst: KvCache, before: list[torch.Tensor], layers: Sequence[int]) -> bool:
    return all(torch.equal(dst.tensors[t], before[t]) for layer in layers for t in (2 * layer, 2 * layer + 1))


def blocks_config(cluster_id: int = DECODER_ID, **kwargs: Any) -> TransferWithCacheKeyConfig:
    return TransferWithCacheKeyConfig(BlocksCacheKey(cluster_id, 0), **kwargs)


async def code_of(awaitable: Any) -> LLMStatusCode:
    with pytest.raises(LLMException) as info:
        await awaitable
    return info.value.status_code


# -- order and arrival -----------------------------------------------------------


async def test_layer_futures_resolve_in_order_after_the_bytes_landed() -> None:
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        before = snapshot(dst)
        gate = Gate()
        task = s.pm.transfer_cache_async(src, gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        for layer in range(LAYERS):
            gate.open(layer)
            await task.layer(layer)
            assert layer_landed(dst, src, layer, DST_BLOCKS, SRC_BLOCKS)
            assert untouched(dst, before, range(layer + 1, LAYERS)), "a layer landed before its release"
            assert not any(task.layer(later).done() for later in range(layer + 1, LAYERS))
        assert await task == [SUCCESS]
        assert task.done()
        assert await task.get_results() == [SUCCESS]
        assert await task.synchronize() == SUCCESS


async def test_all_layers_released_at_once_still_confirm_in_order() -> None:
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        seen: list[tuple[int, bool]] = []
        task = s.pm.transfer_cache_async(src, Ready(), [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        for layer in range(LAYERS):
            task.layer(layer).add_done_callback(
                lambda f, i=layer: seen.append((i, layer_landed(dst, src, i, DST_BLOCKS, SRC_BLOCKS))))
        assert await task == [SUCCESS]
        await asyncio.sleep(0)
        assert seen == [(layer, True) for layer in range(LAYERS)]


@pytest.mark.parametrize("synchronizer", [Ready, AsyncReady], ids=["plain", "async"])
async def test_plain_and_async_synchronizers(synchronizer: type) -> None:
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        sync = synchronizer()
        task = s.pm.transfer_cache_async(src, sync, (blocks_config(),), SRC_BLOCKS, DST_BLOCKS)
        assert await task == [SUCCESS]
        assert all(layer_landed(dst, src, layer, DST_BLOCKS, SRC_BLOCKS) for layer in range(LAYERS))
        if isinstance(sync, Ready):  # a plain method must not block the event loop's thread
            assert threading.current_thread().name not in sync.threads


# -- the synchronizer stops the transfer ------------------------------------------


async def test_synchronizer_false_stops_with_param_invalid() -> None:
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        before = snapshot(dst)
        gate = Gate({2: False})
        gate.open(*range(LAYERS))
        task = s.pm.transfer_cache_async(src, gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        assert await code_of(task) == PARAM_INVALID
        assert await task.get_results() == [PARAM_INVALID]
        assert await task.synchronize() == PARAM_INVALID
        await task.layer(0)
        await task.layer(1)
        assert await code_of(task.layer(2)) == PARAM_INVALID
        assert await code_of(task.layer(3)) == PARAM_INVALID
        assert gate.asked == [0, 1, 2]
        assert layer_landed(dst, src, 0, DST_BLOCKS, SRC_BLOCKS) and layer_landed(dst, src, 1, DST_BLOCKS, SRC_BLOCKS)
        assert untouched(dst, before, [2, 3])


@pytest.mark.parametrize(("false_at", "expected"), [
    (0, [PARAM_INVALID, None]),  # the second config never started
    (1, [PARAM_INVALID, None]),
    (2, [SUCCESS, PARAM_INVALID]),  # the first had finished
])
async def test_synchronizer_false_results_per_config(false_at: int, expected: list) -> None:
    async with setup() as s:
        src = s.blocks_src()
        gate = Gate({false_at: False})
        gate.open(*range(LAYERS))
        configs = [blocks_config(src_layer_range=range(0, 2)), blocks_config(src_layer_range=range(2, 4))]
        task = s.pm.transfer_cache_async(src, gate, configs, SRC_BLOCKS, DST_BLOCKS)
        assert await code_of(task) == PARAM_INVALID
        assert await task.get_results() == expected


async def test_synchronizer_that_raises() -> None:
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        before = snapshot(dst)
        boom = RuntimeError("compute failed")
        gate = Gate({1: boom})
        gate.open(*range(LAYERS))
        task = s.pm.transfer_cache_async(src, gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        with pytest.raises(LLMException) as info:
            await task
        assert info.value.status_code == LLMStatusCode.LLM_FAILED
        assert "compute failed" in str(info.value)
        assert await task.get_results() == [LLMStatusCode.LLM_FAILED]
        await task.layer(0)
        assert layer_landed(dst, src, 0, DST_BLOCKS, SRC_BLOCKS)
        assert untouched(dst, before, [1, 2, 3])
        # the link is fine: the next transfer goes through
        assert await s.pm.transfer_cache_async(src, Ready(), [blocks_config()], SRC_BLOCKS, DST_BLOCKS) == [SUCCESS]


async def test_synchronizer_that_raises_cancelled_error_is_a_failure_not_a_cancel() -> None:
    """A CancelledError of the synchronizer's own (a future it awaited was cancelled), with nobody
    cancelling the task, stops it as any raising synchronizer does: LLM_FAILED, not a cancelled task."""
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        before = snapshot(dst)
        gate = Gate({1: asyncio.CancelledError()})
        gate.open(*range(LAYERS))
        task = s.pm.transfer_cache_async(src, gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        async with asyncio.timeout(5):
            assert await code_of(task) == LLMStatusCode.LLM_FAILED
        assert await task.synchronize() == LLMStatusCode.LLM_FAILED
        assert await task.get_results() == [LLMStatusCode.LLM_FAILED]
        await task.layer(0)
        assert layer_landed(dst, src, 0, DST_BLOCKS, SRC_BLOCKS)
        assert await code_of(task.layer(1)) == LLMStatusCode.LLM_FAILED
        assert untouched(dst, before, [1, 2, 3])


# -- EventLayerSynchronizer ----------------------------------------------------------


async def test_event_synchronizer_records_from_the_loop_and_from_a_thread() -> None:
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        with EventLayerSynchronizer(s.prompt, LAYERS) as events:
            task = s.pm.transfer_cache_async(src, events, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
            events.record(0)
            await task.layer(0)
            assert layer_landed(dst, src, 0, DST_BLOCKS, SRC_BLOCKS)
            assert not task.layer(1).done()

            def prefill() -> None:
                for layer in range(1, LAYERS):
                    time.sleep(0.01)
                    events.record(layer)

            thread = threading.Thread(target=prefill)
            thread.start()
            try:
                assert await task == [SUCCESS]
            finally:
                thread.join(5)
        assert all(layer_landed(dst, src, layer, DST_BLOCKS, SRC_BLOCKS) for layer in range(LAYERS))


@pytest.mark.loops_take_turns  # (the transport and the loop are independent here)
async def test_event_synchronizer_closed_right_after_its_last_record_keeps_every_layer() -> None:
    """``close()`` (the end of the ``with`` block) releases only layers never recorded: a layer recorded just
    before, whose record the loop has not drained yet, stays recorded. Before, ``close`` dropped those too and
    the transfer stopped with ``LLM_PARAM_INVALID`` ("layer_synchronizer returned False")."""
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        with EventLayerSynchronizer(s.prompt, LAYERS) as events:
            task = s.pm.transfer_cache_async(src, events, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
            for layer in range(LAYERS):
                await asyncio.sleep(0)  # the prefill computes the layer
                events.record(layer)
        assert await asyncio.wait_for(task, BOUND_S) == [SUCCESS]
        assert all(layer_landed(dst, src, layer, DST_BLOCKS, SRC_BLOCKS) for layer in range(LAYERS))


class _PostThenClose:
    """The completion queue, whose post is followed at once by the synchronizer's close (a prefill thread
    recording its last layer as the ``with`` block around the synchronizer ends on the loop's thread)."""

    def __init__(self, queue: Any, events: EventLayerSynchronizer) -> None:
        self._queue, self._events = queue, events

    def post(self, *args: int) -> None:
        self._queue.post(*args)
        self._events.close()


@pytest.mark.loops_take_turns  # (the transport and the loop are independent here)
async def test_event_synchronizer_record_that_returned_is_kept_by_a_close_meanwhile() -> None:
    """A ``record()`` that returned is recorded, whatever ``close()`` did meanwhile from another thread (the
    first form of row 227 counted the layer recorded only after its post: found by review)."""
    async with endpoint(LLMRole.PROMPT, PROMPT_ID) as dd:
        events = EventLayerSynchronizer(dd, 1)
        events._queue = _PostThenClose(events._queue, events)  # type: ignore[assignment]
        events.record(0)
        assert await asyncio.wait_for(events.synchronize_layer(0, 1000), BOUND_S)


@pytest.mark.loops_take_turns  # (the transport and the loop are independent here)
async def test_an_event_synchronizer_dropped_without_close_releases_its_unrecorded_layers() -> None:
    """A synchronizer the caller drops without ``close()`` (a transfer that failed or was given up before its
    last layers were recorded) releases, once collected, the layers it never recorded, as ``close()`` does; a
    layer it recorded is kept. Before, each such layer stayed in the endpoint's completions until finalize
    (about 0.7 KB each, for every transfer of a long-running prefill; found by a hunt, 2026-12-07)."""
    import gc

    async with endpoint(LLMRole.PROMPT, PROMPT_ID) as dd:
        completions = dd._require_runtime().completions
        before = completions.pending_count()
        events = EventLayerSynchronizer(dd, 8)
        events.record(0)
        first = events._layers[0][1]
        await asyncio.wait_for(events.synchronize_layer(0, 1000), BOUND_S)
        layers = [future for _, future in events._layers[1:]]
        assert completions.pending_count() == before + 7
        del events
        gc.collect()
        assert completions.pending_count() == before
        assert all(future.cancelled() for future in layers) and first.done() and not first.cancelled()
        closed = EventLayerSynchronizer(dd, 2)
        closed.close()  # closed: nothing left for its collection to do
        del closed
        gc.collect()
        assert completions.pending_count() == before


@pytest.mark.loops_take_turns  # (the transport and the loop are independent here)
async def test_event_synchronizer_layer_armed_on_a_stream_survives_the_close() -> None:
    """A layer recorded on a stream whose work is not there yet (armed) when the synchronizer closes stays
    recorded: it is reported done once the stream gets there, while a layer never recorded is released. The
    tests above record on the CPU only, and passed with an armed layer dropped by the close (audit, 2026-12-07)."""
    async with endpoint(LLMRole.PROMPT, PROMPT_ID, device_type="host") as dd:
        stream = runtime_of(dd).devices.new_stream()
        with EventLayerSynchronizer(dd, 2, timeout_ms=None) as events:
            gate = stream.gate()
            events.record(0, stream=stream)  # armed behind the closed gate
            with pytest.raises(LLMException, match="already recorded"):  # a second record keeps the armed one
                events.record(0, stream=stream)
        assert await asyncio.wait_for(events.synchronize_layer(1, 2000), BOUND_S) is False
        gate.open()
        assert await asyncio.wait_for(events.synchronize_layer(0, 2000), BOUND_S) is True


async def test_event_synchronizer_recorded_after_its_endpoint_was_finalized_says_so() -> None:
    """A prefill thread that records after the endpoint went gets LLM_ENGINE_FINALIZED (it got a bare
    ValueError from the closed completion queue)."""
    async with setup() as s:
        events = EventLayerSynchronizer(s.prompt, LAYERS)
        await s.prompt.finalize()
        with pytest.raises(LLMException) as info:
            events.record(0)
        assert info.value.status_code == LLMStatusCode.LLM_ENGINE_FINALIZED


async def test_event_synchronizer_recorded_on_a_stream_after_its_endpoint_was_finalized_says_so() -> None:
    """On a stream too: the closed notifier's refusal read as "already recorded on a stream" before."""
    async with setup(device_type="host") as s:
        stream = runtime_of(s.prompt).devices.stream
        events = EventLayerSynchronizer(s.prompt, LAYERS)
        await s.prompt.finalize()
        with pytest.raises(LLMException) as info:
            events.record(0, stream)
        assert info.value.status_code == LLMStatusCode.LLM_ENGINE_FINALIZED


async def test_event_synchronizer_recorded_before_the_transfer() -> None:
    async with setup() as s:
        src = s.blocks_src()
        with EventLayerSynchronizer(s.prompt, LAYERS) as events:
            for layer in range(LAYERS):
                events.record(layer)
            task = s.pm.transfer_cache_async(src, events, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
            assert await task == [SUCCESS]


async def test_event_synchronizer_not_recorded_in_time_stops_the_transfer() -> None:
    async with setup(sync_kv_timeout=200) as s:
        src = s.blocks_src()
        with EventLayerSynchronizer(s.prompt, LAYERS) as events:
            events.record(0)
            task = s.pm.transfer_cache_async(src, events, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
            start = time.monotonic()
            assert await code_of(task) == PARAM_INVALID
            assert time.monotonic() - start < 0.2 + BOUND_S
            await task.layer(0)


async def test_event_synchronizer_closed_while_a_transfer_waits() -> None:
    async with setup() as s:
        src = s.blocks_src()
        events = EventLayerSynchronizer(s.prompt, LAYERS)
        events.record(0)
        task = s.pm.transfer_cache_async(src, events, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        await task.layer(0)
        events.close()
        # closing is not a cancel of the transfer: it stops like a synchronizer returning False
        assert await code_of(task) == PARAM_INVALID
        assert await task.get_results() == [PARAM_INVALID]
        with pytest.raises(LLMException) as info:
            events.record(1)
        assert info.value.status_code == PARAM_INVALID


async def test_an_event_synchronizer_left_open_logs_nothing_when_its_endpoint_finalizes(caplog) -> None:
    """Prefill code that raised before its ``close`` (or never needed one): the layers never recorded fail as the
    endpoint finalizes, and nobody awaits them. Before, asyncio logged "Future exception was never retrieved"
    with a traceback for each (found by a hunt)."""
    import gc

    caplog.set_level(logging.ERROR, logger="asyncio")
    async with setup() as s:
        src = s.blocks_src()
        sync = EventLayerSynchronizer(s.prompt, LAYERS)
        task = s.pm.transfer_cache_async(src, sync, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        sync.record(0)
        async with asyncio.timeout(5):
            await task.layer(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, LLMException):
            await task
        EventLayerSynchronizer(s.prompt, 2)  # and one no transfer ever used
    del sync, task
    gc.collect()
    assert "never retrieved" not in caplog.text, caplog.text


async def test_event_synchronizer_bad_arguments() -> None:
    async with setup() as s:
        with EventLayerSynchronizer(s.prompt, 2) as events:
            for bad in (2, -1, "0"):
                with pytest.raises((LLMException, TypeError)):
                    events.record(bad)
            with pytest.raises(LLMException) as info:
                events.record(0, stream=object())
            assert info.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
        with pytest.raises(LLMException):
            EventLayerSynchronizer(s.prompt, 0)


# -- cancellation and timeouts -----------------------------------------------------------


async def _after_cancel(s: Setup, src: KvCache, dst: KvCache, before: list[torch.Tensor], task: Any) -> None:
    """The task ended cancelled; layers 0-1 landed, 2-3 did not; the link still works."""
    assert task.done()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(asyncio.CancelledError):
        await task.layer(2)
    await task.layer(1)
    assert await task.synchronize(0) != SUCCESS
    assert untouched(dst, before, [2, 3])
    assert layer_landed(dst, src, 1, DST_BLOCKS, SRC_BLOCKS)
    again = s.pm.transfer_cache_async(src, Ready(), [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
    assert await again == [SUCCESS]
    assert all(layer_landed(dst, src, layer, DST_BLOCKS, SRC_BLOCKS) for layer in range(LAYERS))


async def test_cancel_from_another_task() -> None:
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        before = snapshot(dst)
        gate = Gate()
        gate.open(0, 1)
        task = s.pm.transfer_cache_async(src, gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        await task.layer(1)
        await gate.asked_for(2)

        async def canceller() -> None:
            task.cancel()
            task.cancel()  # idempotent

        start = time.monotonic()
        await asyncio.create_task(canceller())
        await asyncio.wait_for(task.synchronize(), BOUND_S)
        assert time.monotonic() - start < BOUND_S
        await _after_cancel(s, src, dst, before, task)


async def test_cancel_while_layers_are_in_flight() -> None:
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        task = s.pm.transfer_cache_async(src, Ready(), [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        await asyncio.sleep(0)
        start = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - start < BOUND_S
        again = s.pm.transfer_cache_async(src, Ready(), [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        assert await again == [SUCCESS]
        assert all(layer_landed(dst, src, layer, DST_BLOCKS, SRC_BLOCKS) for layer in range(LAYERS))


async def test_asyncio_timeout_around_await_task() -> None:
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        before = snapshot(dst)
        gate = Gate()
        gate.open(0, 1)
        task = s.pm.transfer_cache_async(src, gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await task
        assert time.monotonic() - start < 0.2 + BOUND_S
        await asyncio.wait_for(task.synchronize(), BOUND_S)
        await _after_cancel(s, src, dst, before, task)


async def test_anyio_move_on_after_in_a_task_group() -> None:
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        before = snapshot(dst)
        gate = Gate()
        task = s.pm.transfer_cache_async(src, gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)

        async def prefill() -> None:
            gate.open(0)
            await task.layer(0)
            gate.open(1)  # layer 2 never comes

        start = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(prefill)
            with anyio.move_on_after(0.2) as scope:
                await task
        assert scope.cancelled_caught
        assert time.monotonic() - start < 0.2 + BOUND_S
        await asyncio.wait_for(task.synchronize(), BOUND_S)
        await _after_cancel(s, src, dst, before, task)


async def test_anyio_fail_after_cancels_in_flight_layers() -> None:
    async with setup() as s:
        src = s.blocks_src()
        task = s.pm.transfer_cache_async(src, Ready(), [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0):
                await task
        assert time.monotonic() - start < BOUND_S
        assert task.done()
        assert await s.pm.transfer_cache_async(src, Ready(), [blocks_config()], SRC_BLOCKS, DST_BLOCKS) == [SUCCESS]


async def test_synchronize_times_out_while_the_task_goes_on() -> None:
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        gate = Gate()
        gate.open(0)
        configs = [blocks_config(src_layer_range=range(0, 1)), blocks_config(src_layer_range=range(1, 4))]
        task = s.pm.transfer_cache_async(src, gate, configs, SRC_BLOCKS, DST_BLOCKS)
        await task.layer(0)
        start = time.monotonic()
        # v1's time-out code, as LLM-DataDist's task (v2's CacheManager: LLM_TIMEOUT, test_cache_manager.py)
        assert await task.synchronize(50) == LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT
        results = await task.get_results(50)
        assert time.monotonic() - start < 0.1 + BOUND_S
        assert results == [LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT] * 2  # still running: the code for each config
        assert task.layer(0).done()  # while its only layer is confirmed
        assert not task.done()
        for bad, error in ((-1, ValueError), (2**32, ValueError), (1.5, TypeError)):
            with pytest.raises(error, match="timeout_in_millis"):
                await task.synchronize(bad)
        assert await task.synchronize(0) == LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT
        gate.open(1, 2, 3)
        assert await task.synchronize(5000) == SUCCESS
        assert await task.get_results(0) == [SUCCESS, SUCCESS]
        assert all(layer_landed(dst, src, layer, DST_BLOCKS, SRC_BLOCKS) for layer in range(LAYERS))


async def test_task_awaited_twice_and_by_two_waiters() -> None:
    async with setup() as s:
        src = s.blocks_src()
        gate = Gate()
        task = s.pm.transfer_cache_async(src, gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        waiters = [asyncio.ensure_future(task.synchronize()), asyncio.ensure_future(task.get_results())]
        gate.open(*range(LAYERS))
        assert await task == [SUCCESS]
        assert await task == [SUCCESS]
        assert await asyncio.gather(*waiters) == [SUCCESS, [SUCCESS]]


# -- destinations ---------------------------------------------------------------------


async def test_two_destinations_one_refuses() -> None:
    async with setup(decoders=2) as s:
        src = s.blocks_src()
        good, other = s.dsts[0], s.dsts[1]
        before = snapshot(other)
        wrong_key = TransferWithCacheKeyConfig(BlocksCacheKey(SECOND_DECODER_ID, 5))  # no such model_id there
        task = s.pm.transfer_cache_async(src, Ready(), [blocks_config(), wrong_key], SRC_BLOCKS, DST_BLOCKS)
        with pytest.raises(LLMException) as info:
            await task
        assert info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        # the task's error says how every destination ended, and why the one failed (it was the first
        # layer push's own error, whichever push that was: a cut one said only "failed before it was sent")
        assert "results ['LLMStatusCode.LLM_SUCCESS', 'LLMStatusCode.LLM_KV_CACHE_NOT_EXIST']" in str(info.value)
        assert f"cluster {SECOND_DECODER_ID}: " in str(info.value), str(info.value)
        assert await task.get_results() == [SUCCESS, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST]
        assert all(layer_landed(good, src, layer, DST_BLOCKS, SRC_BLOCKS) for layer in range(LAYERS))
        assert same(snapshot(other), before)
        # a layer is done once it reached every destination
        assert await code_of(task.layer(0)) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


class _StopAtLayer2(LayerSynchronizer):
    """Layer 2 is refused (False) once the layers before it had time to reach their destinations."""

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        if layer_index == 2:
            await asyncio.sleep(0.5)
            return False
        return True


async def test_a_refusal_before_the_synchronizer_stops_the_task_is_what_await_task_raises() -> None:
    """A destination refused layer 0, then the synchronizer stopped the task at layer 2: ``await task`` raised
    the stop (LLM_PARAM_INVALID, no results) while ``synchronize()`` said the refusal. Now both say the first
    failure, and the error lists every config's result."""
    async with setup(decoders=2) as s:
        src = s.blocks_src()
        wrong_key = TransferWithCacheKeyConfig(BlocksCacheKey(SECOND_DECODER_ID, 5))  # no such model_id there
        task = s.pm.transfer_cache_async(src, _StopAtLayer2(), [wrong_key, blocks_config()], SRC_BLOCKS,
                                         DST_BLOCKS)
        with pytest.raises(LLMException) as info:
            await task
        assert await task.get_results() == [LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, PARAM_INVALID]
        assert info.value.status_code == await task.synchronize() == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        assert "results [" in str(info.value) and f"cluster {SECOND_DECODER_ID}: " in str(info.value)
        assert await code_of(task.layer(2)) == PARAM_INVALID  # stopped before it was sent


async def test_layer_pushes_cut_after_their_destination_refused_count_as_its_failures() -> None:
    """The caller cancelled nothing: the layer pushes the library cut when their destination refused one count
    as failures with the destination's status, never as cancellations (docs/observability.md)."""
    async with setup() as s:
        src = s.blocks_src()
        gate = Gate()
        gate.open(*range(LAYERS))  # every layer at once: the later pushes are under way when the first fails
        wrong_key = TransferWithCacheKeyConfig(BlocksCacheKey(DECODER_ID, 5))  # no such model_id there
        task = s.pm.transfer_cache_async(src, gate, [wrong_key], SRC_BLOCKS, DST_BLOCKS)
        assert await code_of(task) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        push = s.prompt.stats().links[DECODER_ID].kinds["push"]
        assert (push.cancellations, push.in_flight, push.transfers) == (0, 0, 0)
        assert dict(push.failures) == {"LLM_KV_CACHE_NOT_EXIST": LAYERS}


async def test_layer_pushes_the_caller_cancelled_count_as_cancellations_not_failures() -> None:
    """The other side of the above: pushes in flight when the caller cancels the task count as cancellations."""
    async with setup() as s:
        src = s.blocks_src()
        task = s.pm.transfer_cache_async(src, Ready(), [blocks_config()], SRC_BLOCKS, DST_BLOCKS)

        def push() -> Any:
            return s.prompt.stats().links[DECODER_ID].kinds["push"]

        for _ in range(10_000):  # bounded: until a push is under way
            if push().in_flight:
                break
            await asyncio.sleep(0)
        assert push().in_flight
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert push().cancellations >= 1 and push().in_flight == 0
        assert dict(push().failures) == {}


async def test_two_destinations_both_receive_every_layer() -> None:
    async with setup(decoders=2) as s:
        src = s.blocks_src()
        gate = Gate()
        configs = [blocks_config(), blocks_config(SECOND_DECODER_ID)]
        task = s.pm.transfer_cache_async(src, gate, configs, SRC_BLOCKS, DST_BLOCKS)
        dsts = s.dsts
        for layer in range(LAYERS):
            gate.open(layer)
            await task.layer(layer)
            assert all(layer_landed(d, src, layer, DST_BLOCKS, SRC_BLOCKS) for d in dsts)
        assert await task == [SUCCESS, SUCCESS]


async def test_destination_unlinked_before_the_next_layer() -> None:
    async with setup(decoders=2) as s:
        src = s.blocks_src()
        gate = Gate()
        gate.open(0)
        configs = [blocks_config(), blocks_config(SECOND_DECODER_ID)]
        task = s.pm.transfer_cache_async(src, gate, configs, SRC_BLOCKS, DST_BLOCKS)
        await task.layer(0)
        status, _ = await s.decoders[1].unlink_clusters([cluster_info(PROMPT_ID, port_of(s.prompt))])
        assert status == SUCCESS
        gate.open(1, 2, 3)
        code = await code_of(task)
        results = await task.get_results()
        assert results[0] == SUCCESS
        assert results[1] == code and code in (LLMStatusCode.LLM_NOT_YET_LINK, LLMStatusCode.LLM_LINK_FAILED)
        assert all(layer_landed(s.dsts[0], src, layer, DST_BLOCKS, SRC_BLOCKS)
                   for layer in range(LAYERS))


async def test_task_ends_when_its_remaining_destination_goes_while_prefill_stalls() -> None:
    async with setup(decoders=2) as s:
        src = s.blocks_src()
        gate = Gate()  # layer 1 never comes
        gate.open(0)
        configs = [blocks_config(src_layer_range=range(0, 1)), blocks_config(SECOND_DECODER_ID)]
        task = s.pm.transfer_cache_async(src, gate, configs, SRC_BLOCKS, DST_BLOCKS)
        await task.layer(0)
        await gate.asked_for(1)
        start = time.monotonic()
        status, _ = await s.decoders[1].unlink_clusters([cluster_info(PROMPT_ID, port_of(s.prompt))])
        assert status == SUCCESS
        code = await asyncio.wait_for(code_of(task), BOUND_S)
        assert time.monotonic() - start < BOUND_S
        assert code in (LLMStatusCode.LLM_NOT_YET_LINK, LLMStatusCode.LLM_LINK_FAILED)
        assert await task.get_results() == [SUCCESS, code]
        assert await code_of(task.layer(1)) == code


async def test_task_ends_when_its_destination_went_before_the_driver_started_while_prefill_stalls() -> None:
    """The link fails between transfer_cache_async and the driver's first step (a callback that ran first in
    that turn of the loop): the task still ends with the link's failure although no layer is ever released."""
    async with setup() as s:
        src = s.blocks_src()
        gate = Gate()  # no layer ever comes
        task = s.pm.transfer_cache_async(src, gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        link = link_to(s.prompt, DECODER_ID)
        assert link is not None
        link.fail(LLMException("connection lost (test)", status_code=LLMStatusCode.LLM_LINK_FAILED))
        code = await asyncio.wait_for(code_of(task), BOUND_S)
        assert code == LLMStatusCode.LLM_LINK_FAILED
        assert await task.get_results() == [code]
        assert await code_of(task.layer(0)) == code


# -- keys, rows and layer ranges -----------------------------------------------------------


async def test_random_layer_ranges_and_stops() -> None:
    """Seeded random tasks to two decoders: what lands, layer futures and results follow the stop layer."""
    rnd = random.Random(20261130)
    async with setup(decoders=2) as s:
        src = s.blocks_src()
        dsts = s.dsts
        for _ in range(25):
            count = rnd.randint(1, 4)
            src_blocks = rnd.sample(range(16), count)
            dst_blocks = rnd.sample(range(16), count)
            configs, spans = [], []
            for cluster_id in (DECODER_ID, SECOND_DECODER_ID):
                n = rnd.randint(1, LAYERS)
                src_start, dst_start = rnd.randint(0, LAYERS - n), rnd.randint(0, LAYERS - n)
                spans.append((range(src_start, src_start + n), range(dst_start, dst_start + n)))
                configs.append(blocks_config(cluster_id, src_layer_range=spans[-1][0], dst_layer_range=spans[-1][1]))
            layers = sorted({layer for src_layers, _ in spans for layer in src_layers})
            stop = rnd.choice([None, *layers])
            for dst in dsts:
                for t in dst.tensors:
                    t.fill_(-1.0)
            before = [snapshot(dst) for dst in dsts]
            gate = Gate({stop: False} if stop is not None else {})
            gate.open(*layers)
            task = s.pm.transfer_cache_async(src, gate, configs, src_blocks, dst_blocks)
            if stop is None:
                assert await task == [SUCCESS, SUCCESS]
            else:
                assert await code_of(task) == PARAM_INVALID
            expected = []
            for (src_layers, dst_layers), dst, old in zip(spans, dsts, before):
                for src_layer, dst_layer in zip(src_layers, dst_layers):
                    if stop is None or src_layer < stop:
                        assert layer_landed(dst, src, src_layer, dst_blocks, src_blocks, dst_layer)
                    else:
                        assert untouched(dst, old, [dst_layer])
                if stop is None or src_layers.stop <= stop:
                    expected.append(SUCCESS)
                elif src_layers.start > stop:
                    expected.append(None)
                else:
                    expected.append(PARAM_INVALID)
            assert await task.get_results() == expected
            for layer in layers:
                if stop is None or layer < stop:
                    await task.layer(layer)
                else:
                    assert await code_of(task.layer(layer)) == PARAM_INVALID


async def test_contiguous_cache_by_id_and_index_with_layer_ranges() -> None:
    async with setup() as s:
        src = s.pm.allocate_cache(ROWS)
        fill(src, 3)
        dst = s.dm.allocate_cache(ROWS)
        before = snapshot(dst)
        watch = s.dm.watch_pushes(dst, [2], range(2, 4))
        key = CacheKeyByIdAndIndex(DECODER_ID, dst.cache_id, 2)
        config = TransferWithCacheKeyConfig(key, src_layer_range=range(0, 2), dst_layer_range=range(2, 4),
                                            src_batch_index=1)
        task = s.pm.transfer_cache_async(src, AsyncReady(), [config])
        assert await task == [SUCCESS]
        await watch.wait(1000)
        for src_layer, dst_layer in ((0, 2), (1, 3)):
            assert layer_landed(dst, src, src_layer, [2], [1], dst_layer)
        for t in range(ROWS.num_tensors):  # rows 0 and 1 everywhere, and row 2 of layers 0-1, untouched
            rows = [0, 1] if t >= 4 else [0, 1, 2]
            assert torch.equal(dst.tensors[t][rows], before[t][rows])
        with pytest.raises(LLMException):
            task.layer(2)  # layer indices of a task are source layers


async def test_blocks_with_layer_ranges() -> None:
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        before = snapshot(dst)
        config = blocks_config(src_layer_range=range(1, 3), dst_layer_range=range(0, 2))
        task = s.pm.transfer_cache_async(src, Ready(), [config], SRC_BLOCKS, DST_BLOCKS)
        await task.layer(1)
        await task.layer(2)
        assert await task == [SUCCESS]
        assert layer_landed(dst, src, 1, DST_BLOCKS, SRC_BLOCKS, 0)
        assert layer_landed(dst, src, 2, DST_BLOCKS, SRC_BLOCKS, 1)
        assert untouched(dst, before, [2, 3])


async def test_raw_addresses_into_blocks() -> None:
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        addrs = dst.per_device_tensor_addrs[0]
        config = TransferConfig(DECODER_ID, addrs[2:6], src_layer_range=range(1, 3))
        task = s.pm.transfer_cache_async(src, Ready(), [config], SRC_BLOCKS, DST_BLOCKS)
        assert await task == [SUCCESS]
        assert layer_landed(dst, src, 1, DST_BLOCKS, SRC_BLOCKS) and layer_landed(dst, src, 2, DST_BLOCKS, SRC_BLOCKS)


async def test_raw_addresses_into_a_contiguous_row() -> None:
    async with setup() as s:
        src = s.pm.allocate_cache(ROWS)
        fill(src, 4)
        dst = s.dm.allocate_cache(ROWS)
        row_bytes = 512
        addrs = [a + 1 * row_bytes for a in dst.per_device_tensor_addrs[0]]  # pre-offset to row 1
        watch = s.dm.watch_pushes(dst, [1])
        task = s.pm.transfer_cache_async(src, Ready(), [TransferConfig(DECODER_ID, addrs, src_batch_index=2)])
        assert await task == [SUCCESS]
        await watch
        assert all(layer_landed(dst, src, layer, [1], [2]) for layer in range(LAYERS))


async def test_raw_addresses_into_larger_blocks_with_dst_block_memory_size() -> None:
    async with setup() as s:
        src = s.blocks_src()
        wide = CacheDesc(2 * LAYERS, (16, 8, 16), DataType.DT_FLOAT16, Placement.HOST)  # 256-byte blocks
        dst = s.dm.allocate_blocks_cache(wide)  # after linking: no block-shape check applies
        for t in dst.tensors:
            t.fill_(-3.0)
        before = snapshot(dst)
        task = s.pm.transfer_cache_async(src, Ready(), [TransferConfig(DECODER_ID, dst.per_device_tensor_addrs[0])],
                                         SRC_BLOCKS, DST_BLOCKS, dst_block_memory_size=256)
        assert await task == [SUCCESS]
        for t in range(BLOCKS.num_tensors):
            got = dst.tensors[t].view(16, 2, 64)
            assert torch.equal(got[DST_BLOCKS, 0], src.tensors[t][SRC_BLOCKS].view(-1, 64))
            assert torch.equal(got[:, 1], before[t].view(16, 2, 64)[:, 1])  # second halves untouched
            others = [b for b in range(16) if b not in DST_BLOCKS]
            assert torch.equal(got[others], before[t].view(16, 2, 64)[others])


async def test_concurrent_tasks_on_one_link() -> None:
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        gates = [Gate() for _ in range(3)]
        blocks = [[0, 1], [2, 3], [4, 5]]
        tasks = [s.pm.transfer_cache_async(src, gate, [blocks_config()], SRC_BLOCKS[:2], dst_blocks)
                 for gate, dst_blocks in zip(gates, blocks)]
        for layer in range(LAYERS):
            for gate in reversed(gates):
                gate.open(layer)
        assert await asyncio.gather(*tasks) == [[SUCCESS]] * 3
        for dst_blocks in blocks:
            assert all(layer_landed(dst, src, layer, dst_blocks, SRC_BLOCKS[:2]) for layer in range(LAYERS))


def _canaried(dd: LLMDataDist) -> tuple[KvCache, list[torch.Tensor]]:
    cache = dd.kv_cache_manager.allocate_blocks_cache(BLOCKS)
    for t in cache.tensors:
        t.fill_(-7.0)
    return cache, snapshot(cache)


@pytest.mark.parametrize("where", ["past_the_end", "before_the_start", "straddling", "wraps"])
async def test_raw_addresses_out_of_bounds_are_refused_with_nothing_written(where: str) -> None:
    async with setup() as s:
        src = s.blocks_src()
        dst, before = _canaried(s.decoders[0])
        keyed, keyed_before = s.dsts[0], snapshot(s.dsts[0])
        addrs = list(dst.per_device_tensor_addrs[0])
        tensor_bytes = 16 * 128
        bad = {
            "past_the_end": addrs[1] + tensor_bytes - 64,  # block 15 would run past tensor 1
            "before_the_start": addrs[0] - 16 * 128,
            "straddling": addrs[0] + tensor_bytes - 128 * 15,  # blocks reach into the next tensor
            "wraps": 2**64 - 64,
        }[where]
        config = TransferConfig(DECODER_ID, [addrs[0], bad], src_layer_range=range(0, 1))
        task = s.pm.transfer_cache_async(src, Ready(), [config], SRC_BLOCKS, DST_BLOCKS)
        assert await code_of(task) == PARAM_INVALID
        assert await task.get_results() == [PARAM_INVALID]
        assert same(snapshot(dst), before)
        assert same(snapshot(keyed), keyed_before)
        # the link still works
        ok = s.pm.transfer_cache_async(src, Ready(), [TransferConfig(DECODER_ID, addrs)], SRC_BLOCKS, DST_BLOCKS)
        assert await ok == [SUCCESS]


async def test_what_the_owner_refuses_is_named_as_the_call_names_it() -> None:
    """The owner checks a layer's push in its own words (dst_blocks, dst_layer_range, dst_addrs); the task's
    error names the argument the caller gave: dst_block_indices, or the config's field."""
    async with setup() as s:
        src = s.blocks_src()
        dst, before = _canaried(s.decoders[0])  # the raw addresses' cache
        addrs = list(dst.per_device_tensor_addrs[0])
        cases = [
            ("dst_block_indices", [blocks_config()], [1, 2, 3, 9], [7, 8, 0, 16]),  # the decoder has 16 blocks
            ("transfer_configs[0].dst_layer_range",
             [blocks_config(src_layer_range=range(0, 2), dst_layer_range=range(LAYERS - 1, LAYERS + 1))],
             SRC_BLOCKS, DST_BLOCKS),
            ("transfer_configs[0].dst_addrs",
             [TransferConfig(DECODER_ID, [addrs[0], 2**64 - 64], src_layer_range=range(0, 1))], SRC_BLOCKS,
             DST_BLOCKS),
        ]
        for arg, configs, src_blocks, dst_blocks in cases:
            task = s.pm.transfer_cache_async(src, Ready(), configs, src_blocks, dst_blocks)
            with pytest.raises(LLMException) as info:
                await task
            assert info.value.status_code == PARAM_INVALID, (arg, info.value)
            assert f"cluster {DECODER_ID}: invalid argument '{arg}'" in str(info.value), (arg, str(info.value))
            assert info.value.argument == arg
        assert same(snapshot(dst), before)


async def test_raw_addresses_bad_in_a_later_layer_only() -> None:
    async with setup() as s:
        src = s.blocks_src()
        dst, before = _canaried(s.decoders[0])
        addrs = list(dst.per_device_tensor_addrs[0])
        addrs[5] = 2**40  # layer 2's V lies nowhere
        task = s.pm.transfer_cache_async(src, Ready(), [TransferConfig(DECODER_ID, addrs)], SRC_BLOCKS, DST_BLOCKS)
        assert await code_of(task) == PARAM_INVALID
        await task.layer(0)
        assert layer_landed(dst, src, 0, DST_BLOCKS, SRC_BLOCKS)
        assert await code_of(task.layer(2)) == PARAM_INVALID
        assert untouched(dst, before, [2])


# -- push watches ----------------------------------------------------------------------


async def test_push_watch_layer_by_layer() -> None:
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        watch = s.dm.watch_pushes(dst, DST_BLOCKS)
        gate = Gate()
        task = s.pm.transfer_cache_async(src, gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        for layer in range(LAYERS):
            assert not watch.layer(layer).done()
            gate.open(layer)
            await watch.layer(layer)
            assert layer_landed(dst, src, layer, DST_BLOCKS, SRC_BLOCKS)
            assert not watch.done() or layer == LAYERS - 1
        await watch
        assert watch.done()
        assert await task == [SUCCESS]


async def test_push_watch_times_out_and_ignores_earlier_pushes() -> None:
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        assert await s.pm.transfer_cache_async(src, Ready(), [blocks_config()], SRC_BLOCKS, DST_BLOCKS) == [SUCCESS]
        with s.dm.watch_pushes(dst, DST_BLOCKS) as watch:  # made after the push: nothing has landed for it
            start = time.monotonic()
            assert await code_of(watch.wait(timeout=100)) == LLMStatusCode.LLM_TIMEOUT
            assert time.monotonic() - start < 0.1 + BOUND_S
            assert not watch.layer(0).done()
            # a push to other blocks does not complete it
            task = s.pm.transfer_cache_async(src, Ready(), [blocks_config()], SRC_BLOCKS, [4, 5, 6, 10])
            assert await task == [SUCCESS]
            assert not watch.layer(0).done()
            # part of the rows does not either
            task = s.pm.transfer_cache_async(src, Ready(), [blocks_config()], SRC_BLOCKS[:2], DST_BLOCKS[:2])
            assert await task == [SUCCESS]
            assert not watch.layer(0).done()
            task = s.pm.transfer_cache_async(src, Ready(), [blocks_config()], SRC_BLOCKS[2:], DST_BLOCKS[2:])
            assert await task == [SUCCESS]
            await watch.wait(timeout=1000)


async def test_push_watch_closed_fails_its_waiters() -> None:
    async with setup() as s:
        dst = s.dsts[0]
        watch = s.dm.watch_pushes(dst, [0], range(1, 2))
        waiter = asyncio.ensure_future(watch.layer(1))
        await asyncio.sleep(0)
        watch.close()
        watch.close()
        assert await code_of(waiter) == LLMStatusCode.LLM_FAILED
        assert await code_of(watch) == LLMStatusCode.LLM_FAILED
        with pytest.raises(LLMException):
            watch.layer(0)  # not watched


async def test_push_watch_bad_arguments() -> None:
    async with setup() as s:
        dst = s.dsts[0]
        for rows, layers in (([], None), ([16], None), ([0], range(0, 5)), ([0], range(2, 2)), ([0], (0, 1))):
            with pytest.raises(LLMException) as info:
                s.dm.watch_pushes(dst, rows, layers)
            assert info.value.status_code == PARAM_INVALID


# -- bad input: refused at call time, nothing sent ---------------------------------------------


async def test_bad_inputs_raise_at_call_time_with_nothing_sent() -> None:
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        rows = s.pm.allocate_cache(ROWS)
        before = snapshot(dst)
        watch = s.dm.watch_pushes(dst, list(range(16)))
        addrs = dst.per_device_tensor_addrs[0]
        good = blocks_config()
        cases: list[tuple[str, Any, tuple, dict]] = [
            ("transfer_configs", src, (Ready(), good, SRC_BLOCKS, DST_BLOCKS), {}),
            ("transfer_configs", src, (Ready(), iter([good]), SRC_BLOCKS, DST_BLOCKS), {}),
            ("transfer_configs[1]", src, (Ready(), [good, "config"], SRC_BLOCKS, DST_BLOCKS), {}),
            ("layer_synchronizer", src, (lambda i, t: True, [good], SRC_BLOCKS, DST_BLOCKS), {}),
            ("layer_synchronizer", src, (None, [good], SRC_BLOCKS, DST_BLOCKS), {}),
            ("layer_synchronizer", src, (Ready, [good], SRC_BLOCKS, DST_BLOCKS), {}),  # the class, not an instance
            ("dst_block_indices", src, (Ready(), [good], [1, 2], [3]), {}),
            ("src_block_indices", src, (Ready(), [good], [], [3]), {}),  # (none on both sides: block 0, below)
            ("src_block_indices", src, (Ready(), [good], [16], [0]), {}),
            ("src_block_indices", src, (Ready(), [good], numpy.array(0), [0]), {}),  # no length: a raw TypeError
            ("dst_block_indices", src, (Ready(), [good], [1, 2], [3, 3]), {}),
            ("dst_block_indices", src, (Ready(), [good], [1], [-1]), {}),
            ("src_block_indices", rows, (Ready(), [TransferConfig(DECODER_ID, addrs)], [0], [0]), {}),
            ("transfer_configs[0].dst_addrs", src, (Ready(), [TransferConfig(DECODER_ID, addrs[:6])],
                                                    SRC_BLOCKS, DST_BLOCKS), {}),
            ("transfer_configs[0].src_layer_range", src, (Ready(), [blocks_config(src_layer_range=range(3, 5))],
                                                          SRC_BLOCKS, DST_BLOCKS), {}),
            ("transfer_configs[0].cache_key", rows, (Ready(), [good]), {}),
            ("transfer_configs[0].cache_key", src,
             (Ready(), [TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(DECODER_ID, 1, 0))], SRC_BLOCKS, DST_BLOCKS),
             {}),
            ("transfer_configs[0].src_batch_index", rows,
             (Ready(), [TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(DECODER_ID, 1, 0), src_batch_index=3)]),
             {}),
            ("dst_block_memory_size", src, (Ready(), [good], SRC_BLOCKS, DST_BLOCKS), {"dst_block_memory_size": 64}),
            ("dst_block_memory_size", rows, (Ready(), [TransferConfig(DECODER_ID, addrs)]),
             {"dst_block_memory_size": 4096}),
        ]
        # an array has no truth value (a raw ValueError or RuntimeError came out); False and 0.0 were "unset"
        for size in (numpy.array([128, 128]), torch.tensor([128, 128]), numpy.array([]), False, 0.0):
            cases += [("dst_block_memory_size", src, (Ready(), [good]), {"dst_block_memory_size": size}),
                      ("dst_block_memory_size", rows, (Ready(), [TransferConfig(DECODER_ID, addrs)]),
                       {"dst_block_memory_size": size})]
        tasks_before = asyncio.all_tasks()
        for arg, cache, args, kwargs in cases:
            with pytest.raises(LLMException) as info:
                s.pm.transfer_cache_async(cache, *args, **kwargs)
            assert info.value.status_code == PARAM_INVALID, (arg, info.value)
            assert f"'{arg}" in str(info.value), (arg, str(info.value))
        # not linked: the documented code, at call time too
        with pytest.raises(LLMException) as info:
            s.pm.transfer_cache_async(src, Ready(), [blocks_config(9)], SRC_BLOCKS, DST_BLOCKS)
        assert info.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
        # the wrong role
        with pytest.raises(LLMException) as info:
            s.dm.transfer_cache_async(dst, Ready(), [TransferWithCacheKeyConfig(BlocksCacheKey(PROMPT_ID, 0))],
                                      DST_BLOCKS, SRC_BLOCKS)
        assert info.value.status_code == PARAM_INVALID
        assert "'role'" in str(info.value)
        await asyncio.sleep(0.05)
        started = [t for t in asyncio.all_tasks() - tasks_before
                   if getattr(getattr(t.get_coro(), "cr_code", None), "co_filename", "").endswith("layerwise.py")]
        assert not started, "a refused call started a transfer"
        assert same(snapshot(dst), before)
        assert not any(watch.layer(layer).done() for layer in range(LAYERS))
        watch.close()
        # no configs: a task that moves nothing, as LLM-DataDist's (it is not a bad input there)
        nothing = s.pm.transfer_cache_async(src, Ready(), [], SRC_BLOCKS, DST_BLOCKS)
        assert await nothing == [] and await nothing.synchronize(0) == SUCCESS and await nothing.get_results() == []
        with pytest.raises(LLMException, match="moves no layer"):
            nothing.layer(0)
        assert same(snapshot(dst), before)


async def test_transfer_after_finalize_of_the_prompt_is_refused() -> None:
    async with setup() as s:
        src = s.blocks_src()
        await s.prompt.finalize()
        with pytest.raises(LLMException):
            s.pm.transfer_cache_async(src, Ready(), [blocks_config()], SRC_BLOCKS, DST_BLOCKS)


async def test_finalize_of_the_prompt_during_a_transfer() -> None:
    async with setup() as s:
        src = s.blocks_src()
        gate = Gate()
        gate.open(0)
        task = s.pm.transfer_cache_async(src, gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        await task.layer(0)
        await asyncio.wait_for(s.prompt.finalize(), BOUND_S + 1)
        gate.open(1, 2, 3)
        with pytest.raises((LLMException, asyncio.CancelledError)):
            await asyncio.wait_for(task, BOUND_S)
        assert task.done()



# -- LLM-DataDist's calling conventions ----------------------------------------------


class Recording(LayerSynchronizer):
    """Records the timeout each layer is asked with (plain and async flavours)."""

    def __init__(self) -> None:
        self.timeouts: list[Any] = []

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.timeouts.append(timeout_in_millis)
        return True


class AsyncRecording(Recording):
    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:  # type: ignore[override]
        self.timeouts.append(timeout_in_millis)
        return True


async def test_synchronize_layer_gets_no_timeout() -> None:
    """Reference §2.10: the timeout argument "is not supported yet; None is passed", whatever
    sync_kv_timeout is (the HIXL transfer_cache_async sample's synchronizer takes it as Optional)."""
    async with setup(sync_kv_timeout=4321) as s:
        for sync in (Recording(), AsyncRecording()):
            task = s.pm.transfer_cache_async(s.blocks_src(), sync, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
            assert await task == [SUCCESS]
            assert sync.timeouts == [None] * LAYERS


@pytest.mark.parametrize("indices", [(), (None, None), ([], []), (range(0), [])])
async def test_blocks_cache_without_block_indices_moves_block_zero(indices: tuple) -> None:
    """clients_gap item 11 (HIXL transfer_cache_async_sample: a blocks cache, no block indices):
    LLM-DataDist's layer-wise job copies one row when no block lists are given (a blocks cache's
    rows are its blocks: LayerWiseTransferJob::GenerateCacheToCacheTask, batch 0, ``stride`` bytes),
    so block 0 of every tensor of the layers goes to block 0 of the destination; nothing else moves."""
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        before = snapshot(dst)
        config = blocks_config(src_layer_range=range(1, 3), dst_layer_range=range(0, 2))
        task = s.pm.transfer_cache_async(src, Ready(), [config], *indices)
        assert await task == [SUCCESS]
        for src_layer, dst_layer in ((1, 0), (2, 1)):
            assert layer_landed(dst, src, src_layer, [0], [0], dst_layer=dst_layer)
            for k in range(2):
                t = 2 * dst_layer + k
                assert torch.equal(dst.tensors[t][1:], before[t][1:]), "a block other than block 0 moved"
        assert untouched(dst, before, [2, 3])
        # and raw addresses (TransferConfig) take block 0 to the address itself
        rows = s.dm.allocate_blocks_cache(BLOCKS)
        rows_before = snapshot(rows)
        addrs = rows.per_device_tensor_addrs[0][2:4]
        task = s.pm.transfer_cache_async(src, Ready(), [TransferConfig(DECODER_ID, addrs, range(3, 4))], *indices)
        assert await task == [SUCCESS]
        assert all(torch.equal(rows.tensors[2 + k][0], src.tensors[6 + k][0]) for k in range(2))
        assert all(torch.equal(rows.tensors[2 + k][1:], rows_before[2 + k][1:]) for k in range(2))
        assert untouched(rows, rows_before, [0, 2, 3])


# -- review findings of 2026-12-04 ------------------------------------------------


async def test_layers_waiting_for_a_data_channel_are_timed_from_when_they_have_one():
    """Every released layer's push starts at once and queues for the link's data channels; its time-out
    counts from when it has one (the wait bounded by the transfer's share, layers x time-out). Before, the
    queue ate the time-out: a transfer longer than ``sync_kv_timeout`` failed on a healthy link."""
    async with setup(sync_kv_timeout=150) as s:
        src, dst = s.blocks_src(), s.dsts[0]
        link = link_to(s.prompt, DECODER_ID)
        held = []
        while not link.free.empty():  # every channel that is up busy for 0.4 s
            index = await link.acquire()
            held.append((index, link.channels[index].generation))
        assert held
        try:
            task = s.pm.transfer_cache_async(src, Ready(), [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
            await asyncio.sleep(0.4)  # longer than the time-out, shorter than 4 layers x 150 ms
        finally:
            for channel, generation in held:
                link.release(channel, generation)
        assert await task == [SUCCESS]
        assert all(layer_landed(dst, src, layer, DST_BLOCKS, SRC_BLOCKS) for layer in range(LAYERS))
        # The wait for a channel is bounded all the same: channels busy past layers x time-out fail the transfer.
        held = [(index, link.channels[index].generation) for index in [await link.acquire() for _ in held]]
        try:
            task = s.pm.transfer_cache_async(src, Ready(), [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
            async with asyncio.timeout(LAYERS * 0.15 + BOUND_S):
                assert await code_of(task) == LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT
        finally:
            for channel, generation in held:
                link.release(channel, generation)


async def test_a_source_released_during_the_transfer_sends_no_more_layers():
    """After ``deallocate_cache(src)`` the source's memory is not the transfer's any more (a registered
    cache's is the caller's again): the layers still to go fail ``LLM_KV_CACHE_NOT_EXIST``. Before, they
    were read from the released memory and sent, and the task succeeded."""
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        before = snapshot(dst)
        gate = Gate()
        task = s.pm.transfer_cache_async(src, gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        gate.open(0)
        await task.layer(0)
        s.pm.deallocate_cache(src)
        gate.open(*range(1, LAYERS))
        assert await code_of(task) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        assert await task.get_results() == [LLMStatusCode.LLM_KV_CACHE_NOT_EXIST]
        assert untouched(dst, before, range(1, LAYERS))


class Stubborn(LayerSynchronizer):
    """Swallows the cancellation it is interrupted by and says the layer is ready (a buggy caller's)."""

    def __init__(self) -> None:
        self.swallowed: list[int] = []
        self.waiting = asyncio.Event()

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        if layer_index == 0:
            return True
        self.waiting.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError as exc:
            self.interrupted(layer_index, exc)
        return True

    def interrupted(self, layer_index: int, exc: asyncio.CancelledError) -> None:
        if self.swallowed:
            raise exc  # only the first one (so that a test that fails still ends)
        self.swallowed.append(layer_index)


async def test_a_synchronizer_that_swallows_the_cancellation_does_not_keep_the_task_going():
    """``task.cancel()`` ends the task though the synchronizer it interrupts swallows the cancellation;
    no later layer is sent, and the destination that had layers land reads as failed, not "never started".
    Before, the cancellation was lost and the transfer went on pushing layers."""
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        before = snapshot(dst)
        sync = Stubborn()
        task = s.pm.transfer_cache_async(src, sync, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        await task.layer(0)
        async with asyncio.timeout(5):
            await sync.waiting.wait()
        task.cancel()

        async def outcome() -> Any:
            try:
                return await task
            except asyncio.CancelledError:
                return "cancelled"

        ended = asyncio.ensure_future(outcome())
        await asyncio.wait([ended], timeout=BOUND_S)  # (a wait that cancels nothing: a lost cancel cannot hang it)
        assert ended.done(), "the cancellation was lost: the task goes on"
        assert ended.result() == "cancelled"
        assert sync.swallowed == [1]
        await asyncio.sleep(0.1)
        assert untouched(dst, before, range(1, LAYERS))
        assert await task.get_results() == [LLMStatusCode.LLM_FAILED]


class Renaming(Stubborn):
    """Turns the cancellation it is interrupted by into an error of its own (a cleanup step that raises): chained
    to it, or, ``chained=False``, raised once out of the ``except`` (no ``__cause__``, no ``__context__``)."""

    def __init__(self, chained: bool = True) -> None:
        super().__init__()
        self.chained = chained

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        ready = await super().synchronize_layer(layer_index, timeout_in_millis)
        if self.swallowed:
            raise RuntimeError("prefill aborted")
        return ready

    def interrupted(self, layer_index: int, exc: asyncio.CancelledError) -> None:
        if self.chained:
            raise RuntimeError("prefill aborted") from exc
        super().interrupted(layer_index, exc)


@pytest.mark.loops_take_turns  # (the transport and the loop are independent here)
async def test_a_cancel_that_the_synchronizer_turns_into_an_error_is_still_a_cancel():
    """``task.cancel()`` makes ``await task`` raise ``CancelledError``, and an ``asyncio.timeout`` around it
    ``TimeoutError``, though the synchronizer it interrupts raises something else. Before, the driver took
    that for the synchronizer's failure: ``await task`` raised ``LLMException(LLM_FAILED)`` and a timeout
    scope around it never saw its cancel."""
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        before = snapshot(dst)
        sync = Renaming()
        task = s.pm.transfer_cache_async(src, sync, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        async with asyncio.timeout(5):
            await sync.waiting.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(BOUND_S):
                await task
        assert await task.get_results() == [LLMStatusCode.LLM_FAILED]
        assert untouched(dst, before, range(1, LAYERS))
        task = s.pm.transfer_cache_async(src, Renaming(chained=False), [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        with pytest.raises(TimeoutError):  # (the driver asks the task, not the error, whether it was cancelled)
            async with asyncio.timeout(0.2):
                await task
        assert task.done()


async def test_a_watch_of_a_cache_released_mid_transfer_fails_what_cannot_land() -> None:
    """Layer 0 lands, then the decoder deallocates the watched cache: the layers still pending fail with
    LLM_KV_CACHE_NOT_EXIST at once (before, they waited forever), the landed layer stays done, and the prompt's
    next layer finds no cache."""
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        watch = s.dm.watch_pushes(dst, DST_BLOCKS)
        gate = Gate()
        task = s.pm.transfer_cache_async(src, gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        gate.open(0)
        async with asyncio.timeout(5):
            await watch.layer(0)
        s.dm.deallocate_cache(dst)
        async with asyncio.timeout(BOUND_S):
            assert await code_of(watch.layer(1)) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
            assert await code_of(watch) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        assert watch.done()
        await watch.layer(0)  # what landed stays landed
        gate.open(1, 2, 3)
        async with asyncio.timeout(5):
            assert await task.get_results() == [LLMStatusCode.LLM_KV_CACHE_NOT_EXIST]


class _LayersUnknown(Ready):
    """A caller's synchronizer whose ``num_layers`` (no part of LayerSynchronizer) cannot answer yet."""

    def __init__(self, error: type[Exception]) -> None:
        super().__init__()
        self.error = error

    @property
    def num_layers(self) -> int:
        raise self.error("the model is not loaded yet")


@pytest.mark.parametrize("error", [AttributeError, RuntimeError])
async def test_a_synchronizer_whose_num_layers_cannot_be_read_bounds_nothing(error) -> None:
    """LLM-DataDist never reads ``num_layers``; one that raises sets no bound, whatever it raises. Before, any
    error but AttributeError escaped ``transfer_cache_async`` as it was (found by a hunt)."""
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        task = s.pm.transfer_cache_async(src, _LayersUnknown(error), [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        assert await asyncio.wait_for(task, 5) == [SUCCESS]
        assert all(layer_landed(dst, src, layer, DST_BLOCKS, SRC_BLOCKS) for layer in range(LAYERS))


async def test_an_event_synchronizer_with_fewer_layers_than_the_transfer_is_refused_at_the_call() -> None:
    """An EventLayerSynchronizer made for fewer layers than the transfer moves is a bad argument known at the
    call: refused there (``LLM_PARAM_INVALID`` naming ``layer_synchronizer``) with nothing sent, not found only
    at its first missing layer after the layers before it were pushed."""
    async with setup() as s:
        src, dst = s.blocks_src(), s.dsts[0]
        before = snapshot(dst)
        with EventLayerSynchronizer(s.prompt, 2) as sync:
            sync.record(0)
            sync.record(1)
            for config in (blocks_config(), blocks_config(src_layer_range=range(2, 4))):
                with pytest.raises(LLMException) as info:
                    task = s.pm.transfer_cache_async(src, sync, [config], SRC_BLOCKS, DST_BLOCKS)
                    with contextlib.suppress(LLMException):
                        await asyncio.wait_for(task, 3)
                assert info.value.status_code == PARAM_INVALID
                assert "layer_synchronizer" in str(info.value)
            await asyncio.sleep(0.1)
            assert untouched(dst, before, range(LAYERS)), "layers were sent before the synchronizer was found short"
            # the layers it has are fine
            task = s.pm.transfer_cache_async(src, sync, [blocks_config(src_layer_range=range(0, 2))],
                                             SRC_BLOCKS, DST_BLOCKS)
            assert await task == [SUCCESS]
