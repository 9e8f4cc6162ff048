"""Local copies (copy_blocks, swap_blocks, copy_cache): byte-exact against torch; cancel and timeout."""

from __future__ import annotations

import asyncio
import time

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_datadist import (
    CacheDesc,
    DataType,
    KvCache,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aio_datadist.testing import engine_state

S = LLMStatusCode
MIB = 1 << 20
DTYPES = [DataType.DT_FLOAT16, DataType.DT_BF16, DataType.DT_FLOAT, DataType.DT_DOUBLE,
          DataType.DT_INT8, DataType.DT_INT64, DataType.DT_BOOL]
ROW_SHAPES = [(1,), (3,), (16, 8), (2, 3, 5), (4, 8, 32)]


def one_copy_thread() -> dict[str, str]:
    cfg = LLMConfig()
    cfg.copy_threads = 1
    return cfg.generate_options()


def fill_random(tensors: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        raw = t.view(torch.uint8).reshape(-1)
        raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=gen))


def rows(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, one row per block / batch row (bit-exact compares, NaNs included)."""
    return t.view(torch.uint8).reshape(t.shape[0], -1)


def snapshot(cache: KvCache) -> list[torch.Tensor]:
    return [rows(t).clone() for t in cache.tensors]


def assert_idle(dd: LLMDataDist) -> None:
    assert engine_state(dd)["pending tokens"] == 0
    assert engine_state(dd)["copy jobs"] == 0


# ---- byte-exact copies (hypothesis) -------------------------------------------------


@st.composite
def block_patterns(draw, num_blocks: int) -> dict[int, list[int]]:
    """``{src: [dst, ...]}`` with unique destinations that are never sources; often runs."""
    if draw(st.booleans()):
        count = draw(st.integers(1, num_blocks // 2))
        dst0 = draw(st.integers(0, num_blocks - count))
        dsts = list(range(dst0, dst0 + count))
        free = [b for b in range(num_blocks) if b not in dsts]
        start = draw(st.integers(0, len(free) - count))
        srcs = free[start:start + count]  # a run too, unless it jumps over the destinations
    else:
        dsts = draw(st.lists(st.integers(0, num_blocks - 1), unique=True, min_size=1, max_size=num_blocks - 1))
        free = [b for b in range(num_blocks) if b not in dsts]
        srcs = draw(st.lists(st.sampled_from(free), min_size=len(dsts), max_size=len(dsts)))
    info: dict[int, list[int]] = {}
    for s, d in zip(srcs, dsts):
        info.setdefault(s, []).append(d)
    return info


@st.composite
def copy_blocks_cases(draw):
    num_blocks = draw(st.integers(2, 24))
    desc = CacheDesc(draw(st.integers(1, 4)), (num_blocks, *draw(st.sampled_from(ROW_SHAPES))),
                     draw(st.sampled_from(DTYPES)), draw(st.sampled_from([Placement.HOST, Placement.DEVICE])))
    return desc, draw(block_patterns(num_blocks))


@pytest.mark.asyncio
@settings(max_examples=25, deadline=None)
@given(case=copy_blocks_cases(), seed=st.integers(0, 2**31))
async def test_copy_blocks_matches_torch(case, seed):
    desc, info = case
    async with LLMDataDist(LLMRole.DECODER, 2) as dd:
        await dd.init(LLMConfig().generate_options())
        kv = dd.kv_cache_manager
        cache = kv.allocate_blocks_cache(desc)
        fill_random(cache.tensors, seed)
        before = snapshot(cache)
        srcs = [s for s, ds in info.items() for _ in ds]
        dsts = [d for ds in info.values() for d in ds]
        await kv.copy_blocks(cache, info)
        for got, old in zip(cache.tensors, before):
            want = old.clone()
            want[dsts] = old[srcs]
            assert torch.equal(rows(got), want)
        assert_idle(dd)


@st.composite
def swap_cases(draw):
    row_shape = draw(st.sampled_from(ROW_SHAPES))
    dtype = draw(st.sampled_from(DTYPES))
    num_tensors = draw(st.integers(1, 3))
    src_blocks, dst_blocks = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    dsts = draw(st.lists(st.integers(0, dst_blocks - 1), unique=True, min_size=1, max_size=dst_blocks))
    srcs = draw(st.lists(st.integers(0, src_blocks - 1), unique=True, min_size=len(dsts), max_size=len(dsts))
                if len(dsts) <= src_blocks else st.nothing())
    swap_out = draw(st.booleans())
    src_place, dst_place = (Placement.DEVICE, Placement.HOST) if swap_out else (Placement.HOST, Placement.DEVICE)
    src_desc = CacheDesc(num_tensors, (src_blocks, *row_shape), dtype, src_place)
    dst_desc = CacheDesc(num_tensors, (dst_blocks, *row_shape), dtype, dst_place)
    return src_desc, dst_desc, dict(zip(srcs, dsts)), draw(st.booleans())


@pytest.mark.asyncio
@settings(max_examples=25, deadline=None)
@given(case=swap_cases(), seed=st.integers(0, 2**31))
async def test_swap_blocks_matches_torch(case, seed):
    src_desc, dst_desc, src_to_dst, host_is_cpu_cache = case
    async with LLMDataDist(LLMRole.DECODER, 2) as dd:
        await dd.init(LLMConfig().generate_options())
        kv = dd.kv_cache_manager
        caller_memory: list[torch.Tensor] = []

        def make(desc: CacheDesc) -> KvCache:
            if desc.placement == Placement.HOST and host_is_cpu_cache:
                caller_memory.extend(torch.empty(desc.shape, dtype=desc.data_type.torch_dtype)
                                     for _ in range(desc.num_tensors))
                return KvCache.create_cpu_cache(desc, [t.data_ptr() for t in caller_memory])
            return kv.allocate_blocks_cache(desc)

        src, dst = make(src_desc), make(dst_desc)
        fill_random(src.tensors + dst.tensors, seed)
        src_before, dst_before = snapshot(src), snapshot(dst)
        await kv.swap_blocks(src, dst, src_to_dst)
        for got, old_dst, old_src in zip(dst.tensors, dst_before, src_before):
            want = old_dst.clone()
            want[list(src_to_dst.values())] = old_src[list(src_to_dst)]
            assert torch.equal(rows(got), want)
        assert all(torch.equal(rows(t), old) for t, old in zip(src.tensors, src_before))
        assert_idle(dd)


@st.composite
def copy_cache_cases(draw):
    row_shape = draw(st.sampled_from(ROW_SHAPES))
    dtype = draw(st.sampled_from(DTYPES))
    num_tensors = draw(st.integers(1, 3))
    dst_rows = draw(st.integers(1, 5))
    same_cache = draw(st.booleans()) and dst_rows > 1
    src_rows = dst_rows if same_cache else draw(st.integers(1, 5))
    dst_desc = CacheDesc(num_tensors, (dst_rows, *row_shape), dtype, Placement.DEVICE)
    src_desc = CacheDesc(num_tensors, (src_rows, *row_shape), dtype,
                         draw(st.sampled_from([Placement.HOST, Placement.DEVICE])))
    drow = draw(st.integers(0, dst_rows - 1))
    srow = draw(st.integers(0, src_rows - 1).filter(lambda r: not same_cache or r != drow))
    row_bytes = dst_desc.size // dst_rows
    offset = draw(st.integers(0, row_bytes - 1))
    size = draw(st.one_of(st.just(-1), st.integers(1, row_bytes - offset)))
    return dst_desc, src_desc, same_cache, drow, srow, offset, size


@pytest.mark.asyncio
@settings(max_examples=25, deadline=None)
@given(case=copy_cache_cases(), seed=st.integers(0, 2**31))
async def test_copy_cache_matches_torch(case, seed):
    dst_desc, src_desc, same_cache, drow, srow, offset, size = case
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(LLMConfig().generate_options())
        kv = dd.kv_cache_manager
        dst = kv.allocate_cache(dst_desc)
        src = dst if same_cache else kv.allocate_cache(src_desc)
        fill_random(dst.tensors if same_cache else dst.tensors + src.tensors, seed)
        dst_before, src_before = snapshot(dst), snapshot(src)
        await kv.copy_cache(dst, src, dst_batch_index=drow, src_batch_index=srow, offset=offset, size=size)
        end = None if size == -1 else offset + size
        for got, old_dst, old_src in zip(dst.tensors, dst_before, src_before):
            want = old_dst.clone()
            want[drow, offset:end] = old_src[srow, offset:end]
            assert torch.equal(rows(got), want)
        assert_idle(dd)


# ---- larger and concurrent copies ------------------------------------------------------


@pytest.mark.asyncio
async def test_large_copy_blocks_is_split_across_threads():
    cfg = LLMConfig()
    cfg.copy_threads = 3
    desc = CacheDesc(2, (24, 512, 1024), DataType.DT_FLOAT16, Placement.HOST)  # 1 MiB blocks
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(cfg.generate_options())
        kv = dd.kv_cache_manager
        cache = kv.allocate_blocks_cache(desc)
        fill_random(cache.tensors, 5)
        before = snapshot(cache)
        info = {0: [12, 20], 1: [13], 2: [14], 3: [15], 4: [16], 5: [23], 6: [17]}
        await kv.copy_blocks(cache, info)
        srcs = [s for s, ds in info.items() for _ in ds]
        dsts = [d for ds in info.values() for d in ds]
        for got, old in zip(cache.tensors, before):
            want = old.clone()
            want[dsts] = old[srcs]
            assert torch.equal(rows(got), want)
        assert_idle(dd)


@pytest.mark.asyncio
async def test_concurrent_copies_on_many_caches():
    desc = CacheDesc(4, (32, 16, 64), DataType.DT_BF16, Placement.DEVICE)
    async with LLMDataDist(LLMRole.MIX, 3) as dd:
        await dd.init(LLMConfig().generate_options())
        kv = dd.kv_cache_manager
        caches = [kv.allocate_blocks_cache(desc) for _ in range(8)]
        for i, cache in enumerate(caches):
            fill_random(cache.tensors, i)
        befores = [snapshot(c) for c in caches]
        infos = [{i: [16 + i, 31 - i], 8 + i: [20]} if i != 4 else {4: [0]} for i in range(8)]
        await asyncio.gather(*(kv.copy_blocks(c, info) for c, info in zip(caches, infos)))
        for cache, before, info in zip(caches, befores, infos):
            srcs = [s for s, ds in info.items() for _ in ds]
            dsts = [d for ds in info.values() for d in ds]
            for got, old in zip(cache.tensors, before):
                want = old.clone()
                want[dsts] = old[srcs]
                assert torch.equal(rows(got), want)
        assert_idle(dd)


# ---- cancel and timeout ---------------------------------------------------------------


class Queued:
    """Four 256 MiB copies on the only copy thread, and a small cache whose copies queue behind them."""

    BIG = CacheDesc(1, (2, 256 * MIB), DataType.DT_INT8, Placement.HOST)
    SMALL = CacheDesc(2, (8, 4, 64), DataType.DT_FLOAT16, Placement.HOST)

    def __init__(self, dd: LLMDataDist) -> None:
        self.kv = dd.kv_cache_manager
        self.big = self.kv.allocate_blocks_cache(self.BIG)
        self.small = self.kv.allocate_blocks_cache(self.SMALL)
        fill_random(self.small.tensors, 9)
        self.before = snapshot(self.small)
        self.blocker: asyncio.Future | None = None

    async def start_blocker(self) -> None:
        self.blocker = asyncio.gather(*(self.kv.copy_blocks(self.big, {0: [1]}, timeout=30_000) for _ in range(4)),
                                      return_exceptions=True)
        await asyncio.sleep(0)  # let the tasks submit their copies first

    async def blocker_outcomes(self) -> list[BaseException | None]:
        """Each big copy's error (None: it ran to its end), in the order they were queued."""
        assert self.blocker is not None
        return [r if isinstance(r, BaseException) else None for r in await self.blocker]

    async def finish_blocker(self) -> None:
        for error in await self.blocker_outcomes():
            if error is not None:
                raise error

    def small_untouched(self) -> bool:
        return all(torch.equal(rows(t), old) for t, old in zip(self.small.tensors, self.before))

    async def copy_small_and_check(self) -> None:
        """Another copy on the same engine succeeds, byte-exact."""
        await self.kv.copy_blocks(self.small, {0: [5], 1: [6]})
        for got, old in zip(self.small.tensors, self.before):
            assert torch.equal(rows(got)[[5, 6]], old[[0, 1]])


@pytest.mark.asyncio
async def test_timeout_of_a_queued_copy_then_another_copy_succeeds():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(one_copy_thread())
        q = Queued(dd)
        await q.start_blocker()
        start = time.monotonic()
        with pytest.raises(LLMException, match="copy_blocks timed out after 1 ms") as info:
            await q.kv.copy_blocks(q.small, {0: [3]}, timeout=1)
        assert time.monotonic() - start < 0.001 + 1.0
        assert info.value.status_code is S.LLM_TIMEOUT
        await q.finish_blocker()
        assert q.small_untouched(), "a timed-out queued copy wrote its destination"
        await q.copy_small_and_check()
        assert_idle(dd)


@pytest.mark.asyncio
async def test_sync_kv_timeout_is_the_default_copy_timeout():
    cfg = LLMConfig()
    cfg.copy_threads = 1
    cfg.sync_kv_timeout = 20
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(cfg.generate_options())
        q = Queued(dd)
        await q.start_blocker()
        start = time.monotonic()
        with pytest.raises(LLMException, match="timed out after 20 ms") as info:
            await q.kv.copy_blocks(q.small, {0: [3]})
        assert time.monotonic() - start < 0.02 + 1.0
        assert info.value.status_code is S.LLM_TIMEOUT
        await q.finish_blocker()
        assert q.small_untouched()
        await q.copy_small_and_check()
        assert_idle(dd)


@pytest.mark.asyncio
async def test_deallocating_a_cache_keeps_its_memory_until_its_copy_ends():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(one_copy_thread())
        q = Queued(dd)
        tensors = q.small.tensors
        await q.start_blocker()
        copy = asyncio.create_task(q.kv.copy_blocks(q.small, {0: [5], 1: [6]}))
        await asyncio.sleep(0)
        q.kv.deallocate_cache(q.small)
        assert not q.small.alive
        await copy  # queued before the deallocation: it still runs, on memory that is still mapped
        for got, old in zip(tensors, q.before):
            assert torch.equal(rows(got)[[5, 6]], old[[0, 1]])
        await q.finish_blocker()
        assert_idle(dd)


@pytest.mark.asyncio
async def test_cancel_of_a_queued_copy_then_another_copy_succeeds():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(one_copy_thread())
        q = Queued(dd)
        await q.start_blocker()
        task = asyncio.create_task(q.kv.copy_blocks(q.small, {0: [3]}))
        await asyncio.sleep(0)
        start = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - start < 1.0
        await q.finish_blocker()
        assert q.small_untouched(), "a cancelled queued copy wrote its destination"
        await q.copy_small_and_check()
        assert_idle(dd)


@pytest.mark.parametrize("how", ["cancel", "timeout"])
@pytest.mark.asyncio
async def test_a_running_copy_given_up_returns_only_once_no_thread_copies_it(how):
    """A copy thread may be inside a chunk of a copy given up mid-way (it stops within 1 MiB): the call returns
    only once the engine holds no job of it any more, so no byte of it lands afterwards, and the copy stopped
    part-way (not waited for to its end). Before, the call returned at once and the running chunk went on
    writing the destination. (The bytes, and that the copy stopped part-way, were not looked at until an audit,
    2026-12-07: the test passed with the engine never told to stop the copy, the call waiting for its end.)"""
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(one_copy_thread())
        kv = dd.kv_cache_manager
        big = kv.allocate_blocks_cache(Queued.BIG)
        src, dst = big.tensors[0][0].view(torch.uint8), big.tensors[0][1].view(torch.uint8)
        src.fill_(0xAB)
        cut = []
        for _ in range(8):
            dst.zero_()
            # 5 ms: the 256 MiB copy took under 30 ms on a fast VM's memory (and the timeout never fired)
            copy = asyncio.create_task(kv.copy_blocks(big, {0: [1]}, timeout=5 if how == "timeout" else 30_000))
            async with asyncio.timeout(5):
                while not copy.done() and int(dst[0]) != 0xAB:  # until the copy thread is inside it
                    await asyncio.sleep(0)
            if how == "cancel":
                copy.cancel()
            try:
                await copy
                continue  # it ended before the cut
            except (asyncio.CancelledError, LLMException):
                pass
            assert engine_state(dd)["copy jobs"] == 0, "returned while a copy thread still copied it"
            assert int(dst[-1]) == 0, "the given-up copy ran to its end before the call returned"
            written = _written_prefix(dst, 0xAB)  # one thread copies the row front to back
            if not written:
                continue  # given up before the copy thread began it (the 5 ms timeout on a busy machine)
            await asyncio.sleep(0.3)
            assert not dst[written:written + MIB].any() and int(dst[-1]) == 0, \
                "bytes of the given-up copy landed after it returned"
            cut.append(written)
            if len(cut) == 2:
                break
        assert cut, "no copy was cut part-way"
        assert_idle(dd)


def _written_prefix(row: torch.Tensor, value: int) -> int:
    """How many bytes of ``row`` from its start hold ``value`` (the rest not yet written), by bisection."""
    lo, hi = 0, row.numel()
    while lo < hi:
        mid = (lo + hi) // 2
        if int(row[mid]) == value:
            lo = mid + 1
        else:
            hi = mid
    return lo


@pytest.mark.asyncio
async def test_asyncio_timeout_and_anyio_scopes_around_a_queued_copy():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(one_copy_thread())
        q = Queued(dd)
        await q.start_blocker()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.001):
                await q.kv.copy_blocks(q.small, {0: [3]})
        with anyio.move_on_after(0.001) as scope:
            await q.kv.copy_blocks(q.small, {1: [4]})
        assert scope.cancelled_caught
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.001):
                await q.kv.swap_blocks(q.small, q.kv.allocate_blocks_cache(
                    CacheDesc(2, (8, 4, 64), DataType.DT_FLOAT16, Placement.DEVICE)), {0: 0})
        async with anyio.create_task_group() as tg:
            tg.start_soon(q.kv.copy_blocks, q.small, {2: [7]})
            await anyio.sleep(0)
            tg.cancel_scope.cancel()
        await q.finish_blocker()
        assert q.small_untouched()
        await q.copy_small_and_check()
        assert_idle(dd)


@pytest.mark.asyncio
async def test_finalize_fails_a_queued_copy():
    """A copy still queued when ``finalize`` stops the copy thread fails ``LLM_FAILED`` and writes nothing.

    The copy waits behind four 256 MiB copies (about 70 ms on a quiet machine); on a loaded one the finalize
    may come only after they ended and the small copy ran. Whether it was still queued is read from the
    copy ahead of it: cut by the finalize, the small copy cannot have started. A run where that copy ended
    proves nothing and is made again (at most 5 times); CI once failed here with the copy run before the
    finalize came."""
    proved = 0
    for _ in range(5):
        dd = LLMDataDist(LLMRole.PROMPT, 1)
        await dd.init(one_copy_thread())
        q = Queued(dd)
        await q.start_blocker()
        queued = asyncio.create_task(q.kv.copy_blocks(q.small, {0: [3]}))
        await asyncio.sleep(0)
        await dd.finalize()
        outcomes = await q.blocker_outcomes()
        for error in outcomes:
            assert error is None or (isinstance(error, LLMException) and error.status_code is S.LLM_FAILED), error
        assert not q.big.alive and not q.small.alive
        try:
            await queued
        except LLMException as exc:
            assert exc.status_code is S.LLM_FAILED and "copy_blocks" in str(exc), exc
            assert q.small_untouched(), "a queued copy failed by finalize wrote its destination"
            proved += outcomes[-1] is not None
        else:
            assert outcomes[-1] is None, "a copy queued behind one that finalize cut ran after it"
        if proved:
            break
    assert proved, "the copies ahead always ended before the finalize: the queued copy was never cut"
