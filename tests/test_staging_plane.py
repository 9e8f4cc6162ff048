"""The staging plane on the host backend: device caches between processes through bounded host chunks.

Every device cache here lives on the host backend (``aio.DeviceType=host``):
its bytes move only through the backend's ordered copy queues and the
staging pipeline, exactly as a CUDA cache's do; the CUDA runs are in
``tests/gpu/``. Both ends are real endpoints linked over loopback sockets.
"""

from __future__ import annotations

import array
import asyncio

import pytest
import torch
from peers import (DECODER_ID, PROMPT_ID, TRANSPORT, TRANSPORTS, cluster_info, endpoint, fill, linked_pair, port_of,
                   snapshot)

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    EventLayerSynchronizer,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferWithCacheKeyConfig,
)
from aio_datadist.devices.staging import DeviceStaging
from aio_datadist.owner import _serve_addrs
from aio_datadist.plans import addrs_target
from aio_datadist.testing import links_of, runtime_of
from aio_datadist.transport.base import Refusal
from aio_datadist.wire import Msg, TransferReq

S = LLMStatusCode
pytestmark = pytest.mark.asyncio
HOST = {"device_type": "host"}
# 6 blocks of 3 KiB per tensor, 4 tensors: 72 KiB, many 4 KiB chunks, units split across chunks too.
BLOCKS = CacheDesc(4, (6, 3, 512), DataType.DT_FLOAT16, Placement.DEVICE)


@pytest.fixture(autouse=True, params=TRANSPORTS)
def transport(request, monkeypatch):
    """TCP data channels, a same-host link and a NIXL link, every device transfer through the staging
    plane: NIXL does not register the host backend's device caches (they are not VRAM), and on the
    same-host link device IPC is switched off here (as where a driver has no exportable memory) so that
    staging is what runs; device IPC has its own tests (``test_device_ipc.py``)."""
    from aio_datadist.devices.host_backend import HostBackend

    monkeypatch.setattr(HostBackend, "ipc_unavailable", lambda self: "switched off by test_staging_plane.py")
    TRANSPORT["default"] = request.param
    yield request.param
    TRANSPORT["default"] = "tcp"


def small_staging(dd, buffers: int = 2) -> DeviceStaging:
    """Four-KiB chunks, ``buffers`` of them: many chunks per transfer, and the bound is easy to check."""
    rt = runtime_of(dd)
    rt._staging = DeviceStaging(rt.completions, rt.devices, chunk_bytes=4096, buffers=buffers)
    return rt._staging


async def offer_settled(decoder, src) -> None:
    """On a NIXL link, wait (at most 5 s) until the decoder prepared the NIXL descriptors of ``src``, a host
    cache the prompt allocated after linking (its offer is prepared in the background, on the NIXL worker),
    so that a test that checks that a pull left nothing pending counts only the pull's own work."""
    if TRANSPORT["default"] != "nixl" or src.on_device:
        return
    peer = links_of(decoder)[PROMPT_ID].nixl
    completions = runtime_of(decoder).completions
    for _ in range(500):
        if peer is None or (src.cache_id in peer.caches and completions.pending_count() == 0):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the offer of cache {src.cache_id} was not prepared within 5 s")


def eq(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-exact (uninitialised device memory may hold NaNs)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def host_desc(desc: CacheDesc) -> CacheDesc:
    return CacheDesc(desc.num_tensors, desc.shape, desc.data_type, Placement.HOST)


@pytest.mark.parametrize("src_place,dst_place", [(Placement.DEVICE, Placement.DEVICE),
                                                 (Placement.HOST, Placement.DEVICE),
                                                 (Placement.DEVICE, Placement.HOST)])
async def test_pull_blocks_with_device_caches_lands_exactly_the_named_blocks(src_place, dst_place):
    async with linked_pair(prompt_config=HOST, decoder_config=HOST) as pair:
        theirs, ours = small_staging(pair.prompt), small_staging(pair.decoder)
        src_desc = BLOCKS if src_place is Placement.DEVICE else host_desc(BLOCKS)
        dst_desc = BLOCKS if dst_place is Placement.DEVICE else host_desc(BLOCKS)
        src = pair.pm.allocate_blocks_cache(src_desc, BlocksCacheKey(PROMPT_ID, 0))
        values = fill(src, 7)
        dst = pair.dm.allocate_blocks_cache(dst_desc)
        assert src.on_device is (src_place is Placement.DEVICE) and dst.on_device is (dst_place is Placement.DEVICE)
        before = snapshot(dst)
        await offer_settled(pair.decoder, src)
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, [5, 0, 3], [1, 4, 2])
        for d, v, b in zip(dst.tensors, values, before, strict=True):
            assert eq(d[1], v[5]) and eq(d[4], v[0]) and eq(d[2], v[3])
            assert eq(d[0], b[0]) and eq(d[3], b[3]) and eq(d[5], b[5])
        for staging in (theirs, ours):
            assert staging.pool.peak <= staging.pool.buffers
        assert runtime_of(pair.decoder).completions.pending_count() == 0


async def test_push_blocks_and_pull_cache_by_key_between_device_caches():
    async with linked_pair(prompt_config=HOST, decoder_config=HOST) as pair:
        small_staging(pair.prompt, 3)
        small_staging(pair.decoder, 1)  # one buffer: nothing overlaps, everything still arrives
        src = pair.pm.allocate_blocks_cache(BLOCKS)
        values = fill(src, 3)
        dst = pair.dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID, 1))
        await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID, 1), src, [0, 2], [3, 5])
        for d, v in zip(dst.tensors, values, strict=True):
            assert eq(d[3], v[0]) and eq(d[5], v[2])

        desc = CacheDesc(2, (3, 1536), DataType.DT_INT8, Placement.DEVICE)  # rows of 1.5 KiB
        keyed = pair.pm.allocate_cache(desc, [CacheKey(PROMPT_ID, 10), CacheKey(PROMPT_ID, 11)])
        values = fill(keyed, 4)
        into = pair.dm.allocate_cache(desc)
        await pair.dm.pull_cache(CacheKey(PROMPT_ID, 11), into, batch_index=2)
        for d, v in zip(into.tensors, values, strict=True):
            assert eq(d[2], v[1])

        # rows of 5000 B, more than a chunk: each goes in two pieces (2560 + 2440 B), and no byte past its row
        desc = CacheDesc(2, (3, 5000), DataType.DT_INT8, Placement.DEVICE)
        keyed = pair.pm.allocate_cache(desc, [CacheKey(PROMPT_ID, 12)])
        values = fill(keyed, 5)
        into = pair.dm.allocate_cache(desc)
        before = snapshot(into)
        await pair.dm.pull_cache(CacheKey(PROMPT_ID, 12), into, batch_index=0)
        for d, v, b in zip(into.tensors, values, before, strict=True):
            assert eq(d[0], v[0]) and eq(d[1:], b[1:]), "a byte landed past the pulled row"


async def test_pulls_over_two_links_stay_within_the_pools_buffers():
    """The bound is the pool's, not only each link's share: two links' receives held behind the device
    stream (each may hold 2 of 3 buffers) never make the decoder's staging memory more than 3 buffers."""
    async with linked_pair(prompt_config=HOST, decoder_config=HOST) as pair, \
            endpoint(LLMRole.PROMPT, 7, listen=True, **HOST) as other:
        small_staging(pair.prompt)
        small_staging(other)
        pool = small_staging(pair.decoder, 3).pool
        assert await pair.decoder.link_clusters([cluster_info(7, port_of(other))]) == (S.LLM_SUCCESS,
                                                                                       [S.LLM_SUCCESS])
        srcs = [dd.kv_cache_manager.allocate_blocks_cache(BLOCKS, BlocksCacheKey(dd.cluster_id, 0))
                for dd in (pair.prompt, other)]
        values = [fill(src, 20 + i) for i, src in enumerate(srcs)]
        dsts = [pair.dm.allocate_blocks_cache(BLOCKS) for _ in srcs]
        gate = runtime_of(pair.decoder).devices.stream.gate()  # scatters queue up: receives keep their buffers
        pulls = [asyncio.ensure_future(pair.dm.pull_blocks(BlocksCacheKey(src_id, 0), dst, list(range(6)),
                                                           list(range(6)), timeout=5000))
                 for src_id, dst in zip((PROMPT_ID, 7), dsts)]
        for _ in range(500):  # every buffer taken (bounded)
            if pool.live >= pool.buffers:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # room for a buffer past the bound to be taken
        gate.open()
        await asyncio.gather(*pulls)
        assert pool.peak <= pool.buffers, f"{pool.peak} buffers of {pool.buffers}"
        for dst, vals in zip(dsts, values, strict=True):
            assert all(eq(d, v) for d, v in zip(dst.tensors, vals, strict=True))


async def test_a_timed_out_pull_into_a_held_device_stream_returns_only_once_nothing_can_land():
    async with linked_pair(prompt_config=HOST, decoder_config=HOST) as pair:
        small_staging(pair.prompt)
        small_staging(pair.decoder)
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        fill(src, 9)
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        backend = runtime_of(pair.decoder).devices
        gate = backend.stream.gate()  # the decoder's copy stream stops here: scatters queue up behind it
        loop = asyncio.get_running_loop()
        loop.call_later(0.6, gate.open)
        with pytest.raises(LLMException) as info:
            await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, list(range(6)), list(range(6)),
                                      timeout=200)
        assert info.value.status_code == S.LLM_TIMEOUT
        after = snapshot(dst)
        assert backend.stream.pending() == 0  # every scatter it enqueued ran before it returned
        await asyncio.sleep(0.2)
        for a, t in zip(after, dst.tensors, strict=True):
            assert eq(a, t)  # no byte after return
        rt = runtime_of(pair.decoder)
        assert rt.completions.pending_count() == 0
        assert rt.staging.pool.live <= rt.staging.pool.buffers
        # The link and the staging pool are fine afterwards.
        values = fill(src, 10)
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, [1], [1])
        assert all(eq(d[1], v[1]) for d, v in zip(dst.tensors, values, strict=True))
        # A push whose gathers wait on the sender's held stream: it too returns once every gather it enqueued ran.
        pair.dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID, 1))
        theirs = runtime_of(pair.prompt).devices
        gate = theirs.stream.gate()
        loop.call_later(0.5, gate.open)
        with pytest.raises(LLMException) as info:
            await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID, 1), src, list(range(6)), list(range(6)),
                                      timeout=200)
        assert info.value.status_code == S.LLM_TIMEOUT
        assert theirs.stream.pending() == 0, "a gather of the timed-out push is still queued"
        assert runtime_of(pair.prompt).completions.pending_count() == 0


async def test_raw_addresses_into_a_device_cache_are_refused():
    async with linked_pair(prompt_config=HOST, decoder_config=HOST) as pair:
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        assert dst.on_device
        # The owner finds the address in a device cache and refuses before any byte moves.
        req = TransferReq(channel=0, **addrs_target(DECODER_ID), layer_first=0, layer_last=0, tensor_num_per_layer=1,
                          tensor_count=1, data_type=BLOCKS.data_type.value, offset=0, nbytes=64,
                          flags=0, timeout_ms=0, rows=(dst.tensor_addrs[0],), block_shape=0)
        with pytest.raises(Refusal) as info:
            _serve_addrs(runtime_of(pair.decoder), Msg.PUSH_REQ, req)
        assert info.value.code == S.LLM_FEATURE_NOT_ENABLED and "device cache" in info.value.text


LAYERS = 3
LAYERED = CacheDesc(2 * LAYERS, (4, 2, 256), DataType.DT_FLOAT16, Placement.DEVICE)


async def test_layers_recorded_on_a_compute_stream_go_once_the_stream_gets_there():
    """transfer_cache_async from a device cache; EventLayerSynchronizer.record(i, stream=compute)."""
    async with linked_pair(prompt_config=HOST, decoder_config=HOST, link=False) as pair:
        small_staging(pair.prompt)
        dst = pair.dm.allocate_blocks_cache(LAYERED, BlocksCacheKey(DECODER_ID, 0))
        await pair.link()
        src = pair.pm.allocate_blocks_cache(LAYERED)
        staged = pair.pm.allocate_blocks_cache(host_desc(LAYERED))  # what the "model" writes
        values = fill(staged, 5)
        backend = runtime_of(pair.prompt).devices
        compute = backend.new_stream()
        with EventLayerSynchronizer(pair.prompt, LAYERS) as events:
            config = TransferWithCacheKeyConfig(BlocksCacheKey(DECODER_ID, 0))
            task = pair.pm.transfer_cache_async(src, events, [config], [0, 2], [3, 1])
            gates = []
            for layer in range(LAYERS):
                gates.append(compute.gate())  # the layer's compute is slow to finish
                for t in (2 * layer, 2 * layer + 1):
                    dst_t, src_t = src.tensors[t].view(torch.uint8), staged.tensors[t].view(torch.uint8)
                    compute.enqueue_copies(array.array("Q", [dst_t.data_ptr()]), array.array("Q", [src_t.data_ptr()]),
                                           array.array("Q", [dst_t.numel()]))
                events.record(layer, stream=compute)
            await asyncio.sleep(0.3)
            assert not task.layer(0).done()  # the stream has not reached layer 0's mark
            gates[0].open()
            await asyncio.wait_for(task.layer(0), 5)
            assert not task.layer(1).done()
            for g in gates[1:]:
                g.open()
            assert await asyncio.wait_for(task, 5) == [S.LLM_SUCCESS]
        for t in range(2 * LAYERS):
            assert eq(dst.tensors[t][3], values[t][0]) and eq(dst.tensors[t][1], values[t][2])
        with EventLayerSynchronizer(pair.prompt, 1) as other, pytest.raises(LLMException) as info:
            other.record(0, stream=object())
        assert info.value.status_code == S.LLM_PARAM_INVALID and "stream" in str(info.value)


async def test_given_up_staged_pulls_give_their_buffers_back_without_the_garbage_collector():
    """A cut staged pull retires the buffers its copies may still touch; each comes back once the copy's
    completion lets it go. Before, the failure's traceback kept the pipeline's frame, and a retired buffer
    with it, until Python's cycle collector ran: with it off (as an idle loop may leave it for long), a
    few cut pulls left every buffer retired with nothing pending, and the next pull waited out its timeout."""
    import gc

    async with linked_pair(prompt_config=HOST, decoder_config=HOST) as pair:
        small_staging(pair.prompt)
        staging = small_staging(pair.decoder)
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        values = fill(src, 11)
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        rt = runtime_of(pair.decoder)
        blocks = list(range(6))
        gc.collect()
        gc.disable()
        try:
            cut = 0
            for i in range(24):
                pull = asyncio.ensure_future(pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, blocks, blocks,
                                                                 timeout=1 + i % 4 if i % 2 else 20000))
                if not i % 2:
                    await asyncio.sleep(0.001 * (i % 5))
                    pull.cancel()
                try:
                    await pull  # one that ends before its cut succeeds
                except (LLMException, asyncio.CancelledError):
                    cut += 1
            assert cut >= 12, f"only {cut} of 24 pulls were cut"
            for _ in range(100):  # every copy the cut pulls enqueued has reported (bounded)
                if rt.completions.pending_count() == 0:
                    break
                await asyncio.sleep(0.01)
            pool = staging.pool
            assert pool.live == pool.idle, f"{pool.live - pool.idle} of {pool.live} buffers still retired"
            await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, [1], [1], timeout=2000)
            assert all(eq(d[1], v[1]) for d, v in zip(dst.tensors, values, strict=True))
        finally:
            gc.enable()


class _ChannelGoesDown:
    """A link whose data channel takes ``ok`` jobs, then is down (reset by the peer): ``move`` raises, as
    ``Link.move`` does for a channel without a socket. Keeps every ``settled`` it was given."""

    def __init__(self, ok: int) -> None:
        self.ok = ok
        self.settles: list[asyncio.Future] = []

    def move(self, channel, pairs, *, send, timeout_ms, what, keepalive, settled=None, gated=0):
        self.settles.append(settled)
        if len(self.settles) > self.ok:
            raise LLMException("data channel 0 to cluster 1 is down", status_code=S.LLM_LINK_FAILED)
        settled.set_result(None)  # the job is over (it moved nothing: only the settling matters here)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(0)
        return fut


async def test_a_staged_send_whose_channel_goes_down_returns_the_failure():
    """A staged send whose next chunk finds the channel reset (the owner cut the request) fails with the
    channel's error. Before, the chunk's job was counted as started before the channel refused it, so the
    send waited forever for a job that never ran, through its own time-out (shielded): a hang."""
    from aio_datadist.transport.staging import staged_move

    async with linked_pair(prompt_config=HOST, decoder_config=HOST, link=False) as pair:
        small_staging(pair.decoder)
        src = pair.dm.allocate_blocks_cache(BLOCKS)
        fill(src, 3)
        rt = runtime_of(pair.decoder)
        link = _ChannelGoesDown(ok=2)
        lay = src.layout
        moving = asyncio.ensure_future(staged_move(rt, link, 0, src, 0, BLOCKS.num_tensors, list(range(6)), 0,
                                                   lay.row_bytes, send=True, what="test send"))
        done, _ = await asyncio.wait([moving], timeout=5)
        if not done:  # unstick it so the test ends, then fail
            for settled in link.settles:
                if not settled.done():
                    settled.set_result(None)
            await asyncio.wait([moving], timeout=5)
            pytest.fail("the staged send did not return within 5 s of its channel going down")
        with pytest.raises(LLMException) as info:
            moving.result()
        assert info.value.status_code == S.LLM_LINK_FAILED
        assert rt.completions.pending_count() == 0
