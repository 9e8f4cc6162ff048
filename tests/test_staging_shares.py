"""The staging pool's per-link shares at their edges (found by review of the shares, each failed before).

- A stage refused before it was queued (``DeviceStaging._stage`` raising at once: a device enqueue that fails
  with nothing queued, a closed engine) left its buffer neither released nor retired: the link's share stayed
  taken for good (after three, the link could never stage again) and the pool kept the closed link alive.
- A release woke every waiter and took them off the list before they ran, so a pipelining sender's
  ``try_acquire`` took the buffer back at once: transfers holding none waited for that sender's whole transfer.
- A link's sends and receives share its share: a send staging ahead to the share left the same link's receive
  nothing, so two ends sending to and receiving from each other at once waited for each other until their
  requests' timeouts. A send now leaves one of its link's share to the receives (``room``).
"""

from __future__ import annotations

import asyncio
import gc
import time
import types
import weakref

import pytest
import torch
from peers import endpoint

from aio_datadist import CacheDesc, DataType, KvCache, LLMException, LLMRole, LLMStatusCode, Placement, _core
from aio_datadist._completion import Completions
from aio_datadist.transport.staging import staged_move
from aio_datadist.devices.staging import (
    LINK_SHARE,
    MIN_CHUNK_BYTES,
    Chunk,
    DeviceStaging,
    StagingPool,
    pipeline_in,
    pipeline_out,
    plan_chunks,
)
from aio_datadist.testing import runtime_of


def _failing_stage(chunk: Chunk, buf: torch.Tensor):
    # like DeviceStaging._stage: a plain function that returns the completion's future, raising at once when
    # Completions.start / the backend enqueue fails synchronously
    raise LLMException("staged send could not be enqueued", status_code=LLMStatusCode.LLM_FAILED)


@pytest.mark.asyncio
async def test_pipeline_out_stage_failing_synchronously_gives_back_the_holders_share():
    pool = StagingPool(MIN_CHUNK_BYTES, 4)  # share 3
    chunks = plan_chunks(1, 4, MIN_CHUNK_BYTES, MIN_CHUNK_BYTES)

    async def consume(chunk, view):
        pass

    for _ in range(3):
        with pytest.raises(LLMException):
            await pipeline_out(chunks, pool, _failing_stage, consume, holder="link")
    gc.collect()
    assert pool.held("link") == 0, f"the link still 'holds' {pool.held('link')} buffers nobody has"
    # the link can still stage
    buf = await asyncio.wait_for(pool.acquire("link"), 1)
    pool.release(buf)
    pool.close()


@pytest.mark.asyncio
async def test_pipeline_in_stage_failing_synchronously_gives_back_the_holders_share():
    pool = StagingPool(MIN_CHUNK_BYTES, 2)  # share 1
    chunks = plan_chunks(1, 2, MIN_CHUNK_BYTES, MIN_CHUNK_BYTES)

    async def fill(chunk, view):
        pass

    with pytest.raises(LLMException):
        await pipeline_in(chunks, pool, fill, _failing_stage, holder="link")
    gc.collect()
    assert pool.held("link") == 0
    buf = await asyncio.wait_for(pool.acquire("link"), 1)  # before: waits forever (the link is "at its share")
    pool.release(buf)
    pool.close()


class _EnqueueFails:
    """A device backend whose copy-stream enqueue fails before it queued anything (the stream is drained)."""
    batch_copies = False
    pins_tables = False

    def __init__(self) -> None:
        self.held: list = []

    def enqueue_and_notify(self, token, enqueue, aux, keep, what):
        exc = LLMException(f"{what} could not be enqueued: device error", status_code=LLMStatusCode.LLM_FAILED)
        self.held.append(keep)  # DeviceBackend._failed_submission: kept until the stream drained...
        exc.drained = lambda: True  # ...which it is: Completions.start raises at once
        raise exc

    def cancel(self, token):
        pass


class _Link:
    """Stands in for links.Link (a plain object, hashed by identity)."""


@pytest.mark.asyncio
async def test_device_staging_send_whose_enqueue_fails_keeps_no_share_and_no_link():
    queue = _core.CompletionQueue()
    comp = Completions(queue)
    backend = _EnqueueFails()
    staging = DeviceStaging(comp, backend, chunk_bytes=MIN_CHUNK_BYTES, buffers=4)
    desc = CacheDesc(2, (4, 256), DataType.DT_UINT8, Placement.HOST)
    tensors = [torch.zeros(4, 256, dtype=torch.uint8) for _ in range(2)]
    cache = KvCache.create_cpu_cache(desc, [t.data_ptr() for t in tensors])
    link = _Link()
    gone = weakref.ref(link)

    async def consume(chunk, view):
        pass

    try:
        for _ in range(3):  # three device errors on one link...
            with pytest.raises(LLMException):
                await staging.send(cache, 0, 2, [0, 1], 0, 256, consume, "staged send", link)
        backend.held.clear()  # the stream drained: the backend lets the buffers go
        gc.collect()
        held = staging.pool.held(link)
        stuck = False
        try:  # ...and that link can never stage again
            buf = await asyncio.wait_for(staging.pool.acquire(link), 0.5)
            staging.pool.release(buf)
        except TimeoutError:
            stuck = True
        del link
        gc.collect()
        assert (held, stuck, gone() is None) == (0, False, True), \
            f"held={held}, the link can no longer acquire={stuck}, the pool keeps the closed link={gone() is not None}"
    finally:
        staging.close()
        comp.close()
        queue.close()


class _Wire:
    """One direction of a link's data channel: a send completes only once the peer read it (a big chunk)."""

    def __init__(self) -> None:
        self.q: asyncio.Queue = asyncio.Queue()

    async def send(self, chunk, view) -> None:
        done = asyncio.get_running_loop().create_future()
        await self.q.put((bytes(view[:16].numpy()), done))
        await done

    async def recv(self, chunk, view) -> None:
        _data, done = await self.q.get()
        done.set_result(None)


async def _stage(chunk, buf):
    await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_both_ends_sending_and_receiving_on_one_link_finish():
    pool_x, pool_y = StagingPool(MIN_CHUNK_BYTES, 4), StagingPool(MIN_CHUNK_BYTES, 4)  # the defaults: 4, share 3
    xy, yx = _Wire(), _Wire()
    chunks = plan_chunks(1, 3, MIN_CHUNK_BYTES, MIN_CHUNK_BYTES)  # 3 chunks each way
    link_x, link_y = "x's link to y", "y's link to x"
    sends = [asyncio.ensure_future(pipeline_out(chunks, pool_x, _stage, xy.send, link_x)),
             asyncio.ensure_future(pipeline_out(chunks, pool_y, _stage, yx.send, link_y))]
    await asyncio.sleep(0.01)  # both have staged ahead and wait on the wire
    recvs = [asyncio.ensure_future(pipeline_in(chunks, pool_x, yx.recv, _stage, link_x)),
             asyncio.ensure_future(pipeline_in(chunks, pool_y, xy.recv, _stage, link_y))]
    try:
        _, pending = await asyncio.wait(sends + recvs, timeout=2)
        if pending:
            pytest.fail(f"deadlock: x's link holds {pool_x.held(link_x)}/{pool_x.buffers} (share {pool_x.share}, "
                        f"idle {pool_x.idle}, live {pool_x.live}), y's likewise {pool_y.held(link_y)}")
    finally:
        for t in sends + recvs:
            t.cancel()
        await asyncio.gather(*sends, *recvs, return_exceptions=True)
        pool_x.close()
        pool_y.close()


@pytest.mark.asyncio
async def test_try_acquire_defers_to_waiters_woken_by_a_release():
    pool = StagingPool(MIN_CHUNK_BYTES, 2)
    a, b = await pool.acquire(), await pool.acquire()
    w1 = asyncio.ensure_future(pool.acquire())
    w2 = asyncio.ensure_future(pool.acquire())
    await asyncio.sleep(0.01)
    pool.release(a)
    stolen = pool.try_acquire()  # a sender still staging ahead (holds b): waiters come first
    assert stolen is None, "try_acquire took the buffer a waiter was woken for"
    assert await asyncio.wait_for(w1, 1) is a
    pool.release(b)
    assert await asyncio.wait_for(w2, 1) is b
    pool.close()


@pytest.mark.asyncio
async def test_transfers_waiting_for_a_buffer_are_not_starved_by_a_pipelining_sender():
    """A link's long staged send holds its share (2 of 3) and stages ahead; the third buffer is another
    link's. Two other links' transfers wait for a buffer. Each chunk the sender gives back should go to a
    waiter; instead the sender takes it straight back and they wait until its whole transfer is over."""
    pool = StagingPool(MIN_CHUNK_BYTES, 3)
    other = await pool.acquire("c")  # a third link's transfer, busy for the whole test
    chunks = plan_chunks(1, 40, MIN_CHUNK_BYTES, MIN_CHUNK_BYTES)  # 40 chunks, ~10 ms each on the socket

    async def stage(chunk, buf):
        await asyncio.sleep(0)

    async def consume(chunk, view):
        await asyncio.sleep(0.01)

    sender = asyncio.ensure_future(pipeline_out(chunks, pool, stage, consume, holder="a"))
    await asyncio.sleep(0.005)
    assert pool.held("a") == pool.share - 1  # a send leaves one of its link's share to its receives
    t0 = time.monotonic()
    waits: dict[str, float] = {}

    async def waiter(name: str) -> None:
        buf = await pool.acquire(name)
        waits[name] = time.monotonic() - t0
        await asyncio.sleep(0.01)
        pool.release(buf)

    await asyncio.wait_for(asyncio.gather(waiter("b"), waiter("d"), sender), 10)
    pool.release(other)
    pool.close()
    # each should have had a buffer within a few chunks (~10 ms each), not after all 40 (~400 ms)
    assert max(waits.values()) < 0.15, f"waited {waits} while the sender streamed 40 chunks"


@pytest.mark.asyncio
async def test_a_send_on_a_link_whose_share_is_one_buffer_still_takes_it():
    """A send leaves one of its link's share to its receives, never below one buffer: with a pool of 2 (share 1,
    row 315) a send stages through its one buffer and finishes (found by audit: the tests passed with the floor
    of ``StagingPool._within`` dropped, and such a send waited for good)."""
    pool = StagingPool(MIN_CHUNK_BYTES, 2)
    sent: list[int] = []

    async def consume(chunk, view):
        sent.append(pool.held("link"))

    try:
        await asyncio.wait_for(pipeline_out(plan_chunks(1, 3, MIN_CHUNK_BYTES, MIN_CHUNK_BYTES), pool, _stage,
                                            consume, "link"), 1)
        assert sent == [1, 1, 1], sent
    finally:
        pool.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("buffers, stalled, left", [(4, 2, False), (8, 3, True), (8, 4, False), (16, 7, True)])
async def test_sends_whose_peers_stop_reading_hold_two_buffers_each_whatever_the_pool(buffers, stalled, left):
    """Links whose peers stop taking their bytes (stopped processes, stuck hosts) hold ``LINK_SHARE - 1`` buffers
    each for their staged sends: a pool of B buffers (``aio.StagingBuffers``) stays open to another link's
    transfer while fewer than B / 2 such sends are held. Before, a link's share grew with the pool (all but one
    of it), so two stalled sends took any pool, and a larger pool helped nothing (found by the isolation
    audit: two SIGSTOPped decoders held an owner's 4 buffers, and a healthy decoder's staged 8 MiB pull waited
    5.4 s for their heartbeat)."""
    pool = StagingPool(MIN_CHUNK_BYTES, buffers)
    chunks = plan_chunks(1, 8, MIN_CHUNK_BYTES, MIN_CHUNK_BYTES)
    gate = asyncio.Event()

    async def stage(chunk, buf):
        await asyncio.sleep(0)

    async def consume(chunk, view):
        await gate.wait()  # the peer never reads

    sends = [asyncio.ensure_future(pipeline_out(chunks, pool, stage, consume, holder=f"stalled{i}"))
             for i in range(stalled)]
    try:
        await asyncio.sleep(0.02)
        assert all(pool.held(f"stalled{i}") == 2 for i in range(stalled))
        got = await asyncio.wait_for(pool.acquire("healthy"), 0.2) if left else None
        if not left:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(pool.acquire("healthy"), 0.05)
        if got is not None:
            pool.release(got)
    finally:
        for send in sends:
            send.cancel()
        await asyncio.gather(*sends, return_exceptions=True)
        pool.close()


@pytest.mark.asyncio
async def test_the_staging_pool_is_sized_by_aio_staging_buffers():
    async with endpoint(LLMRole.PROMPT, 1, device_type="host", staging_buffers=12) as dd:
        pool = runtime_of(dd).staging.pool
        assert (pool.buffers, pool.share) == (12, LINK_SHARE)
    async with endpoint(LLMRole.PROMPT, 1, device_type="host") as dd:
        pool = runtime_of(dd).staging.pool
        assert (pool.buffers, pool.share) == (4, 3)


async def consume_nothing(chunk, view) -> None:
    await asyncio.sleep(0)


@pytest.mark.asyncio
@pytest.mark.parametrize("direction", ["send", "receive"])
async def test_a_transfer_that_cannot_stage_ahead_for_want_of_memory_goes_on_with_the_buffer_it_holds(direction):
    """A pipelined send (receive) holds one buffer and would stage the next chunk into a second that cannot be
    allocated (out of memory): it goes on, one chunk at a time, with the buffer it holds, instead of failing the
    transfer (found by the reviews of row 319: the send first, then the receive); a transfer that holds none
    still fails ``LLM_OUT_OF_MEMORY``."""
    made = []

    def allocate(nbytes: int) -> torch.Tensor:
        if made:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        made.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    pool = StagingPool(MIN_CHUNK_BYTES, 4, allocate)
    chunks = plan_chunks(1, 6, MIN_CHUNK_BYTES, MIN_CHUNK_BYTES)
    sent = []

    async def stage(chunk, buf):
        await asyncio.sleep(0 if direction == "send" else 0.01)  # a scatter still runs when the next chunk comes
        if direction == "receive":
            sent.append(chunk)

    async def consume(chunk, view):
        sent.append(chunk)
        await asyncio.sleep(0)

    run = (pipeline_out(chunks, pool, stage, consume, holder="a") if direction == "send"
           else pipeline_in(chunks, pool, consume_nothing, stage, holder="a"))
    await asyncio.wait_for(run, 5)
    assert len(sent) == len(chunks) and pool.live == 1
    held = await pool.acquire("b")  # the one buffer, free again
    with pytest.raises(LLMException) as info:
        await pool.acquire("c")  # none free and none can be made: nothing to go on with
    assert info.value.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY
    pool.release(held)
    pool.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("send", [True, False], ids=["send", "receive"])
async def test_a_staged_move_takes_its_buffers_on_its_links_share(send):
    """The transfers' staged path hands its link to the pool as the holder whose share it takes (without a
    holder no share applies). The tests above drive the pool directly, and passed with the data path giving no
    holder (audit, 2026-12-07)."""
    holders = []

    async def taken(cache, first, count, rows, offset, nbytes, job, what="", holder=None):
        holders.append(holder)

    rt = types.SimpleNamespace(staging=types.SimpleNamespace(send=taken, receive=taken))
    link = object()
    await staged_move(rt, link, 0, object(), 0, 1, [0], 0, 64, send=send, what="staged")
    assert holders == [link]

    # ...and DeviceStaging hands it on to the pipeline: the link holds its buffer while its chunk moves
    queue = _core.CompletionQueue()
    comp = Completions(queue)
    staging = DeviceStaging(comp, _EnqueueFails(), chunk_bytes=MIN_CHUNK_BYTES, buffers=4)
    staging._stage = lambda *args: asyncio.ensure_future(asyncio.sleep(0))  # a device copy that just ends
    moved = _Link()

    def move(channel, pairs, *, settled, **kw):
        holders.append(staging.pool.held(moved))
        settled.set_result(None)
        return asyncio.ensure_future(asyncio.sleep(0))

    moved.move = move
    try:
        await staged_move(types.SimpleNamespace(staging=staging), moved, 0, object(), 0, 1, [0], 0, 64, send=send,
                          what="staged")
    finally:
        staging.close()
        comp.close()
        queue.close()
    assert holders == [link, 1], "DeviceStaging gave its pipeline no holder: the link's share did not apply"
