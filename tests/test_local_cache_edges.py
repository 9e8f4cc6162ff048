"""Local cache calls at their edges: what the registered-memory cap counts for a device cache, tensors a
cache cannot live in, and keys on a v1 DECODER.

In-process, one endpoint each (no peer): the device side is the host implementation of the device backend
(``aio.DeviceType = host``).
"""

from __future__ import annotations

import mmap
import warnings

import numpy as np
import pytest
import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aio_datadist.testing import runtime_of

S = LLMStatusCode
pytestmark = pytest.mark.asyncio


async def test_the_cap_counts_what_a_device_cache_maps() -> None:
    """A device cache is one allocation (a page-sized sealed memfd on the host backend, a VMM allocation of the
    driver's granularity on CUDA): 16 one-byte tensors count a page, not 16 bytes. Before, 64 such caches
    passed a 64 KiB cap while mapping 256 KiB and holding 64 fds."""
    cap = 64 * 1024
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init({"aio.DeviceType": "host", "aio.RegisteredMemoryCap": str(cap)})
        tiny = CacheDesc(16, (1,), DataType.DT_INT8, Placement.DEVICE)
        made = []
        with pytest.raises(LLMException) as refused:
            for _ in range(64):
                made.append(dd.kv_cache_manager.allocate_cache(tiny))
        assert refused.value.status_code == S.LLM_OUT_OF_MEMORY
        mapped = sum(c.device_export.nbytes for c in made)
        assert mapped <= cap and runtime_of(dd).registry.used_bytes == mapped


def _read_only_tensors() -> list[torch.Tensor]:
    """Two tensors over an anonymous read-only mapping (freed with them)."""
    rows = np.frombuffer(mmap.mmap(-1, 2 * 8 * 4096, prot=mmap.PROT_READ), dtype=np.int8).reshape(2, 8, 4096)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "The given NumPy array is not writable"
        return [torch.from_numpy(rows[i]) for i in range(2)]


async def test_a_tensor_over_read_only_memory_is_refused() -> None:
    """Our copies into a cache write its memory on a copy thread: a registered tensor over a read-only mapping
    (a read-only ``mmap`` or ``np.memmap``) would kill the process at the first copy into it. Before, only raw
    int addresses were checked against the process's writable mappings."""
    tensors = _read_only_tensors()
    async with LLMDataDist(LLMRole.MIX, 1) as dd:
        await dd.init({})
        desc = CacheDesc(2, (8, 4096), DataType.DT_INT8, Placement.HOST)
        for register in (dd.kv_cache_manager.register_blocks_cache, dd.kv_cache_manager.register_cache):
            with pytest.raises(LLMException) as refused:
                register(desc, tensors)
            assert refused.value.status_code == S.LLM_PARAM_INVALID
            assert "'tensors_or_addrs'" in str(refused.value) and "write" in str(refused.value)
        assert runtime_of(dd).registry.used_bytes == 0


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support", "ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("layout", ["sparse_csr", "mkldnn", "nested"])
async def test_a_tensor_that_is_not_dense_is_a_bad_parameter(layout: str) -> None:
    """Before, torch's own ``RuntimeError`` (no ``is_contiguous`` for sparse CSR, no data pointer for MKL-DNN,
    no sizes for a nested tensor, whose layout says strided: found by review) reached the caller."""
    if layout == "mkldnn" and not torch.backends.mkldnn.is_available():
        pytest.skip("no MKL-DNN in this torch")
    dense = torch.zeros(8, 16)
    odd = {"sparse_csr": dense.to_sparse_csr, "mkldnn": dense.to_mkldnn,
           "nested": lambda: torch.nested.nested_tensor([torch.zeros(16)] * 8)}[layout]()
    async with LLMDataDist(LLMRole.MIX, 1) as dd:
        await dd.init({})
        desc = CacheDesc(1, (8, 16), DataType.DT_FLOAT, Placement.HOST)
        for register in (dd.kv_cache_manager.register_blocks_cache, dd.kv_cache_manager.register_cache):
            with pytest.raises(LLMException) as refused:
                register(desc, [odd])
            assert refused.value.status_code == S.LLM_PARAM_INVALID and "'tensors_or_addrs'" in str(refused.value)


async def test_a_v1_decoder_allocates_no_keyed_cache() -> None:
    """Reference 2.4: cache keys are for PROMPT (else ``ValueError``). A DECODER's would pin its cache until
    finalize: ``deallocate_cache`` leaves a keyed cache to its keys, ``remove_cache_key`` is a PROMPT's call,
    and no peer pulls from a v1 DECODER. A blocks key, which a prompt's push names, goes with its cache."""
    async with LLMDataDist(LLMRole.DECODER, 1) as dd:
        await dd.init({})
        kv = dd.kv_cache_manager
        desc = CacheDesc(2, (4, 4096), DataType.DT_INT8, Placement.HOST)
        with pytest.raises(ValueError) as refused:
            kv.allocate_cache(desc, [CacheKey(7, req_id=1)])
        assert refused.value.status_code == S.LLM_PARAM_INVALID and "'cache_keys'" in str(refused.value)
        assert runtime_of(dd).registry.used_bytes == 0
        for cache in (kv.allocate_cache(desc, [CacheKey(7, req_id=2**64 - 1)]),  # placeholders bind nothing
                      kv.allocate_blocks_cache(desc, BlocksCacheKey(7, 0))):  # a push target; freed with its cache
            kv.deallocate_cache(cache)
            assert not cache.alive
        assert runtime_of(dd).registry.used_bytes == 0
