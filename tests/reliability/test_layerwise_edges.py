"""Layer-wise transfers at their edges: a destination that has every layer and then goes, layers queued behind
each other on a same-host link, and plain synchronizers of many tasks waiting at once.

Each failed before: the first destination was reported failed although its layer futures said it got
everything; same-host layers released together timed out behind the owner's copies of the earlier ones
(the TCP path's queue allowance, row 159, did not reach them); and blocking synchronizers shared the loop's
default executor, so a task whose layers were ready waited for other tasks' prefills; and a destination's
refusal of a layer cut its push of an earlier layer still waiting for its ``DONE``, failing a layer in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading

import pytest
from _slowpath import SlowPath
from peers import DECODER_ID, PROMPT_ID, TRANSPORT, cluster_info, endpoint, fill, options, port_of
from test_layerwise import (
    BLOCKS,
    DST_BLOCKS,
    LAYERS,
    SECOND_DECODER_ID,
    SRC_BLOCKS,
    Gate,
    Ready,
    _canaried,
    blocks_config,
    layer_landed,
    setup,
)

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LayerSynchronizer,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from aio_datadist.links import Link
from aio_datadist.testing import usable_link

pytestmark = pytest.mark.asyncio
OK = LLMStatusCode.LLM_SUCCESS


@pytest.mark.loops_take_turns  # the layer-wise driver's bookkeeping: one loop is enough (2.7 s each)
async def test_a_destination_that_got_every_layer_and_then_unlinked_is_no_failure():
    """Two destinations of one layer; A (direct) has it confirmed long before B (through a 0.3 s path), and
    unlinks meanwhile, as a decoder that has its request's KV may."""
    a, b = 2, 3
    async with contextlib.AsyncExitStack() as stack:
        prompt = await stack.enter_async_context(endpoint(LLMRole.PROMPT, PROMPT_ID, listen=True,
                                                          sync_kv_timeout=10_000))
        path = await stack.enter_async_context(SlowPath(port_of(prompt), 1e9, 0.3))
        da = await stack.enter_async_context(endpoint(LLMRole.DECODER, a))
        db = await stack.enter_async_context(endpoint(LLMRole.DECODER, b))
        dst_a = da.kv_cache_manager.allocate_blocks_cache(BLOCKS, BlocksCacheKey(a, 0))
        db.kv_cache_manager.allocate_blocks_cache(BLOCKS, BlocksCacheKey(b, 0))
        assert (await da.link_clusters([cluster_info(PROMPT_ID, port_of(prompt))]))[0] == OK
        assert (await db.link_clusters([cluster_info(PROMPT_ID, path.address)], timeout=10_000))[0] == OK
        src = prompt.kv_cache_manager.allocate_blocks_cache(BLOCKS)
        fill(src, 5)
        configs = [TransferWithCacheKeyConfig(BlocksCacheKey(d, 0), src_layer_range=range(0, 1),
                                              dst_layer_range=range(0, 1)) for d in (a, b)]
        task = prompt.kv_cache_manager.transfer_cache_async(src, Ready(), configs, SRC_BLOCKS, DST_BLOCKS)
        async with asyncio.timeout(5):
            while not layer_landed(dst_a, src, 0, DST_BLOCKS, SRC_BLOCKS):
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # A's push confirmed
        assert not task.done()
        assert (await da.unlink_clusters([cluster_info(PROMPT_ID, port_of(prompt))]))[0] == OK
        async with asyncio.timeout(10):
            await task.layer(0)
            assert await task.get_results() == [OK, OK]


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_destination_whose_link_goes_as_its_last_confirmation_comes_in_is_no_failure(monkeypatch):
    """The last layer's ``DONE`` and the link's end in one pass (one read: ``DONE``, then EOF): the link's end
    fails only destinations no push is in flight to."""
    async with setup() as s:
        target = usable_link(s.prompt, DECODER_ID)
        dones: list[int] = []
        expect = Link.expect

        def watched(self: Link, req_id: int, answer: object = None, *,
                    then: asyncio.Future | None = None, **kw: object) -> asyncio.Future:
            fut = expect(self, req_id, answer, then=then, **kw)
            if self is target:
                def arrived(f: asyncio.Future) -> None:
                    if f.cancelled() or f.exception() is not None or type(f.result()).__name__ != "Done":
                        return
                    dones.append(req_id)
                    if len(dones) == LAYERS:
                        self.fail(LLMException("connection reset by peer", status_code=LLMStatusCode.LLM_LINK_FAILED))

                for reply in (fut, then):  # a push's DONE is the reply after its answer (``then``)
                    if reply is not None:
                        reply.add_done_callback(arrived)
            return fut

        monkeypatch.setattr(Link, "expect", watched)
        task = s.pm.transfer_cache_async(s.blocks_src(), Ready(), [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        async with asyncio.timeout(10):
            for i in range(LAYERS):
                await task.layer(i)
            assert await task.get_results() == [OK]
        assert len(dones) == LAYERS


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_link_that_ends_as_a_layer_is_confirmed_ends_the_task_waiting_for_the_next(monkeypatch):
    """The link ends in the pass layer 0's ``DONE`` came in, and the prefill stalls before layer 1: the
    destination, decided once its push in flight ended, fails, and the task ends (the first form of the
    fix above forgot the link's end and left the task waiting for the synchronizer)."""
    async with setup() as s:
        target = usable_link(s.prompt, DECODER_ID)
        expect = Link.expect

        def watched(self: Link, req_id: int, answer: object = None, *,
                    then: asyncio.Future | None = None, **kw: object) -> asyncio.Future:
            fut = expect(self, req_id, answer, then=then, **kw)
            if self is target:
                def arrived(f: asyncio.Future) -> None:
                    if not f.cancelled() and f.exception() is None and type(f.result()).__name__ == "Done":
                        self.fail(LLMException("connection reset by peer", status_code=LLMStatusCode.LLM_LINK_FAILED))

                for reply in (fut, then):  # a push's DONE is the reply after its answer (``then``)
                    if reply is not None:
                        reply.add_done_callback(arrived)
            return fut

        monkeypatch.setattr(Link, "expect", watched)
        gate = Gate()
        gate.open(0)  # layer 1 never comes
        task = s.pm.transfer_cache_async(s.blocks_src(), gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        await task.layer(0)
        await gate.asked_for(1)
        with pytest.raises(LLMException) as info:
            async with asyncio.timeout(3):
                await task
        assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED


class _StopIteration(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        raise StopIteration


async def test_a_plain_synchronizer_that_raises_stop_iteration_ends_its_task():
    """No future takes a StopIteration: it is the task's failure as any other exception (it hung the task)."""
    async with setup() as s:
        task = s.pm.transfer_cache_async(s.blocks_src(), _StopIteration(), [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        with pytest.raises(LLMException):
            async with asyncio.timeout(3):
                await task


class _Prefill(LayerSynchronizer):
    """A plain synchronizer that blocks until its request's prefill is done."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return self.done.wait(10)


async def test_a_ready_task_is_not_held_up_by_blocking_synchronizers_of_other_tasks():
    waiting = min(32, (os.cpu_count() or 1) + 4)  # what the loop's default executor has
    before = set(threading.enumerate())
    async with setup() as s:
        src = s.blocks_src()
        slow = [_Prefill() for _ in range(waiting)]
        tasks = [s.pm.transfer_cache_async(src, p, [blocks_config()], SRC_BLOCKS, DST_BLOCKS) for p in slow]
        await asyncio.sleep(0.2)  # each of them waits in its synchronizer
        ready = _Prefill()
        ready.done.set()
        quick = s.pm.transfer_cache_async(src, ready, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
        try:
            async with asyncio.timeout(5):
                assert await quick.synchronize() == OK
        finally:
            for p in slow:
                p.done.set()
            async with asyncio.timeout(10):
                await asyncio.gather(*(t.synchronize() for t in tasks))
    for _ in range(100):  # each task's synchronizer thread ends with its task (one left per task before)
        if not [t for t in threading.enumerate() if t not in before and t.name == "aio_datadist-synchronizer"]:
            break
        await asyncio.sleep(0.02)
    assert not [t for t in threading.enumerate() if t not in before and t.name == "aio_datadist-synchronizer"]


async def test_same_host_layers_released_together_do_not_time_out_behind_each_other():
    """16 layers of 8 MiB released at once onto one copy thread of the owner: each takes a few ms, all of them
    several times the 15 ms time-out, which each layer must meet only once the owner's copy could start."""
    layers = 16
    desc = CacheDesc(2 * layers, (8, 512 * 1024), DataType.DT_UINT8, Placement.HOST)  # 4 MiB a tensor
    rows = list(range(8))
    async with contextlib.AsyncExitStack() as stack:
        prompt = await stack.enter_async_context(endpoint(LLMRole.PROMPT, PROMPT_ID, listen=True,
                                                          sync_kv_timeout=15, transport="local"))
        dec = await stack.enter_async_context(LLMDataDist(LLMRole.DECODER, DECODER_ID))
        await dec.init({**options(transport="local"), "aio.CopyThreads": "1"})
        dec.kv_cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(DECODER_ID, 0))
        assert (await dec.link_clusters([cluster_info(PROMPT_ID, port_of(prompt))]))[0] == OK
        src = prompt.kv_cache_manager.allocate_blocks_cache(desc)
        for t in src.tensors:
            t.fill_(1)
        task = prompt.kv_cache_manager.transfer_cache_async(
            src, Ready(), [TransferWithCacheKeyConfig(BlocksCacheKey(DECODER_ID, 0))], rows, rows)
        try:
            results: object = await task
        except LLMException as exc:
            results = exc
        assert results == [OK]
        assert prompt.stats().links[DECODER_ID].transports["push"] == "local"


@pytest.mark.parametrize("decoders", [1, 2])
@pytest.mark.parametrize("transport", ["tcp", "local"])
async def test_a_layer_refused_while_the_one_before_waits_for_its_done_leaves_that_one_in_place(
        monkeypatch, transport, decoders):
    """The destination refuses layer 1 (a raw address that lies nowhere) while layer 0's push to it waits for
    its ``DONE`` (held here until the refusal was handled): the refusal cut every push to it, and layer 0, in
    place, failed "before it was sent", for a second destination too. The layers before a refused one stay
    in place (docs/async.md); the task still ends only once their pushes did."""
    TRANSPORT["default"] = transport
    try:
        async with setup(decoders=decoders) as s:
            target = usable_link(s.prompt, DECODER_ID)
            loop = asyncio.get_running_loop()
            askers: dict[int, asyncio.Task | None] = {}
            handled = loop.create_future()  # the push the destination refused is over
            expect = Link.expect

            def watched(self: Link, req_id: int, answer: object = None, *,
                        then: asyncio.Future | None = None, **kw: object) -> asyncio.Future:
                if self is not target or answer is not None:
                    return expect(self, req_id, answer, then=then, **kw)
                # the reply after the answer (a push's DONE) reaches the caller's ``then`` through the same hold
                inner_then = None if then is None else loop.create_future()
                fut = expect(self, req_id, answer, then=inner_then, **kw)
                askers.setdefault(req_id, asyncio.current_task())

                def relay(f: asyncio.Future, held: asyncio.Future) -> None:
                    if held.done():
                        return
                    if f.cancelled() or f.exception() is not None:
                        held.cancel() if f.cancelled() else held.set_exception(f.exception())
                        return
                    reply = f.result()
                    if type(reply).__name__ == "Done" and not handled.done():
                        handled.add_done_callback(lambda _: relay(f, held))
                        return
                    asker = askers[req_id]
                    if reply.status != 0 and asker is not None:
                        asker.add_done_callback(lambda _: handled.done() or handled.set_result(None))
                    held.set_result(reply)

                held = loop.create_future()
                fut.add_done_callback(lambda f: relay(f, held))
                if inner_then is not None and then is not None:
                    inner_then.add_done_callback(lambda f: relay(f, then))
                return held

            monkeypatch.setattr(Link, "expect", watched)
            src = s.blocks_src()
            dst, _ = _canaried(s.decoders[0])
            addrs = list(dst.per_device_tensor_addrs[0])
            addrs[3] = 2**40  # layer 1's V lies nowhere: the owner refuses layer 1
            configs: list = [TransferConfig(DECODER_ID, addrs)]
            configs += [blocks_config(SECOND_DECODER_ID)] * (decoders - 1)
            gate = Gate()
            gate.open(0, 1)  # layers 0 and 1 at once: layer 1 is refused while layer 0 is in flight
            task = s.pm.transfer_cache_async(src, gate, configs, SRC_BLOCKS, DST_BLOCKS)
            gate.open(*range(2, LAYERS))
            async with asyncio.timeout(5):
                with pytest.raises(LLMException) as info:
                    await task
                assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
                assert handled.done()
                assert s.prompt.stats().links[DECODER_ID].kinds["push"].in_flight == 0  # layer 0's push ended
                await task.layer(0)  # in place: it succeeds (before the fix it failed "before it was sent")
            assert layer_landed(dst, src, 0, DST_BLOCKS, SRC_BLOCKS)
            assert all(layer_landed(d, src, layer, DST_BLOCKS, SRC_BLOCKS) for d in s.dsts[1:] for layer in
                       range(LAYERS))
            with pytest.raises(LLMException) as info:
                await task.layer(1)
            assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
            for later in range(2, LAYERS):  # cut before their first step, or never started: the destination's code
                with pytest.raises(LLMException) as info:
                    await task.layer(later)
                assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID, (later, str(info.value))
                cut = str(info.value)  # a push cut says so, and at which layer its destination failed
                assert ("cut, destination 0 failed at layer 1 " in cut  # cut before its first step
                        or f"destination 0 failed before layer {later}" in cut), (later, cut)  # never started
            assert (await task.get_results())[0] == LLMStatusCode.LLM_PARAM_INVALID
    finally:
        TRANSPORT["default"] = "tcp"


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_layer_whose_push_was_cut_before_its_first_step_fails_with_its_destinations_code():
    """A destination that failed (another layer's push to it: its link went, the owner refused) cuts its pushes of
    later layers; one cut before its first step ends cancelled, and its layer fails with the destination's code,
    as a layer never started for it does. Before, it read ``LLM_FAILED`` ("a destination failed before layer N was
    sent"): ``test_layerwise_faults.py::test_receiver_killed_mid_task`` saw it under load (pushes of layers 1-3
    in flight when the receiver was killed)."""
    from aio_datadist.layerwise import _confirm
    from aio_datadist.task import TaskProgress

    progress = TaskProgress([0, 1], 2)
    cut = asyncio.get_running_loop().create_future()
    cut.cancel()
    ok = asyncio.get_running_loop().create_future()
    ok.set_result(None)
    progress.set_result(1, LLMStatusCode.LLM_LINK_FAILED)
    await _confirm(progress, 1, [(0, ok), (1, cut)], None, None, [], {1})
    with pytest.raises(LLMException) as info:
        await progress.layers[1]
    assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED, str(info.value)
    assert "destination 1" in str(info.value)


@pytest.mark.loops_take_turns
async def test_a_layer_never_started_for_a_destination_that_failed_fails_with_its_code():
    """Row 313's other half: a destination that failed at layer 0 (the owner refused it) gets no push of layer 1,
    and layer 1 fails with its code, not ``LLM_FAILED``, while a second destination goes on."""
    async with setup(decoders=2) as s:
        src = s.blocks_src()
        dst, _ = _canaried(s.decoders[0])
        addrs = list(dst.per_device_tensor_addrs[0])
        addrs[0] = 2**40  # layer 0's K lies nowhere: the owner refuses layer 0
        gate = Gate()
        gate.open(0)
        task = s.pm.transfer_cache_async(src, gate, [TransferConfig(DECODER_ID, addrs),
                                                     blocks_config(SECOND_DECODER_ID)], SRC_BLOCKS, DST_BLOCKS)
        async with asyncio.timeout(5):
            with pytest.raises(LLMException) as info:
                await task.layer(0)
            assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
            gate.open(*range(1, LAYERS))
            with pytest.raises(LLMException) as info:
                await task.layer(1)
            assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID, str(info.value)
            assert "destination 0" in str(info.value)
            with pytest.raises(LLMException):
                await task
