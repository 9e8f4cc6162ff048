"""The host backend (``aio.DeviceType=host``): device caches in host memory, moved only through
ordered native copy queues and completed by the core's StreamNotifier, so every device path runs on CI."""

from __future__ import annotations

import array
import ctypes

import pytest
import torch

from aio_datadist import CacheDesc, DataType, LLMDataDist, LLMRole, LLMStatusCode, Placement, _core
from aio_datadist.testing import runtime_of

S = LLMStatusCode


def _addr(buf: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def _q(*values: int) -> array.array:
    return array.array("Q", values)


def test_host_stream_runs_copies_in_order_after_the_streams_it_waits_for():
    queue = _core.CompletionQueue()
    notifier = _core.StreamNotifier(queue, "host")
    compute, copy = _core.HostStream(), _core.HostStream()
    try:
        src, mid, dst = bytearray(b"a" * 64), bytearray(64), bytearray(64)
        gate = compute.gate()
        compute.enqueue_copies(_q(_addr(mid)), _q(_addr(src)), _q(64))
        copy.wait_stream(compute)
        copy.enqueue_copies(_q(_addr(dst)), _q(_addr(mid)), _q(64))
        notifier.notify(5, copy.handle, 64)
        assert not copy.synchronize(0.2)  # held behind the gate on the other stream
        assert queue.drain() == [] and bytes(dst) == bytes(64)
        gate.open()
        assert copy.synchronize(5)
        assert bytes(dst) == b"a" * 64
        assert queue.drain() == [(5, 0, 64)]
        with pytest.raises(OSError, match="no open host stream"):
            notifier.notify(6, 12345, 0)
    finally:
        notifier.close()
        compute.close()
        copy.close()
        queue.close()


def test_closing_a_host_stream_releases_its_gates_and_refuses_more_work():
    stream = _core.HostStream()
    stream.gate()
    stream.close()
    with pytest.raises(OSError, match="closed"):
        stream.enqueue_copies(_q(0), _q(0), _q(0))


async def _host_dd(cluster: int = 1) -> LLMDataDist:
    dd = LLMDataDist(LLMRole.MIX, cluster)
    await dd.init({"aio.DeviceType": "host"})
    return dd


def _desc(placement: Placement, rows: int = 8, width: int = 33) -> CacheDesc:
    return CacheDesc(num_tensors=3, shape=[rows, width], data_type=DataType.DT_FLOAT16, placement=placement)


@pytest.mark.asyncio
async def test_host_backend_device_caches_swap_and_copy_byte_exact():
    before = _core.live_objects()
    dd = await _host_dd()
    try:
        rt = runtime_of(dd)
        assert rt.devices is not None and rt.devices.kind == "host"
        mgr = dd.kv_cache_manager
        dev = mgr.allocate_blocks_cache(_desc(Placement.DEVICE))
        host = mgr.allocate_blocks_cache(_desc(Placement.HOST))
        assert dev.on_device and not host.on_device
        gen = torch.Generator().manual_seed(3)
        for t in host.tensors:
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8,
                                                    generator=gen))
        await mgr.swap_blocks(host, dev, {0: 7, 3: 1, 5: 5})
        for h, d in zip(host.tensors, dev.tensors, strict=True):
            assert torch.equal(d[7].view(torch.uint8), h[0].view(torch.uint8))
            assert torch.equal(d[1].view(torch.uint8), h[3].view(torch.uint8))
        await mgr.copy_blocks(dev, {7: [2, 3], 1: [6]})
        for d in dev.tensors:
            assert torch.equal(d[2].view(torch.uint8), d[7].view(torch.uint8))
            assert torch.equal(d[6].view(torch.uint8), d[1].view(torch.uint8))
        back = mgr.allocate_blocks_cache(_desc(Placement.HOST))
        await mgr.swap_blocks(dev, back, {2: 0, 6: 1})
        for h, b in zip(host.tensors, back.tensors, strict=True):
            assert torch.equal(b[0].view(torch.uint8), h[0].view(torch.uint8))
            assert torch.equal(b[1].view(torch.uint8), h[3].view(torch.uint8))
        assert rt.completions.pending_count() == 0
    finally:
        await dd.finalize()
    assert _core.live_objects() == before
