"""The staging pipeline's planner, bounded pool and pipelines, on host memory.

Device caches stage through page-locked chunk buffers (``devices/staging.py``).
Nothing here needs the device: the planner is arithmetic, and the pipelines
take their stages as coroutines. These tests run them with real host stages
(HostCopyEngine gathers and scatters of a host cache through the chunk
buffers, the same ``host_chunk_triples`` the staged swap uses), so the byte
order, the overlap, the memory bound and the cleanup after failures and
cancellations are checked for real. The device stages are checked in
``tests/gpu/``.
"""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_datadist import CacheDesc, DataType, KvCache, LLMException, LLMStatusCode, Placement, _core
from aio_datadist._completion import Completions
from aio_datadist.devices.staging import (
    MIN_CHUNK_BYTES,
    Chunk,
    StagingPool,
    host_chunk_triples,
    pipeline_in,
    pipeline_out,
    plan_chunks,
)

# ---- planner ----------------------------------------------------------------------------------


def _expanded(chunks: list[Chunk], rows: int, nbytes: int) -> list[tuple[int, int]]:
    """The stream byte ranges the chunks cover, in order, merged where adjacent."""
    out: list[tuple[int, int]] = []
    for chunk in chunks:
        for rect in chunk.rects:
            for t in range(rect.t0, rect.t0 + rect.tensors):
                for r in range(rect.r0, rect.r1):
                    start = (t * rows + r) * nbytes + rect.offset
                    if out and out[-1][1] == start:
                        out[-1] = (out[-1][0], start + rect.length)
                    else:
                        out.append((start, start + rect.length))
    return out


@settings(max_examples=300, deadline=None)
@given(tensors=st.integers(0, 7), rows=st.integers(0, 9), nbytes=st.integers(1, 40000),
       chunk=st.integers(MIN_CHUNK_BYTES // 64, 1024).map(lambda k: k * 64))
def test_chunks_cover_the_stream_once_in_order_within_the_bound(tensors, rows, nbytes, chunk):
    chunks = plan_chunks(tensors, rows, nbytes, chunk)
    total = tensors * rows * nbytes
    assert _expanded(chunks, rows, nbytes) == ([(0, total)] if total else [])
    position = 0
    for i, c in enumerate(chunks):
        assert c.index == i and c.position == position
        assert 0 < c.nbytes <= chunk
        assert 1 <= len(c.rects) <= 3
        for rect in c.rects:
            assert rect.r0 < rect.r1 and rect.tensors >= 1 and rect.length >= 1
            if nbytes <= chunk:
                assert (rect.offset, rect.length) == (0, nbytes)  # whole units are never split
            else:
                assert rect.offset % 64 == 0
        position += c.nbytes
    assert position == total
    if nbytes <= chunk and total:
        per = chunk // nbytes
        assert len(chunks) == -(-(tensors * rows) // per)  # as few chunks as the bound allows


def test_planner_rejects_bad_arguments():
    with pytest.raises(ValueError, match="nbytes"):
        plan_chunks(1, 1, 0, MIN_CHUNK_BYTES)
    with pytest.raises(ValueError, match="chunk_bytes"):
        plan_chunks(1, 1, 8, MIN_CHUNK_BYTES - 64)
    with pytest.raises(ValueError, match="chunk_bytes"):
        plan_chunks(1, 1, 8, MIN_CHUNK_BYTES + 1)
    with pytest.raises(ValueError, match="tensors"):
        plan_chunks(-1, 1, 8, MIN_CHUNK_BYTES)


# ---- pool -------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_pool_never_holds_more_than_its_bound():
    pool = StagingPool(MIN_CHUNK_BYTES, 2)
    a = await pool.acquire()
    b = await pool.acquire()
    assert pool.live == 2 and pool.bound_bytes == 2 * MIN_CHUNK_BYTES
    third = asyncio.ensure_future(pool.acquire())
    await asyncio.sleep(0.01)
    assert not third.done()
    pool.release(a)
    assert await asyncio.wait_for(third, 1) is a  # reused, not allocated
    fourth = asyncio.ensure_future(pool.acquire())
    await asyncio.sleep(0.01)
    assert not fourth.done()
    pool.retire(b)  # pending work may still touch it: not reused...
    await asyncio.sleep(0.01)
    assert not fourth.done() and pool.live == 2
    del b  # ...until its last reference goes; then a replacement fits under the bound
    gc.collect()
    c = await asyncio.wait_for(fourth, 1)
    assert c.numel() == MIN_CHUNK_BYTES and pool.live == 2 and pool.peak == 2
    pool.close()
    with pytest.raises(Exception, match="closed"):
        await pool.acquire()


@pytest.mark.asyncio
async def test_one_holder_never_takes_the_whole_pool_and_a_waiter_at_its_share_lets_others_by():
    """A holder (a link) has at most ``share`` buffers (``buffers - 1``): another holder gets one at once. A
    buffer given back while the oldest waiter is at its share goes to a later waiter that may take it (the
    wakeup went to the oldest only, which waited on with the buffer free)."""
    pool = StagingPool(MIN_CHUNK_BYTES, 3)
    assert pool.share == 2
    a1, a2 = await pool.acquire("a"), await pool.acquire("a")
    assert pool.try_acquire("a") is None and pool.held("a") == 2
    more_for_a = asyncio.ensure_future(pool.acquire("a"))  # at its share: waits
    b1 = await asyncio.wait_for(pool.acquire("b"), 1)  # another link: at once
    for_b = asyncio.ensure_future(pool.acquire("b"))  # the pool is full: waits behind a's waiter
    await asyncio.sleep(0.01)
    assert not more_for_a.done() and not for_b.done()
    pool.release(b1)  # a's waiter is still at its share: b's waiter takes it
    assert await asyncio.wait_for(for_b, 1) is b1
    assert not more_for_a.done()
    pool.retire(a1)  # a's share is back at once (the buffer itself once it is gone)
    del a1
    gc.collect()
    assert (await asyncio.wait_for(more_for_a, 1)).numel() == MIN_CHUNK_BYTES
    assert (pool.held("a"), pool.held("b"), pool.live) == (2, 1, 3)
    pool.release(a2)
    assert pool.held("a") == 1
    pool.close()


@pytest.mark.asyncio
async def test_a_retired_buffer_wakes_its_holders_waiter_at_once_while_work_still_holds_it():
    """A holder at its share waits while a buffer is free; it retires one that pending work still touches: its
    share is back at once, so its waiter takes the free buffer then, not once the retired buffer is gone."""
    pool = StagingPool(MIN_CHUNK_BYTES, 3)
    a1, a2 = await pool.acquire("a"), await pool.acquire("a")
    b1 = await pool.acquire("b")
    pool.release(b1)  # one buffer free, but "a" is at its share
    more_for_a = asyncio.ensure_future(pool.acquire("a"))
    await asyncio.sleep(0.01)
    assert not more_for_a.done()
    pool.retire(a1)  # a1 is still referenced here (as by its pending work)
    assert await asyncio.wait_for(more_for_a, 1) is b1
    assert (pool.held("a"), pool.live) == (2, 3)
    for_c = asyncio.ensure_future(pool.acquire("c"))  # none free, and the pool is at its bound
    await asyncio.sleep(0.01)
    assert not for_c.done()
    del a1  # the work lets the retired buffer go: its replacement wakes the waiter
    gc.collect()
    assert (await asyncio.wait_for(for_c, 1)).numel() == MIN_CHUNK_BYTES and pool.held("c") == 1
    del a2
    pool.close()


@pytest.mark.asyncio
async def test_a_waiter_cancelled_after_its_wakeup_passes_the_buffer_on():
    """Two transfers wait for the one buffer; it is released, and the waiter it woke is given up before it
    ran: the other waiter gets the buffer (no lost wakeup that would leave it waiting with a buffer free)."""
    pool = StagingPool(MIN_CHUNK_BYTES, 1)
    a = await pool.acquire()
    first = asyncio.ensure_future(pool.acquire())
    second = asyncio.ensure_future(pool.acquire())
    await asyncio.sleep(0.01)
    assert not first.done() and not second.done()
    pool.release(a)  # wakes the first waiter...
    first.cancel()  # ...which is given up before it could take the buffer
    assert await asyncio.wait_for(second, 1) is a
    with pytest.raises(asyncio.CancelledError):
        await first
    pool.close()


@pytest.mark.asyncio
async def test_a_waiter_of_a_pool_that_closes_is_refused_not_cancelled():
    """A transfer waiting for a buffer when the pool closes (finalize with a device stuck past ``QUIESCE_S``)
    fails ``LLM_FAILED`` "the staging pool is closed". Before, its waiter was cancelled: the caller, who never
    cancelled, got a ``CancelledError``, which asyncio and task groups take for a cancellation (row 290;
    found by audit). A buffer that goes once the pool closed (a retired one, which finalize's
    ``completions.close()`` lets go right after) leaves room under the bound: the woken waiter is refused still,
    not handed a new buffer of a closed pool (a closed check moved after the take passed; audit, 2026-12-07)."""
    pool = StagingPool(MIN_CHUNK_BYTES, 1)
    held = await pool.acquire()  # (kept: a buffer let go is replaced, which would wake the waiter)
    waiting = asyncio.ensure_future(pool.acquire())
    await asyncio.sleep(0.01)
    pool.close()
    pool.retire(held)
    del held  # gone: room for one buffer again
    assert pool.live == 0
    with pytest.raises(LLMException) as refused:
        await asyncio.wait_for(waiting, 1)
    assert refused.value.status_code == LLMStatusCode.LLM_FAILED and "closed" in str(refused.value)


def test_pool_rejects_bad_sizes():
    with pytest.raises(ValueError):
        StagingPool(100, 2)
    with pytest.raises(ValueError):
        StagingPool(MIN_CHUNK_BYTES, 0)


# ---- pipelines with host stages -----------------------------------------------------------------

T, ROWS, ROW = 6, 12, 3000  # 3000-byte rows: not a divisor of the chunk size


@pytest.fixture
def engines():
    queue = _core.CompletionQueue()
    comp = Completions(queue)
    copier = _core.HostCopyEngine(queue, threads=2)
    yield comp, copier
    copier.close()
    comp.close()
    queue.close()


def _host_cache(seed: int | None, row: int = ROW) -> tuple[KvCache, list[torch.Tensor]]:
    desc = CacheDesc(T, (ROWS, row), DataType.DT_UINT8, Placement.HOST)
    gen = torch.Generator().manual_seed(seed or 0)
    tensors = [torch.randint(0, 256, (ROWS, row), dtype=torch.uint8, generator=gen) if seed is not None
               else torch.zeros(ROWS, row, dtype=torch.uint8) for _ in range(T)]
    return KvCache.create_cpu_cache(desc, [t.data_ptr() for t in tensors]), tensors


def _host_stage(comp: Completions, copier: _core.HostCopyEngine, cache: KvCache, first: int, rows: list[int],
                offset: int, to_cache: bool, log: list | None = None):
    async def stage(chunk: Chunk, buf: torch.Tensor) -> None:
        if log is not None:
            log.append(("stage", chunk.index))
        triples = host_chunk_triples(cache, first, rows, offset, chunk, buf, to_cache)
        await comp.start(lambda t: copier.submit(t, triples), copier.cancel, timeout_ms=None, what="stage",
                         keepalive=(buf, cache))
        if log is not None:
            log.append(("staged", chunk.index))
    return stage


async def _drained(comp: Completions) -> None:
    for _ in range(500):
        if comp.pending_count() == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("native work still pending")


@pytest.mark.asyncio
async def test_gather_pipeline_delivers_the_wire_order_and_overlaps(engines):
    comp, copier = engines
    cache, tensors = _host_cache(seed=1)
    first, count, rows, offset, nbytes = 1, 4, [9, 0, 5, 11, 3], 100, 2500
    pool = StagingPool(MIN_CHUNK_BYTES * 2, 3)
    chunks = plan_chunks(count, len(rows), nbytes, pool.chunk_bytes)
    assert len(chunks) == 7
    out = bytearray(count * len(rows) * nbytes)
    log: list[tuple[str, int]] = []

    async def consume(chunk: Chunk, view: torch.Tensor) -> None:
        log.append(("consume", chunk.index))
        await asyncio.sleep(0.005)  # a send takes a while: the next stages run meanwhile
        out[chunk.position:chunk.position + chunk.nbytes] = view.numpy().tobytes()
        log.append(("consumed", chunk.index))

    await pipeline_out(chunks, pool, _host_stage(comp, copier, cache, first, rows, offset, False, log), consume)
    expected = b"".join(tensors[t][r, offset:offset + nbytes].numpy().tobytes()
                        for t in range(first, first + count) for r in rows)
    assert bytes(out) == expected
    assert pool.peak <= 3
    for i in range(len(chunks) - 1):
        # chunk i+1 was being staged before chunk i finished being consumed...
        assert log.index(("stage", i + 1)) < log.index(("consumed", i))
    for i in range(len(chunks)):
        # ...but never more than the pool's buffers ahead of the consumer.
        started = sum(1 for kind, j in log[:log.index(("consume", i))] if kind == "stage")
        assert started <= i + pool.buffers
    await _drained(comp)
    assert pool.live == pool.idle  # every buffer is back


@pytest.mark.asyncio
async def test_scatter_pipeline_lands_every_byte_and_nothing_else(engines):
    comp, copier = engines
    cache, tensors = _host_cache(seed=None)
    first, count, rows, offset, nbytes = 0, 6, [4, 7, 1], 64, 2900
    total = count * len(rows) * nbytes
    source = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    pool = StagingPool(MIN_CHUNK_BYTES, 2)
    chunks = plan_chunks(count, len(rows), nbytes, pool.chunk_bytes)
    assert len(chunks) == 18
    fills: list[int] = []

    async def fill(chunk: Chunk, view: torch.Tensor) -> None:
        fills.append(chunk.index)
        await asyncio.sleep(0.001)  # a receive takes a while: the previous chunk's scatter runs meanwhile
        view.copy_(source[chunk.position:chunk.position + chunk.nbytes])

    await pipeline_in(chunks, pool, fill, _host_stage(comp, copier, cache, first, rows, offset, True))
    assert fills == list(range(len(chunks)))
    expected = [torch.zeros(ROWS, ROW, dtype=torch.uint8) for _ in range(T)]
    pos = 0
    for t in range(first, first + count):
        for r in rows:
            expected[t][r, offset:offset + nbytes] = source[pos:pos + nbytes]
            pos += nbytes
    for got, want in zip(tensors, expected):
        assert torch.equal(got, want)
    assert pool.peak <= 2
    await _drained(comp)
    assert pool.live == pool.idle


@pytest.mark.asyncio
async def test_units_larger_than_a_chunk_are_split_and_reassembled(engines):
    comp, copier = engines
    cache, tensors = _host_cache(seed=3, row=10000)
    pool = StagingPool(MIN_CHUNK_BYTES, 2)
    chunks = plan_chunks(2, 2, 10000, pool.chunk_bytes)
    assert [c.rects[0].length for c in chunks] == [3392, 3392, 3216] * 4
    out = bytearray(2 * 2 * 10000)

    async def consume(chunk: Chunk, view: torch.Tensor) -> None:
        out[chunk.position:chunk.position + chunk.nbytes] = view.numpy().tobytes()

    await pipeline_out(chunks, pool, _host_stage(comp, copier, cache, 2, [5, 1], 0, False), consume)
    assert bytes(out) == b"".join(tensors[t][r].numpy().tobytes() for t in (2, 3) for r in (5, 1))
    await _drained(comp)


@pytest.mark.asyncio
async def test_a_failing_consumer_stops_the_pipeline_and_retires_busy_buffers(engines):
    comp, copier = engines
    cache, _ = _host_cache(seed=2)
    pool = StagingPool(MIN_CHUNK_BYTES, 3)
    chunks = plan_chunks(T, ROWS, ROW, pool.chunk_bytes)
    consumed: list[int] = []

    async def consume(chunk: Chunk, view: torch.Tensor) -> None:
        if chunk.index == 4:
            raise ConnectionResetError("peer went away")
        consumed.append(chunk.index)

    with pytest.raises(ConnectionResetError):
        await pipeline_out(chunks, pool, _host_stage(comp, copier, cache, 0, list(range(ROWS)), 0, False), consume)
    assert consumed == [0, 1, 2, 3]
    await _drained(comp)
    gc.collect()
    assert pool.live <= pool.buffers
    # The pool still serves a full transfer within its bound afterwards.
    done: list[int] = []

    async def keep(chunk: Chunk, view: torch.Tensor) -> None:
        done.append(chunk.index)

    await pipeline_out(chunks, pool, _host_stage(comp, copier, cache, 0, list(range(ROWS)), 0, False), keep)
    assert done == list(range(len(chunks))) and pool.peak <= pool.buffers


@pytest.mark.asyncio
async def test_cancelling_a_pipeline_midway_leaves_nothing_behind(engines):
    comp, copier = engines
    cache, _ = _host_cache(seed=None)
    pool = StagingPool(MIN_CHUNK_BYTES, 2)
    chunks = plan_chunks(T, ROWS, ROW, pool.chunk_bytes)
    started = asyncio.Event()

    async def fill(chunk: Chunk, view: torch.Tensor) -> None:
        if chunk.index == 3:
            started.set()
            await asyncio.sleep(10)  # a receive that never completes

    task = asyncio.ensure_future(
        pipeline_in(chunks, pool, fill, _host_stage(comp, copier, cache, 0, list(range(ROWS)), 0, True)))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _drained(comp)
    gc.collect()
    assert pool.live <= pool.buffers
    assert pool.peak <= pool.buffers
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await pipeline_in(chunks, pool, fill, _host_stage(comp, copier, cache, 0, list(range(ROWS)), 0, True))
    await _drained(comp)


@pytest.mark.asyncio
async def test_senders_sharing_a_pool_never_wait_for_each_other():
    """One pool serves every staged transfer of an endpoint. A sender waits for a buffer only while it
    holds none: before, three senders on a pool of two each took one buffer as the others freed theirs,
    then all waited for a second one, and every transfer timed out."""
    pool = StagingPool(MIN_CHUNK_BYTES, 2)
    chunks = plan_chunks(1, 8, MIN_CHUNK_BYTES, MIN_CHUNK_BYTES)  # 8 chunks of one row each
    done: list[str] = []

    async def stage(chunk: Chunk, buf: torch.Tensor) -> None:
        await asyncio.sleep(0)  # a device gather

    async def consume(chunk: Chunk, view: torch.Tensor) -> None:
        await asyncio.sleep(0.001)  # a socket send

    async def send(name: str) -> None:
        await pipeline_out(chunks, pool, stage, consume)
        done.append(name)

    async with asyncio.timeout(5):
        await asyncio.gather(*(send(name) for name in "ABCD"))
    assert sorted(done) == ["A", "B", "C", "D"] and pool.peak <= 2 and pool.live == pool.idle
    pool.close()


@pytest.mark.asyncio
async def test_senders_of_links_at_their_share_send_what_they_hold():
    """As the endpoint sends: each sender is a link (a holder) that may hold only its share less the room it
    leaves its receives. A sender at that limit that holds buffers sends them instead of waiting for more
    (nothing else would give it one: it would wait for itself)."""
    pool = StagingPool(MIN_CHUNK_BYTES, 4)  # share 3, so 2 per sending link
    chunks = plan_chunks(1, 8, MIN_CHUNK_BYTES, MIN_CHUNK_BYTES)
    done: list[str] = []

    async def stage(chunk: Chunk, buf: torch.Tensor) -> None:
        await asyncio.sleep(0)

    async def consume(chunk: Chunk, view: torch.Tensor) -> None:
        await asyncio.sleep(0.001)

    async def send(name: str) -> None:
        await pipeline_out(chunks, pool, stage, consume, holder=name)
        done.append(name)

    async with asyncio.timeout(5):
        await asyncio.gather(*(send(name) for name in "ABC"))
    assert sorted(done) == ["A", "B", "C"] and pool.peak <= 4 and pool.live == pool.idle
    pool.close()
    # A pool of two (share 1, none left for receives: a send still takes one) whose other buffer another transfer
    # holds throughout: the link's send takes the one left and sends it, chunk after chunk, never waiting for more.
    pool = StagingPool(MIN_CHUNK_BYTES, 2)
    other = await pool.acquire()
    async with asyncio.timeout(2):
        await send("D")
    assert done[-1] == "D" and pool.peak == 2
    pool.release(other)
    pool.close()
