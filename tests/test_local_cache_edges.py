"""Local cache calls at their edges: what the registered-memory cap counts for a device cache, tensors a
cache cannot live in, and keys on a v1 DECODER.

In-process, one endpoint each (no peer): the device side is the host implementation of the device backend
(``aio.DeviceType = host``).
"""

from __future__ import annotations

import ctypes
import mmap
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from _v2peer import v2_options

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


@pytest.mark.parametrize("desc", [CacheDesc(1, (1,), DataType.DT_INT8, Placement.DEVICE),
                                  CacheDesc(3, (2, 500), DataType.DT_INT8, Placement.DEVICE),
                                  CacheDesc(5, (1024,), DataType.DT_INT8, Placement.DEVICE)],
                         ids=["one_byte", "3k", "5k"])
async def test_the_cap_counts_whole_pages_for_a_device_cache_short_of_a_page(desc: CacheDesc) -> None:
    """Tensors that, 256 bytes apart, fill less than a page still map a whole page (the sealed memfd): counted so.
    The test above fills exactly a page (16 x 256 bytes), and passed with the page rounding taken out (audit).
    5 KiB maps two pages: the "3k" case passed with only the one-page floor kept (audit)."""
    cap = 64 * 1024
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init({"aio.DeviceType": "host", "aio.RegisteredMemoryCap": str(cap)})
        made = []
        with pytest.raises(LLMException) as refused:
            for _ in range(64):
                made.append(dd.kv_cache_manager.allocate_cache(desc))
        assert refused.value.status_code == S.LLM_OUT_OF_MEMORY
        mapped = sum(c.device_export.nbytes for c in made)
        assert mapped == 16 * 4096 and runtime_of(dd).registry.used_bytes == mapped


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


def _partly_read_only(keep: list[Any]) -> Iterator[tuple[str, list[torch.Tensor]]]:
    """``(case, two tensors of 2 pages)``, each case with one tensor, or one page of each, this process may not
    write; what the tensors' memory hangs on goes to ``keep``."""
    page = mmap.PAGESIZE
    shape = (2, page)
    read_only = mmap.mmap(-1, 2 * page, prot=mmap.PROT_READ)
    keep.append(read_only)
    yield "second tensor read-only", [_tensor(np.zeros(shape, dtype=np.int8)),
                                      _tensor(np.frombuffer(read_only, dtype=np.int8).reshape(shape))]
    pages = mmap.mmap(-1, 4 * page)
    keep.append(pages)
    flat = np.frombuffer(pages, dtype=np.int8)
    for k in (1, 3):  # each tensor's second page
        assert _libc.mprotect(flat.ctypes.data + k * page, page, mmap.PROT_READ) == 0
    yield "second page read-only", [_tensor(flat[:2 * page].reshape(shape)), _tensor(flat[2 * page:].reshape(shape))]
    backing = tempfile.NamedTemporaryFile()
    keep.append(backing)
    backing.write(b"\0" * 4 * page)
    backing.flush()
    mapped = np.memmap(backing.name, dtype=np.int8, mode="r", shape=(4 * page,))
    keep.append(mapped)
    yield "np.memmap mode r", [_tensor(mapped[:2 * page].reshape(shape)), _tensor(mapped[2 * page:].reshape(shape))]


def _tensor(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "The given NumPy array is not writable"
        return torch.from_numpy(array)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


@pytest.mark.parametrize("mode", ["v1", "v2"])
async def test_every_tensor_and_every_page_of_each_is_checked_for_write_access(mode: str) -> None:
    """As above, with only the second tensor read-only, or only each tensor's second page, or a read-only
    ``np.memmap`` of a file; both managers. The test above passed with only the first tensor, or each tensor's
    first byte, checked (audit, 2026-12-07)."""
    keep: list[Any] = []
    desc = CacheDesc(2, (2, mmap.PAGESIZE), DataType.DT_INT8, Placement.HOST)
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(v2_options() if mode == "v2" else {})
        manager: Any = dd.cache_manager if mode == "v2" else dd.kv_cache_manager
        arg = "'addrs'" if mode == "v2" else "'tensors_or_addrs'"
        for case, tensors in _partly_read_only(keep):
            for register in (manager.register_blocks_cache, manager.register_cache):
                with pytest.raises(LLMException) as refused:
                    register(desc, tensors)
                assert refused.value.status_code == S.LLM_PARAM_INVALID, case
                assert arg in str(refused.value), (case, str(refused.value))
        assert runtime_of(dd).registry.used_bytes == 0


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support", "ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("layout", ["sparse_csr", "sparse_csc", "mkldnn", "nested"])
async def test_a_tensor_that_is_not_dense_is_a_bad_parameter(layout: str) -> None:
    """Before, torch's own ``RuntimeError`` (no ``is_contiguous`` for sparse CSR, no data pointer for MKL-DNN,
    no sizes for a nested tensor, whose layout says strided: found by review) reached the caller. Sparse CSC:
    every non-strided layout is refused, not only those named here (audit)."""
    if layout == "mkldnn" and not torch.backends.mkldnn.is_available():
        pytest.skip("no MKL-DNN in this torch")
    dense = torch.zeros(8, 16)
    odd = {"sparse_csr": dense.to_sparse_csr, "sparse_csc": dense.to_sparse_csc, "mkldnn": dense.to_mkldnn,
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
