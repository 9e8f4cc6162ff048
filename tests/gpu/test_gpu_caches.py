"""Device caches on CUDA: allocation, byte-exact copy_blocks / copy_cache / swap_blocks, every copy method.

Each copy is compared byte for byte with the same copy done by torch on a
clone, on random data; rows a copy must not touch are checked untouched.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aio_datadist.devices import kernels
from aio_datadist.devices.ops import copy_rows
from aio_datadist.testing import registry_of, runtime_of

S = LLMStatusCode
BLOCKS = CacheDesc(8, (64, 16, 8, 128), DataType.DT_FLOAT16, Placement.DEVICE)     # 64 blocks of 32 KiB
HOST_BLOCKS = CacheDesc(8, (64, 16, 8, 128), DataType.DT_FLOAT16, Placement.HOST)
CONTIG = CacheDesc(4, (3, 1000, 3), DataType.DT_INT8, Placement.DEVICE)              # rows of 3000 bytes
D2D = ["kernel", "torch"] if kernels.available() else ["torch"]


def options(device_id: int = 0) -> dict[str, str]:
    cfg = LLMConfig()
    cfg.device_id = device_id
    cfg.device_type = "cuda"
    return cfg.generate_options()


def fill(tensors, seed: int) -> None:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for t in tensors:
        raw = t.view(torch.uint8).reshape(-1)
        raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=gen))


def rows(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).reshape(t.shape[0], -1).cpu()


@pytest.mark.asyncio
async def test_device_caches_live_on_the_gpu_and_peers_reach_them_by_key():
    async with LLMDataDist(LLMRole.MIX, 1) as dd:
        await dd.init(options())
        kv = dd.kv_cache_manager
        cache = kv.allocate_blocks_cache(BLOCKS)
        assert cache.device == torch.device("cuda", 0) and cache.on_device
        assert all(t.is_cuda and t.is_contiguous() and t.data_ptr() % 256 == 0 for t in cache.tensors)
        assert cache.per_device_tensor_addrs == [[t.data_ptr() for t in cache.tensors]]
        reg = registry_of(dd)
        assert reg.by_id(cache.cache_id) is cache and cache in reg.caches()  # the staging plane moves them
        host = kv.allocate_blocks_cache(HOST_BLOCKS)
        assert host.device.type == "cpu" and host._pin is not None and not host.on_device  # page-locked for swaps
        keyed = kv.allocate_blocks_cache(BLOCKS, BlocksCacheKey(1, 0))
        assert reg.by_blocks_key(0) is keyed and keyed.on_device
        contig = kv.allocate_cache(CONTIG, [CacheKey(1, 5)])
        assert contig.on_device


@pytest.mark.asyncio
async def test_a_device_id_the_machine_lacks_is_refused():
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(LLMException) as info:
        await dd.init(options(torch.cuda.device_count()))
    assert info.value.status_code == S.LLM_PARAM_INVALID and "device_id" in str(info.value)
    await dd.finalize()


@pytest.mark.asyncio
@pytest.mark.parametrize("method", [None, *D2D])
@pytest.mark.parametrize("seed", [1, 2])
async def test_copy_blocks_is_byte_exact(method, seed):
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(options())
        kv = dd.kv_cache_manager
        cache = kv.allocate_blocks_cache(BLOCKS)
        fill(cache.tensors, seed)
        rng = random.Random(seed)
        blocks = list(range(64))
        rng.shuffle(blocks)
        srcs, dsts = blocks[:20], blocks[20:44]
        info = {s: [] for s in srcs}
        for d in dsts:
            info[rng.choice(srcs)].append(d)
        info = {s: d for s, d in info.items() if d}
        before = [rows(t) for t in cache.tensors]
        if method is None:
            await kv.copy_blocks(cache, info)
        else:
            pairs = [(s, d) for s, ds in info.items() for d in ds]
            moved = await copy_rows(runtime_of(dd), cache, [d for _, d in pairs], cache, [s for s, _ in pairs], 0,
                                    cache.layout.row_bytes, 5000, "copy_blocks", method)
            assert moved == len(pairs) * BLOCKS.num_tensors * cache.layout.row_bytes
        for old, t in zip(before, cache.tensors):
            want = old.clone()
            for s, ds in info.items():
                for d in ds:
                    want[d] = old[s]
            assert torch.equal(rows(t), want)


@pytest.mark.asyncio
@pytest.mark.parametrize("method", [None, *D2D])
async def test_copy_cache_with_offsets_is_byte_exact(method):
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(options())
        kv = dd.kv_cache_manager
        a, b = kv.allocate_cache(CONTIG), kv.allocate_cache(CONTIG)
        fill(a.tensors, 3)
        fill(b.tensors, 4)
        for offset, size in [(0, -1), (7, 1001), (2998, 2), (16, 2048)]:
            before = [rows(t) for t in a.tensors]
            src = [rows(t) for t in b.tensors]
            nbytes = 3000 - offset if size == -1 else size
            if method is None:
                await kv.copy_cache(a, b, dst_batch_index=2, src_batch_index=1, offset=offset, size=size)
            else:
                await copy_rows(runtime_of(dd), a, [2], b, [1], offset, nbytes, 5000, "copy_cache", method)
            for old, s, t in zip(before, src, a.tensors):
                want = old.clone()
                want[2, offset:offset + nbytes] = s[1, offset:offset + nbytes]
                assert torch.equal(rows(t), want), (offset, size)


@pytest.mark.asyncio
@pytest.mark.parametrize("method", [None, "batch", "staged", *(["kernel"] if kernels.available() else [])])
@pytest.mark.parametrize("to_device", [True, False])
async def test_swap_blocks_is_byte_exact(method, to_device):
    async with LLMDataDist(LLMRole.DECODER, 1) as dd:
        await dd.init(options())
        rt = runtime_of(dd)
        if method == "batch" and not rt.devices.batch_copies:
            pytest.skip("the driver has no cuMemcpyBatchAsync")
        if method == "staged":
            from aio_datadist.devices.staging import DeviceStaging

            rt._staging = DeviceStaging(rt.completions, rt.devices, chunk_bytes=1 << 20, buffers=3)  # many chunks
        kv = dd.kv_cache_manager
        dev, host = kv.allocate_blocks_cache(BLOCKS), kv.allocate_blocks_cache(HOST_BLOCKS)
        assert host._pin is not None, "cudaHostRegister failed for the host cache"
        fill(dev.tensors, 5)
        fill(host.tensors, 6)
        src, dst = (host, dev) if to_device else (dev, host)
        mapping = dict(zip(random.Random(7).sample(range(64), 40), random.Random(8).sample(range(64), 40)))
        before = [rows(t) for t in dst.tensors]
        source = [rows(t) for t in src.tensors]
        if method is None:
            await kv.swap_blocks(src, dst, mapping)
        else:
            await copy_rows(rt, dst, list(mapping.values()), src, list(mapping), 0, dst.layout.row_bytes, 10000,
                            "swap_blocks", method)
        for old, s, t in zip(before, source, dst.tensors):
            want = old.clone()
            for a, b in mapping.items():
                want[b] = s[a]
            assert torch.equal(rows(t), want)


@pytest.mark.asyncio
async def test_registered_framework_tensors_copy_like_allocated_ones():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(options())
        kv = dd.kv_cache_manager
        mine = [torch.empty(BLOCKS.shape, dtype=torch.float16, device="cuda") for _ in range(BLOCKS.num_tensors)]
        cache = kv.register_blocks_cache(BLOCKS, mine)
        fill(cache.tensors, 9)
        before = [rows(t) for t in mine]
        await kv.copy_blocks(cache, {3: [10, 11], 60: [0]})
        for old, t in zip(before, mine):
            want = old.clone()
            want[10] = want[11] = old[3]
            want[0] = old[60]
            assert torch.equal(rows(t), want)
        with pytest.raises(LLMException) as info:
            kv.register_blocks_cache(BLOCKS, [t.cpu() for t in mine])
        assert info.value.status_code == S.LLM_PARAM_INVALID


@pytest.mark.asyncio
async def test_copies_wait_for_the_callers_stream_and_time_out_cleanly():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(options())
        kv, rt = dd.kv_cache_manager, runtime_of(dd)
        cache = kv.allocate_blocks_cache(BLOCKS)
        fill(cache.tensors, 10)
        # Work on the caller's stream, enqueued before the copy, is seen by the copy.
        torch.cuda._sleep(50_000_000)
        cache.tensors[0][5].fill_(1.5)
        await kv.copy_blocks(cache, {5: [6]})
        assert torch.equal(rows(cache.tensors[0])[6], rows(cache.tensors[0])[5])
        # A copy stuck behind a long kernel times out. Queued device work cannot be recalled, so the call
        # returns only once the stream ran it (reliability row 68): nothing pending, the row already final.
        torch.cuda._sleep(800_000_000)
        started = time.monotonic()
        with pytest.raises(LLMException) as info:
            await kv.copy_blocks(cache, {7: [8]}, timeout=5)
        waited = time.monotonic() - started
        assert info.value.status_code == S.LLM_TIMEOUT
        assert rt.completions.pending_count() == 0
        assert waited > 0.05, waited  # it waited for the stalled stream, not only its 5 ms
        landed = rows(cache.tensors[0])[8]
        torch.cuda.synchronize()
        assert torch.equal(rows(cache.tensors[0])[8], landed)  # nothing changed after the return
        assert torch.equal(landed, rows(cache.tensors[0])[7])
        await kv.copy_blocks(cache, {9: [10]})
        assert torch.equal(rows(cache.tensors[3])[10], rows(cache.tensors[3])[9])


@pytest.mark.asyncio
async def test_staging_sends_and_receives_device_rows_in_wire_order():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(options())
        from aio_datadist.devices.staging import DeviceStaging

        rt, kv = runtime_of(dd), dd.kv_cache_manager
        stager = DeviceStaging(rt.completions, rt.devices, chunk_bytes=256 << 10, buffers=2)
        try:
            cache = kv.allocate_blocks_cache(BLOCKS)
            fill(cache.tensors, 11)
            blocks = [40, 2, 17, 63, 5]
            nbytes = cache.layout.row_bytes
            out = bytearray(6 * len(blocks) * nbytes)

            async def consume(chunk, view):
                out[chunk.position:chunk.position + chunk.nbytes] = view.numpy().tobytes()

            await stager.send(cache, 1, 6, blocks, 0, nbytes, consume)
            want = b"".join(rows(cache.tensors[t])[b].numpy().tobytes() for t in range(1, 7) for b in blocks)
            assert bytes(out) == want
            assert stager.pool.peak <= 2
            other = kv.allocate_blocks_cache(BLOCKS)
            fill(other.tensors, 12)
            before = [rows(t) for t in other.tensors]

            async def fill_from(chunk, view):
                view.copy_(torch.frombuffer(bytearray(out[chunk.position:chunk.position + chunk.nbytes]),
                                            dtype=torch.uint8))

            dst_blocks = [0, 1, 2, 3, 4]
            await stager.receive(other, 1, 6, dst_blocks, 0, nbytes, fill_from)
            for t in range(8):
                want_rows = before[t].clone()
                if 1 <= t <= 6:
                    for b_src, b_dst in zip(blocks, dst_blocks):
                        want_rows[b_dst] = rows(cache.tensors[t])[b_src]
                assert torch.equal(rows(other.tensors[t]), want_rows)
        finally:
            stager.close()
