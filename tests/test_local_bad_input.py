"""Every bad input to a local operation: the documented code, the argument named, nothing written."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    KvCache,
    KvCacheManager,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aio_datadist.testing import engine_state, registry_of

S = LLMStatusCode
INVALID, NOT_EXIST = S.LLM_PARAM_INVALID, S.LLM_KV_CACHE_NOT_EXIST
U64_MAX = 2**64 - 1

BLOCKS_HOST = CacheDesc(2, (16, 4, 32), DataType.DT_FLOAT16, Placement.HOST)
BLOCKS_DEVICE = CacheDesc(2, (16, 4, 32), DataType.DT_FLOAT16, Placement.DEVICE)
CONTIG = CacheDesc(2, (3, 8, 16), DataType.DT_FLOAT, Placement.DEVICE)  # rows of 512 B
ROW_BYTES = 8 * 16 * 4


@contextmanager
def rejected(code: LLMStatusCode, arg: str) -> Iterator[None]:
    with pytest.raises(LLMException) as info:
        yield
    assert info.value.status_code is code, str(info.value)
    assert f"'{arg}'" in str(info.value), f"message does not name {arg!r}: {info.value}"


def randomize(cache: KvCache) -> None:
    for t in cache.tensors:
        raw = t.view(torch.uint8).reshape(-1)
        raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8))


def snapshot(*caches: KvCache) -> list[torch.Tensor]:
    return [t.view(torch.uint8).clone() for c in caches for t in c.tensors]


async def assert_all_rejected(cases: list[tuple[str, LLMStatusCode, Callable[[], Awaitable[Any]]]],
                              *destinations: KvCache) -> None:
    """Run each bad call; each must raise before writing one byte of ``destinations``."""
    before = snapshot(*destinations)
    for arg, code, call in cases:
        with rejected(code, arg):
            await call()
        after = snapshot(*destinations)
        assert all(torch.equal(a, b) for a, b in zip(after, before)), f"{arg}: destination written"


class Endpoint:
    """An initialised PROMPT endpoint with one cache of each kind, filled with random bytes."""

    def __init__(self, dd: LLMDataDist) -> None:
        self.dd = dd
        self.kv: KvCacheManager = dd.kv_cache_manager
        self.host = self.kv.allocate_blocks_cache(BLOCKS_HOST)
        self.device = self.kv.allocate_blocks_cache(BLOCKS_DEVICE)
        self.contig = self.kv.allocate_cache(CONTIG)
        self.contig2 = self.kv.allocate_cache(CONTIG)
        for cache in (self.host, self.device, self.contig, self.contig2):
            randomize(cache)
        self.gone = self.kv.allocate_blocks_cache(BLOCKS_DEVICE)
        self.kv.deallocate_cache(self.gone)

    @property
    def registry(self):
        return registry_of(self.dd)

    def assert_idle(self) -> None:
        assert engine_state(self.dd)["pending tokens"] == 0
        assert engine_state(self.dd)["copy jobs"] == 0


def options(**config: Any) -> dict[str, str]:
    cfg = LLMConfig()
    for name, value in config.items():
        setattr(cfg, name, value)
    return cfg.generate_options()


# ---- copies ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_copy_blocks_rejects():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd, LLMDataDist(LLMRole.PROMPT, 2) as other:
        await dd.init(options())
        await other.init(options())
        e = Endpoint(dd)
        foreign = other.kv_cache_manager.allocate_blocks_cache(BLOCKS_DEVICE)
        kv, c = e.kv, e.device

        def copy(info: Any, cache: Any = c, **kw: Any) -> Callable[[], Awaitable[None]]:
            return lambda: kv.copy_blocks(cache, info, **kw)

        await assert_all_rejected([
            ("cache", INVALID, copy({0: [1]}, cache=torch.zeros(16))),
            ("cache", INVALID, copy({0: [1]}, cache=None)),
            ("cache", INVALID, copy({0: [1]}, cache=e.contig)),
            ("cache", NOT_EXIST, copy({0: [1]}, cache=e.gone)),
            ("cache", NOT_EXIST, copy({0: [1]}, cache=foreign)),
            ("copy_block_info", INVALID, copy([(0, [1])])),
            ("copy_block_info", INVALID, copy({})),
            ("copy_block_info", INVALID, copy(None)),
            ("copy_block_info", INVALID, copy({16: [1]})),
            ("copy_block_info", INVALID, copy({-1: [1]})),
            ("copy_block_info", INVALID, copy({0: [16]})),
            ("copy_block_info", INVALID, copy({0: [1], 3: [4, 99]})),  # valid first, bad last
            ("copy_block_info", INVALID, copy({0: 1})),
            ("copy_block_info", INVALID, copy({0: []})),
            ("copy_block_info", INVALID, copy({0: [1, 1]})),
            ("copy_block_info", INVALID, copy({0: [1], 2: [1]})),
            ("copy_block_info", INVALID, copy({0: [1], 1: [2]})),
            ("copy_block_info", INVALID, copy({0: [0]})),
            ("copy_block_info", INVALID, copy({True: [1]})),
            ("copy_block_info", INVALID, copy({0: [1.0]})),
            ("copy_block_info", INVALID, copy({"0": [1]})),
            ("copy_block_info", INVALID, copy({0: "1"})),
            ("timeout", INVALID, copy({0: [1]}, timeout=0)),
            ("timeout", INVALID, copy({0: [1]}, timeout=-5)),
            ("timeout", INVALID, copy({0: [1]}, timeout="100")),
            ("timeout", INVALID, copy({0: [1]}, timeout=1.5)),
        ], e.device, e.host, e.contig)
        e.assert_idle()
        await kv.copy_blocks(c, {0: [1]})  # the manager still works
        raw = c.tensors[1].view(torch.uint8)
        assert torch.equal(raw[1], raw[0])


@pytest.mark.asyncio
async def test_swap_blocks_rejects():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(options())
        e = Endpoint(dd)
        kv = e.kv
        fewer = kv.allocate_blocks_cache(CacheDesc(1, (16, 4, 32), DataType.DT_FLOAT16, Placement.HOST))
        other_type = kv.allocate_blocks_cache(CacheDesc(2, (16, 4, 32), DataType.DT_BF16, Placement.HOST))
        other_block = kv.allocate_blocks_cache(CacheDesc(2, (16, 4, 16), DataType.DT_FLOAT16, Placement.HOST))
        host2 = kv.allocate_blocks_cache(BLOCKS_HOST)

        def swap(mapping: Any, src: Any = e.device, dst: Any = e.host, **kw: Any) -> Callable[[], Awaitable[None]]:
            return lambda: kv.swap_blocks(src, dst, mapping, **kw)

        await assert_all_rejected([
            ("src", INVALID, swap({0: 0}, src="cache")),
            ("dst", INVALID, swap({0: 0}, dst=[e.host])),
            ("src", INVALID, swap({0: 0}, src=e.contig)),
            ("dst", INVALID, swap({0: 0}, dst=e.contig)),
            ("src", NOT_EXIST, swap({0: 0}, src=e.gone)),
            ("dst", NOT_EXIST, swap({0: 0}, src=e.host, dst=e.gone)),
            ("dst", INVALID, swap({0: 0}, dst=host2, src=e.host)),          # HOST to HOST
            ("dst", INVALID, swap({0: 0}, dst=fewer)),                      # num_tensors differ
            ("dst", INVALID, swap({0: 0}, dst=other_type)),                 # data types differ
            ("dst", INVALID, swap({0: 0}, dst=other_block)),                # block sizes differ
            ("src_to_dst", INVALID, swap([(0, 0)])),
            ("src_to_dst", INVALID, swap({})),
            ("src_to_dst", INVALID, swap({16: 0})),
            ("src_to_dst", INVALID, swap({0: 16})),
            ("src_to_dst", INVALID, swap({0: -1})),
            ("src_to_dst", INVALID, swap({0: 1, 2: 1})),
            ("src_to_dst", INVALID, swap({0: 1, 2: 99})),
            ("src_to_dst", INVALID, swap({False: 1})),
            ("src_to_dst", INVALID, swap({0: [1]})),
            ("timeout", INVALID, swap({0: 0}, timeout=0)),
        ], e.host, e.device, fewer, other_type, other_block, host2)
        e.assert_idle()


@pytest.mark.asyncio
async def test_copy_cache_rejects():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(options())
        e = Endpoint(dd)
        kv = e.kv
        other_rows = kv.allocate_cache(CacheDesc(2, (3, 8, 8), DataType.DT_FLOAT, Placement.DEVICE))
        other_count = kv.allocate_cache(CacheDesc(1, (3, 8, 16), DataType.DT_FLOAT, Placement.DEVICE))
        other_type = kv.allocate_cache(CacheDesc(2, (3, 8, 16), DataType.DT_INT32, Placement.DEVICE))
        gone = kv.allocate_cache(CONTIG)
        kv.deallocate_cache(gone)

        def copy(dst: Any = e.contig, src: Any = e.contig2, **kw: Any) -> Callable[[], Awaitable[None]]:
            return lambda: kv.copy_cache(dst, src, **kw)

        await assert_all_rejected([
            ("dst", INVALID, copy(dst=object())),
            ("src", INVALID, copy(src=e.contig.tensors)),
            ("dst", INVALID, copy(dst=e.device)),
            ("src", INVALID, copy(src=e.device)),
            ("dst", NOT_EXIST, copy(dst=gone)),
            ("src", NOT_EXIST, copy(src=gone)),
            ("src", INVALID, copy(src=other_rows)),
            ("src", INVALID, copy(src=other_count)),
            ("src", INVALID, copy(src=other_type)),
            ("dst_batch_index", INVALID, copy(dst_batch_index=3)),
            ("dst_batch_index", INVALID, copy(dst_batch_index=-1)),
            ("dst_batch_index", INVALID, copy(dst_batch_index=True)),
            ("dst_batch_index", INVALID, copy(dst_batch_index=None)),
            ("src_batch_index", INVALID, copy(src_batch_index=7)),
            ("src_batch_index", INVALID, copy(src_batch_index="0")),
            ("dst_batch_index", INVALID, copy(src=e.contig, dst_batch_index=1, src_batch_index=1)),
            ("offset", INVALID, copy(offset=-1)),
            ("offset", INVALID, copy(offset=ROW_BYTES)),
            ("offset", INVALID, copy(offset=2.0)),
            ("size", INVALID, copy(size=0)),
            ("size", INVALID, copy(size=-2)),
            ("size", INVALID, copy(size=ROW_BYTES + 1)),
            ("size", INVALID, copy(offset=100, size=ROW_BYTES - 99)),
            ("size", INVALID, copy(size="all")),
            ("timeout", INVALID, copy(timeout=0)),
        ], e.contig, e.contig2, other_rows, other_count, other_type)
        e.assert_idle()


# ---- allocation and registration ----------------------------------------------------------


@pytest.mark.asyncio
async def test_allocate_rejects_bad_descs_and_keys():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(options())
        e = Endpoint(dd)
        kv = e.kv
        bound = CacheKey(1, req_id=100)
        kv.allocate_cache(CONTIG, [bound])
        kv.allocate_blocks_cache(BLOCKS_HOST, BlocksCacheKey(1, model_id=3))
        caches, used = len(e.registry), e.registry.used_bytes
        k1, k2 = CacheKey(1, req_id=1), CacheKey(1, req_id=2)
        cases = [
            ("cache_desc", lambda: kv.allocate_cache({"num_tensors": 2})),
            ("cache_desc", lambda: kv.allocate_cache(None)),
            ("cache_desc", lambda: kv.allocate_blocks_cache("desc")),
            ("cache_keys", lambda: kv.allocate_cache(CONTIG, k1)),
            ("cache_keys", lambda: kv.allocate_cache(CONTIG, {k1})),
            ("cache_keys", lambda: kv.allocate_cache(CONTIG, [k1, k2, CacheKey(1, 3), CacheKey(1, 4)])),
            ("cache_keys[1]", lambda: kv.allocate_cache(CONTIG, [k1, BlocksCacheKey(1)])),
            ("cache_keys[1]", lambda: kv.allocate_cache(CONTIG, [k1, 7])),
            ("cache_keys[2]", lambda: kv.allocate_cache(CONTIG, [k1, k2, CacheKey(5, req_id=1)])),
            ("cache_keys[1]", lambda: kv.allocate_cache(CONTIG, [k1, bound])),
            ("cache_keys[0]", lambda: kv.allocate_cache(CONTIG, [CacheKey(1, req_id=1, prefix_id=2)])),
            ("blocks_cache_key", lambda: kv.allocate_blocks_cache(BLOCKS_HOST, CacheKey(1, 1))),
            ("blocks_cache_key", lambda: kv.allocate_blocks_cache(BLOCKS_HOST, BlocksCacheKey(9, model_id=3))),
        ]
        for arg, call in cases:
            with rejected(INVALID, arg):
                call()
        assert (len(e.registry), e.registry.used_bytes) == (caches, used), "a refused cache was kept"
        # Refused calls consume no cache id and no key.
        assert kv.allocate_cache(CONTIG, [k1, CacheKey(1, req_id=U64_MAX), k2]).cache_id == 8


@pytest.mark.asyncio
async def test_more_keys_than_rows_are_refused_whatever_the_batch_dim():
    """Rows are along shape[0]; keys were counted against batch_size (shape[batch_dim_index]), so with
    batch_dim_index=1 a 3-row cache took 8 keys, 5 of them for rows that do not exist."""
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(options())
        kv = dd.kv_cache_manager
        desc = CacheDesc(2, (3, 8, 16), DataType.DT_FLOAT, Placement.DEVICE, batch_dim_index=1)
        assert desc.batch_size == 8
        keys = [CacheKey(1, req_id=i) for i in range(4)]
        memory = [torch.zeros(desc.shape) for _ in range(2)]
        for call in (lambda: kv.allocate_cache(desc, keys), lambda: kv.register_cache(desc, memory, keys)):
            with rejected(INVALID, "cache_keys"):
                call()
        assert len(registry_of(dd)) == 0 and registry_of(dd).key_count == 0, "a refused cache kept keys"
        cache = kv.allocate_cache(desc, keys[:3])
        assert registry_of(dd).key_count == 3 and cache.layout.rows == 3


@pytest.mark.asyncio
async def test_cache_keys_not_a_list_are_a_type_error():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(options())
        kv = dd.kv_cache_manager
        key = CacheKey(1, req_id=1)
        for call in (lambda: kv.allocate_cache(CONTIG, key), lambda: kv.allocate_cache(CONTIG, {key}),
                     lambda: kv.register_cache(CONTIG, [torch.zeros(3, 8, 16) for _ in range(2)], key)):
            with pytest.raises(LLMException) as info:
                call()
            assert isinstance(info.value, TypeError) and info.value.status_code is INVALID, str(info.value)
            assert "'cache_keys'" in str(info.value)
        assert len(registry_of(dd)) == 0


@pytest.mark.asyncio
async def test_registered_memory_cap_is_out_of_memory():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(options(registered_memory_cap=2 * BLOCKS_HOST.size * BLOCKS_HOST.num_tensors))
        kv = dd.kv_cache_manager
        kv.allocate_blocks_cache(BLOCKS_HOST)
        kv.allocate_blocks_cache(BLOCKS_DEVICE)
        user = [torch.zeros(BLOCKS_HOST.shape, dtype=torch.float16) for _ in range(2)]
        for call in (lambda: kv.allocate_blocks_cache(BLOCKS_HOST),
                     lambda: kv.allocate_cache(CONTIG, [CacheKey(1, req_id=5)]),
                     lambda: kv.register_blocks_cache(BLOCKS_HOST, user, BlocksCacheKey(1, 4))):
            with pytest.raises(LLMException, match="aio.RegisteredMemoryCap") as info:
                call()
            assert info.value.status_code is S.LLM_OUT_OF_MEMORY
        # The refused keys were not bound.
        assert registry_of(dd).by_blocks_key(4) is None
        assert registry_of(dd).by_key(CacheKey(1, req_id=5).lookup_key()) is None


@pytest.mark.asyncio
async def test_register_rejects_mismatched_memory():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(options())
        e = Endpoint(dd)
        kv = e.kv
        caches = len(e.registry)
        good = [torch.zeros(CONTIG.shape) for _ in range(2)]
        shared = torch.zeros(CONTIG.shape)
        big = torch.zeros(2, *CONTIG.shape)
        wide = torch.zeros(CONTIG.shape[0], CONTIG.shape[2], CONTIG.shape[1]).transpose(1, 2)
        cases = [
            ("tensors_or_addrs", lambda: kv.register_cache(CONTIG, good[0])),
            ("tensors_or_addrs", lambda: kv.register_cache(CONTIG, good[:1])),
            ("tensors_or_addrs", lambda: kv.register_cache(CONTIG, good + [torch.zeros(CONTIG.shape)])),
            ("tensors_or_addrs", lambda: kv.register_cache(CONTIG, [good[0], good[1].double()])),
            ("tensors_or_addrs", lambda: kv.register_cache(CONTIG, [good[0], good[1].reshape(3, 128)])),
            ("tensors_or_addrs", lambda: kv.register_cache(CONTIG, [good[0], wide])),
            ("tensors_or_addrs", lambda: kv.register_cache(CONTIG, [shared, shared])),
            ("tensors_or_addrs", lambda: kv.register_cache(CONTIG, [big[0], big[0][1:].reshape(-1)[:0]])),
            ("tensors_or_addrs", lambda: kv.register_cache(CONTIG, [good[0], "tensor"])),
            ("tensors_or_addrs", lambda: kv.register_cache(CONTIG, [good[0].data_ptr(), 0])),
            ("tensors_or_addrs", lambda: kv.register_cache(CONTIG, [good[0].data_ptr(), -4096])),
            ("tensors_or_addrs", lambda: kv.register_cache(CONTIG, [good[0].data_ptr(), good[0].data_ptr() + 64])),
            ("tensors_or_addrs", lambda: kv.register_blocks_cache(BLOCKS_HOST, [good[0].data_ptr(), True])),
            ("cache_desc", lambda: kv.register_cache([2, (3, 8, 16)], good)),
            ("cache_keys", lambda: kv.register_cache(CONTIG, good, CacheKey(1, 1))),
            ("blocks_cache_key", lambda: kv.register_blocks_cache(
                BLOCKS_HOST, [torch.zeros(BLOCKS_HOST.shape, dtype=torch.float16) for _ in range(2)], 3)),
        ]
        for arg, call in cases:
            with rejected(INVALID, arg):
                call()
        assert len(e.registry) == caches


@pytest.mark.asyncio
async def test_register_says_a_list_mixes_addresses_and_tensors():
    """Before, ``[addr, tensor]`` was refused with "entry 0 must be a torch.Tensor or an int address, got int"."""
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(options())
        kv = dd.kv_cache_manager
        good = [torch.zeros(CONTIG.shape) for _ in range(2)]
        mixed = "mixes int addresses and tensors"
        not_either = "entry 1 must be a torch.Tensor or an int address, got str"
        for entries, why in [([good[0].data_ptr(), good[1]], mixed), ([good[0], good[1].data_ptr()], mixed),
                             ([good[0].data_ptr(), "tensor"], not_either)]:
            with pytest.raises(LLMException, match=why) as info:
                kv.register_cache(CONTIG, entries)
            assert info.value.status_code is INVALID and "'tensors_or_addrs'" in str(info.value)
            assert isinstance(info.value, TypeError)  # as before
        assert registry_of(dd).all_caches() == []


@pytest.mark.asyncio
async def test_register_rejects_memory_that_is_already_registered():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(options())
        e = Endpoint(dd)
        kv = e.kv
        memory = [torch.zeros(CONTIG.shape) for _ in range(2)]
        registered = kv.register_cache(CONTIG, memory)
        keyed = kv.allocate_cache(CONTIG, [CacheKey(1, req_id=1)])
        kv.deallocate_cache(keyed)  # still registered: a key refers to it
        caches, used = len(e.registry), e.registry.used_bytes
        tail = memory[1].view(-1)[-1:]  # the last element of a registered tensor
        fresh = torch.zeros(CONTIG.shape)
        cases = [
            lambda: kv.register_cache(CONTIG, memory),
            lambda: kv.register_cache(CONTIG, [fresh, memory[1]]),
            lambda: kv.register_cache(CONTIG, [fresh.data_ptr(), tail.data_ptr()]),
            lambda: kv.register_blocks_cache(BLOCKS_HOST, [e.host.tensor_addrs[1], e.host.tensor_addrs[0] + 2]),
            lambda: kv.register_cache(CONTIG, [fresh, keyed.tensors[0]]),
        ]
        for call in cases:
            with rejected(INVALID, "tensors_or_addrs"):
                call()
        assert (len(e.registry), e.registry.used_bytes) == (caches, used)
        kv.deallocate_cache(registered)
        assert kv.register_cache(CONTIG, memory).alive  # free to register again


# ---- keys, deallocation, tensors -----------------------------------------------------------


@pytest.mark.asyncio
async def test_deallocate_twice_is_a_no_op_and_foreign_caches_do_not_exist():
    """Reference §2.4 ``deallocate_cache``: "No-op if already freed" (C++ ``Deallocate`` of an id it no
    longer holds succeeds); a cache of another LLMDataDist is still refused (``LLM_KV_CACHE_NOT_EXIST``), and a
    CPU cache too, as LLM-DataDist's "only support device cache" (``LLM_PARAM_INVALID``)."""
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd, LLMDataDist(LLMRole.PROMPT, 2) as other:
        await dd.init(options())
        await other.init(options())
        e = Endpoint(dd)
        kv = e.kv
        foreign = other.kv_cache_manager.allocate_blocks_cache(BLOCKS_HOST)
        keyed = kv.allocate_cache(CONTIG, [CacheKey(1, req_id=1)])
        kv.deallocate_cache(keyed)  # still kept by its key
        user = [torch.zeros(BLOCKS_HOST.shape, dtype=torch.float16) for _ in range(2)]
        cpu = KvCache.create_cpu_cache(BLOCKS_HOST, [t.data_ptr() for t in user])
        used = e.registry.used_bytes
        for cache in (e.gone, keyed):
            kv.deallocate_cache(cache)  # again: nothing changes
        with rejected(NOT_EXIST, "cache"):
            kv.deallocate_cache(foreign)
        for bad in (cpu, None, 1, e.host.tensors):
            with rejected(INVALID, "cache"):
                kv.deallocate_cache(bad)
        assert e.registry.used_bytes == used
        assert foreign.alive and keyed.alive


@pytest.mark.asyncio
async def test_remove_cache_key_rejects_wrong_types_and_roles():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd, LLMDataDist(LLMRole.DECODER, 2) as decoder:
        await dd.init(options())
        await decoder.init(options())
        kv = dd.kv_cache_manager
        for bad in (BlocksCacheKey(1), None, (1, 2)):
            with rejected(INVALID, "cache_key"):
                kv.remove_cache_key(bad)
        key = CacheKey(1, req_id=1)
        with rejected(INVALID, "cache_keys"):  # keys are a PROMPT's (reference 2.4)
            decoder.kv_cache_manager.allocate_cache(CONTIG, [key])
        cache = kv.allocate_cache(CONTIG, [key])
        with rejected(INVALID, "role"):
            decoder.kv_cache_manager.remove_cache_key(key)
        assert registry_of(dd).by_key(key.lookup_key()) == (cache, 0)


@pytest.mark.asyncio
async def test_get_cache_tensors_rejects():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(options())
        e = Endpoint(dd)
        kv = e.kv
        for bad in (2, -1, True, 1.0, "0", None):
            with rejected(INVALID, "tensor_index"):
                kv.get_cache_tensors(e.host, bad)
        with rejected(INVALID, "cache"):
            kv.get_cache_tensors(e.host.tensors[0])
        with rejected(NOT_EXIST, "cache"):
            kv.get_cache_tensors(e.gone)


def test_create_cpu_cache_rejects():
    memory = [torch.zeros(BLOCKS_HOST.shape, dtype=torch.float16) for _ in range(2)]
    addrs = [t.data_ptr() for t in memory]
    cases = [
        ("cache_desc", lambda: KvCache.create_cpu_cache(BLOCKS_DEVICE, addrs)),
        ("cache_desc", lambda: KvCache.create_cpu_cache("desc", addrs)),
        ("addrs", lambda: KvCache.create_cpu_cache(BLOCKS_HOST, addrs[:1])),
        ("addrs", lambda: KvCache.create_cpu_cache(BLOCKS_HOST, addrs + addrs)),
        ("addrs", lambda: KvCache.create_cpu_cache(BLOCKS_HOST, [addrs, addrs])),
        ("addrs", lambda: KvCache.create_cpu_cache(BLOCKS_HOST, [addrs[0], 0])),
        ("addrs", lambda: KvCache.create_cpu_cache(BLOCKS_HOST, [addrs[0], -1])),
        ("addrs", lambda: KvCache.create_cpu_cache(BLOCKS_HOST, [addrs[0], True])),
        ("addrs", lambda: KvCache.create_cpu_cache(BLOCKS_HOST, [addrs[0], 2**64])),
        ("addrs", lambda: KvCache.create_cpu_cache(BLOCKS_HOST, addrs[0])),
        ("addrs", lambda: KvCache.create_cpu_cache(BLOCKS_HOST, [addrs[0], float(addrs[1])])),
    ]
    for arg, call in cases:
        with rejected(INVALID, arg):
            call()


class _Lopsided(dict):
    """A Mapping whose keys and values disagree in count (a buggy caller's mapping)."""

    def values(self):  # type: ignore[override]
        return list(super().values())[:1]


@pytest.mark.asyncio
@pytest.mark.parametrize("device_type", ["cpu", "host"])
async def test_swap_blocks_pairs_a_mapping_whose_keys_and_values_differ_by_its_items(device_type):
    """A Mapping whose values() disagree with its keys: its items() are copied (read once, so sources and
    destinations pair up). Before, a ValueError from the core (host caches) or an LLM_FAILED naming no argument
    (device caches). Found by a hunt."""
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init({**options(), "aio.DeviceType": device_type})
        e = Endpoint(dd)
        await e.kv.swap_blocks(e.device, e.host, _Lopsided({0: 1, 2: 3}))
        for d, h in zip(e.device.tensors, e.host.tensors):
            d, h = d.view(torch.uint8), h.view(torch.uint8)  # bit-exact (random halves hold NaNs)
            assert torch.equal(h[1], d[0]) and torch.equal(h[3], d[2])
        e.assert_idle()


@pytest.mark.asyncio
async def test_copy_blocks_huge_and_bool_blocks_are_refused():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(options())
        e = Endpoint(dd)
        await assert_all_rejected([
            ("copy_block_info", INVALID, lambda: e.kv.copy_blocks(e.host, {2**64: [1]})),
            ("copy_block_info", INVALID, lambda: e.kv.copy_blocks(e.host, {0: [2**64]})),
            ("copy_block_info", INVALID, lambda: e.kv.copy_blocks(e.host, {0: [True]})),
            ("copy_block_info", INVALID, lambda: e.kv.copy_blocks(e.host, {0: (1, 1)})),
            ("copy_block_info", INVALID, lambda: e.kv.copy_blocks(e.host, {0: [1], 1: [2]})),
            ("copy_block_info", INVALID, lambda: e.kv.copy_blocks(e.device, {0: [1], 1: [2]})),
            ("size", INVALID, lambda: e.kv.copy_cache(e.contig, e.contig2, size=2**80)),
            ("offset", INVALID, lambda: e.kv.copy_cache(e.contig, e.contig2, offset=True)),
            ("size", INVALID, lambda: e.kv.copy_cache(e.contig, e.contig2, offset=8, size=ROW_BYTES - 7)),
            ("dst_batch_index", INVALID, lambda: e.kv.copy_cache(e.contig, e.contig, 1, 1)),
        ], e.host, e.device, e.contig, e.contig2)
        e.assert_idle()
