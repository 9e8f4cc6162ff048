"""Device caches between endpoints on CUDA: the staging plane, stream-recorded layers, and the defects'
device halves (graph capture refused, primary context released, pinned host caches in the kernel path).

NOT RUN in this session (no GPU); written for ``benchmarks/gpu.py``'s test step on the lent H200.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    EventLayerSynchronizer,
    LLMException,
    LLMStatusCode,
    Placement,
    TransferWithCacheKeyConfig,
    _core,
)
from aio_datadist.devices import kernels
from aio_datadist.devices.ops import copy_rows
from aio_datadist.devices.staging import DeviceStaging
from aio_datadist.testing import runtime_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from peers import DECODER_ID, PROMPT_ID, fill, linked_pair, snapshot  # noqa: E402

S = LLMStatusCode
pytestmark = pytest.mark.asyncio
CUDA = {"device_type": "cuda", "transport": "tcp"}
BLOCKS = CacheDesc(6, (32, 16, 8, 128), DataType.DT_FLOAT16, Placement.DEVICE)  # 32 blocks of 32 KiB
HOST = CacheDesc(6, (32, 16, 8, 128), DataType.DT_FLOAT16, Placement.HOST)


def eq(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8).cpu(), b.contiguous().view(torch.uint8).cpu())


def small_staging(dd) -> DeviceStaging:
    rt = runtime_of(dd)
    rt._staging = DeviceStaging(rt.completions, rt.devices, chunk_bytes=256 << 10, buffers=2)
    return rt._staging


@pytest.mark.parametrize("dst_place", [Placement.DEVICE, Placement.HOST])
async def test_pull_blocks_from_a_gpu_cache_over_tcp_staging(dst_place):
    async with linked_pair(prompt_config=CUDA, decoder_config=CUDA) as pair:
        small_staging(pair.prompt)
        small_staging(pair.decoder)
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        fill(src, 3)
        values = [t.clone() for t in src.tensors]
        dst = pair.dm.allocate_blocks_cache(BLOCKS if dst_place is Placement.DEVICE else HOST)
        before = snapshot(dst)
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, [31, 0, 7], [1, 2, 30])
        torch.cuda.synchronize()
        for d, v, b in zip(dst.tensors, values, before, strict=True):
            assert eq(d[1], v[31]) and eq(d[2], v[0]) and eq(d[30], v[7]) and eq(d[0], b[0])


async def test_push_blocks_between_gpu_caches_over_tcp_staging():
    async with linked_pair(prompt_config=CUDA, decoder_config=CUDA, link=False) as pair:
        dst = pair.dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID, 0))
        await pair.link()
        src = pair.pm.allocate_blocks_cache(BLOCKS)
        fill(src, 4)
        await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID, 0), src, [2, 3], [9, 8])
        torch.cuda.synchronize()
        for d, s in zip(dst.tensors, src.tensors, strict=True):
            assert eq(d[9], s[2]) and eq(d[8], s[3])


async def test_layers_recorded_on_a_cuda_stream_go_once_the_stream_gets_there():
    desc = CacheDesc(4, (8, 16, 8, 128), DataType.DT_FLOAT16, Placement.DEVICE)
    async with linked_pair(prompt_config=CUDA, decoder_config=CUDA, link=False) as pair:
        dst = pair.dm.allocate_blocks_cache(desc, BlocksCacheKey(DECODER_ID, 0))
        await pair.link()
        src = pair.pm.allocate_blocks_cache(desc)
        compute = torch.cuda.Stream()
        with EventLayerSynchronizer(pair.prompt, 2) as events:
            config = TransferWithCacheKeyConfig(BlocksCacheKey(DECODER_ID, 0))
            task = pair.pm.transfer_cache_async(src, events, [config], [1], [5])
            with torch.cuda.stream(compute):
                torch.cuda._sleep(200_000_000)  # a slow layer 0
                for t in (0, 1):
                    src.tensors[t][1].fill_(float(t + 1))
                events.record(0, stream=compute)
                for t in (2, 3):
                    src.tensors[t][1].fill_(float(t + 1))
                events.record(1, stream=compute)
            assert await task == [S.LLM_SUCCESS]
        torch.cuda.synchronize()
        for t in range(4):
            assert bool((dst.tensors[t][5] == float(t + 1)).all())  # the values the stream wrote, not older ones


async def test_a_notify_on_a_capturing_stream_is_refused():
    async with linked_pair(prompt_config=CUDA, decoder_config=CUDA, link=False) as pair:
        backend = runtime_of(pair.prompt).devices
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        x = torch.zeros(16, device="cuda")
        with torch.cuda.stream(stream):
            x.add_(1)  # warm-up outside the capture
        torch.cuda.synchronize()
        with pytest.raises(LLMException) as info, torch.cuda.graph(graph, stream=stream):
            x.add_(1)
            backend.notify_on(123456, stream)
        assert info.value.status_code == S.LLM_PARAM_INVALID and "CUDA graph" in str(info.value)


async def test_the_primary_context_is_released_when_the_endpoint_closes():
    driver = _core.cuda_driver()
    held = driver.retained(0)
    async with linked_pair(prompt_config=CUDA, decoder_config=CUDA, link=False):
        assert driver.retained(0) == held + 2
    assert driver.retained(0) == held


@pytest.mark.skipif(not kernels.available(), reason="needs Triton")
async def test_the_kernel_reaches_a_pinned_host_cache_through_its_mapped_pointer():
    async with linked_pair(prompt_config=CUDA, decoder_config=CUDA, link=False) as pair:
        rt = runtime_of(pair.prompt)
        dev = pair.pm.allocate_blocks_cache(BLOCKS)
        host = pair.pm.allocate_blocks_cache(HOST)
        fill(host, 5)
        assert host._pin is not None
        await copy_rows(rt, dev, [4, 5], host, [0, 1], 0, dev.layout.row_bytes, 10000, "test", method="kernel")
        torch.cuda.synchronize()
        for d, h in zip(dev.tensors, host.tensors, strict=True):
            assert eq(d[4], h[0]) and eq(d[5], h[1])


async def test_auto_picks_cuda_where_torch_sees_a_device():
    async with linked_pair(prompt_config={"device_type": "auto"}, link=False) as pair:
        assert runtime_of(pair.prompt).devices.kind == "cuda"
