"""Refused device copies in the staging pipeline: they fail the transfer at once and take no buffer for good.

The host backend (``aio.DeviceType=host``) runs the staged pipeline as a
CUDA device does; the test refuses its copies the way a driver error would.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
from peers import DECODER_ID, PROMPT_ID, fill, linked_pair, same, snapshot

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    protocol,
    transfers,
    wire,
)
from aio_datadist.devices.staging import DeviceStaging, StagingPool, pipeline_in, pipeline_out, plan_chunks
from aio_datadist.testing import link_to, runtime_of, usable_link
from aio_datadist.transport.base import ABORT_ACK_S
from aio_datadist.wire import Msg

S = LLMStatusCode
pytestmark = pytest.mark.asyncio
HOST = {"device_type": "host"}
BLOCKS = CacheDesc(4, (6, 3, 512), DataType.DT_FLOAT16, Placement.DEVICE)  # 3 KiB units: one per 4 KiB chunk


@pytest.fixture(autouse=True)
def staged(monkeypatch):
    """Same-host device IPC off, so that the pulls below go through the staging pipeline."""
    from aio_datadist.devices.host_backend import HostBackend

    monkeypatch.setattr(HostBackend, "ipc_unavailable", lambda self: "switched off by test_staging_failures.py")


def small_staging(dd, buffers: int = 2) -> DeviceStaging:
    rt = runtime_of(dd)
    rt._staging = DeviceStaging(rt.completions, rt.devices, chunk_bytes=4096, buffers=buffers)
    return rt._staging


def refuse(*args):
    raise RuntimeError("device copy refused by the test (a transient driver error)")


async def pull(pair, dst, rows, timeout_ms):
    await asyncio.wait_for(pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, rows, rows, timeout=timeout_ms),
                           timeout_ms / 1000 + 1)


@pytest.mark.loops_take_turns
@pytest.mark.parametrize("side", ["puller_scatter", "owner_gather"])
async def test_refused_copies_give_their_staging_buffers_back_once_the_stream_drained(side):
    """Row 241: each refused copy's chunk buffer was held by the backend until it closed, and counted by the
    pool: after two, every later staged transfer of that end waited for a buffer until it timed out."""
    async with linked_pair(prompt_config=HOST, decoder_config=HOST) as pair:
        small_staging(pair.prompt), small_staging(pair.decoder)
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        rt = runtime_of(pair.decoder if side == "puller_scatter" else pair.prompt)
        backend, pool = rt.devices, rt.staging.pool
        for _ in range(2):
            backend.memcpy_batch = refuse
            try:
                with pytest.raises(LLMException):
                    await pull(pair, dst, [0, 1], 1000)
            finally:
                del backend.memcpy_batch
        for _ in range(100):  # the owner ends its serve on its own time
            gc.collect()  # a failure's traceback keeps its frames (a retired buffer among them) in cycles
            if rt.completions.pending_count() == 0 and pool.live == pool.idle:
                break
            await asyncio.sleep(0.005)
        assert backend.held == 0 and pool.live == pool.idle
        values = fill(src, 10)
        await pull(pair, dst, [1, 5], 1000)
        assert all(same([d[1], d[5]], [v[1], v[5]]) for d, v in zip(dst.tensors, values, strict=True))


async def test_a_refused_scatter_fails_the_pull_while_the_owner_is_slow_with_the_next_chunk():
    """Row 242: the puller's scatter of the first chunk fails (reported once its stream drained) while the
    owner's next chunk is held up; the pull waited on the socket for it and ended in LLM_TIMEOUT."""
    async with linked_pair(prompt_config=HOST, decoder_config=HOST) as pair:
        small_staging(pair.prompt, 3), small_staging(pair.decoder, 3)
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        fill(src, 9)
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        fill(dst, 3)
        before = snapshot(dst)
        owner, puller = runtime_of(pair.prompt).devices, runtime_of(pair.decoder).devices
        real_notify = owner.notify
        gates = []
        loop = asyncio.get_running_loop()

        def owner_slow_after_first(token, aux):
            real_notify(token, aux)
            if not gates:
                gates.append(owner.stream.gate())  # the gathers of every later chunk wait behind it

        def refused_behind_work(*args):
            gate = puller.stream.gate()  # the stream has not drained: the failure reaches the pull later
            loop.call_later(0.01, gate.open)
            refuse()

        owner.notify, puller.memcpy_batch = owner_slow_after_first, refused_behind_work
        try:
            with pytest.raises(LLMException) as info:
                await asyncio.wait_for(pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, list(range(6)),
                                                           list(range(6)), timeout=10000), 1.0)
        finally:
            del owner.notify, puller.memcpy_batch
            for gate in gates:
                gate.open()
        assert info.value.status_code == S.LLM_FAILED and "refused by the test" in str(info.value)
        del info
        await asyncio.sleep(0.02)
        assert same(snapshot(dst), before)  # nothing landed after the pull returned
        values = fill(src, 10)
        await pull(pair, dst, [1, 5], 2000)
        assert all(same([d[1], d[5]], [v[1], v[5]]) for d, v in zip(dst.tensors, values, strict=True))


@pytest.mark.loops_take_turns
@pytest.mark.parametrize("direction", ["out", "in", "in-cleanup"])
async def test_a_failed_stage_cuts_the_socket_job_the_pipeline_waits_on(direction):
    """Row 242: a gather (scatter) that fails while the pipeline waits on the peer to take (give) a chunk
    fails the pipeline at once, after that socket job is over; before, only once the peer went on."""
    loop = asyncio.get_running_loop()
    pool, link = StagingPool(4096, 3, share=3), object()
    chunks = plan_chunks(1, 4, 4096, 4096)
    stages: list[asyncio.Future] = []
    waits: list[asyncio.Future] = []

    def stage(chunk, buf):
        fut = loop.create_future()
        if direction == "out" and not stages:  # the first chunk is on the socket when the next gathers fail
            fut.set_result(None)
        else:
            loop.call_later(0.01, fut.set_exception, LLMException("stage refused", status_code=S.LLM_FAILED))
        stages.append(fut)
        return fut

    def socket_job(chunk, view):
        fut = loop.create_future()  # the first chunk goes at once, then the peer is slow
        if waits or direction == "out":
            waits.append(fut)
        else:
            fut.set_result(None)
            waits.append(fut)
        return fut

    run = (pipeline_out(chunks, pool, stage, socket_job, link) if direction == "out"
           else pipeline_in(chunks, pool, socket_job, stage, link))
    if direction == "in-cleanup":  # run in a task's cleanup after a cancel (its cancelling() is 1 throughout):
        run = _in_cleanup(run)  # still the stage's failure, not the cut job's CancelledError (audit, 2026-12-07)
    with pytest.raises(LLMException, match="stage refused"):
        await asyncio.wait_for(run, 1.0)
    assert waits[-1].cancelled()
    assert len(stages) == (2 if direction == "out" else 1) and pool.held(link) == 0


async def _in_cleanup(job):
    asyncio.current_task().cancel()
    try:
        await asyncio.sleep(1)
    except asyncio.CancelledError:
        return await job


def _slow_then_refused(loop: asyncio.AbstractEventLoop) -> Any:
    """A stage function whose first stage is slow (0.1 s) and succeeds, and whose later ones fail after 10 ms."""
    stages: list[asyncio.Future] = []

    def stage(chunk: Any, buf: Any) -> asyncio.Future:
        fut = loop.create_future()
        if not stages:
            loop.call_later(0.1, fut.set_result, None)
        else:
            loop.call_later(0.01, fut.set_exception, LLMException("stage refused", status_code=S.LLM_FAILED))
        stages.append(fut)
        return fut

    return stage


async def test_a_stage_that_fails_while_the_receive_waits_for_a_buffer_fails_it_before_the_next_fill():
    """Row 242 where the failure comes between two socket jobs: the receive waits for its oldest stage to give
    its buffer back (that stage succeeds, slowly) while a later one fails. The next fill is not started to wait
    on a slow peer until the transfer's timeout: the pipeline fails at once (found by audit: it timed out)."""
    loop = asyncio.get_running_loop()
    pool, link = StagingPool(4096, 2, share=2), object()
    chunks = plan_chunks(1, 4, 4096, 4096)
    stage = _slow_then_refused(loop)  # the second scatter fails while the receive waits for the first's buffer
    fills: list[asyncio.Future] = []

    def fill(chunk, view):
        fut = loop.create_future()
        if len(fills) < 2:  # two chunks came at once; the peer is slow with the third
            fut.set_result(None)
        fills.append(fut)
        return fut

    with pytest.raises(LLMException, match="stage refused"):
        await asyncio.wait_for(pipeline_in(chunks, pool, fill, stage, link), 1.0)
    assert len(fills) == 2 and pool.held(link) == 0


async def test_a_stage_that_fails_while_the_send_waits_for_an_earlier_stage_fails_it_before_the_next_consume():
    """The send's side of the test above: a later gather fails while the send waits for an earlier, slow one
    (which succeeds). The send of the earlier chunk is not started to wait on a slow peer until the transfer's
    timeout: the pipeline fails at once (audit, 2026-12-07: it timed out)."""
    loop = asyncio.get_running_loop()
    pool, link = StagingPool(4096, 3, share=3), object()
    chunks = plan_chunks(1, 4, 4096, 4096)
    stage = _slow_then_refused(loop)  # the second gather fails while the send waits for the first
    consumes: list[asyncio.Future] = []

    def consume(chunk, view):
        consumes.append(loop.create_future())  # the peer is slow to take anything
        return consumes[-1]

    with pytest.raises(LLMException, match="stage refused"):
        await asyncio.wait_for(pipeline_out(chunks, pool, stage, consume, link), 1.0)
    assert all(fut.cancelled() for fut in consumes) and pool.held(link) == 0


def _word_read_late(dd, cluster_id: int, delay_s: float, apart: bool = False) -> None:
    """Act ``delay_s`` late on what ``dd``'s link to ``cluster_id`` reads on its control connection from the
    first failure word (a ``RESP`` or ``DONE`` that is not a success) or ``ABORT`` on, in order: a data
    channel's reset is then seen before the word that came before it (they travel on different connections,
    and the loop may read either first), while the owner's answer that started the job is read in time.
    ``apart``: one of them each ``delay_s`` (an owner's ABORT sent before its word would end the wait)."""
    link = usable_link(dd, cluster_id)
    loop = asyncio.get_running_loop()
    dispatch, queued = link._dispatch, []

    def drain() -> None:
        events = queued[:1] if apart else queued[:]
        del queued[:len(events)]
        for event in events:
            dispatch(event)
        if queued:
            loop.call_later(delay_s, drain)

    def late(event) -> None:
        word = isinstance(event, protocol.Abort) or (
            isinstance(event, protocol.Reply) and getattr(event.record, "status", 0) != 0)
        if not queued and not word:
            dispatch(event)
            return
        if not queued:
            loop.call_later(delay_s, drain)
        queued.append(event)

    link._dispatch = late


def _silent_after_reset(link, abort: bool = False) -> None:
    """``link`` (the owner's) resets channels and says nothing: no failure word, no ``ABORT`` (an owner on the
    far side of a network reset, or a hostile one); with ``abort``, its ``ABORT`` of the channel goes still."""
    send = link.send

    def quiet(msg, req_id, **fields) -> None:
        if (msg is Msg.ABORT and not abort) or msg is Msg.DONE or (msg is Msg.RESP and fields.get("status", 0) != 0):
            return
        send(msg, req_id, **fields)

    link.send = quiet


@pytest.mark.parametrize("transport", ["tcp", "local"])
@pytest.mark.parametrize("direction", ["pull", "push"])
@pytest.mark.parametrize("read_late", [False, True], ids=["word_in_time", "word_read_late"])
async def test_an_owner_whose_device_copy_fails_says_why_and_the_link_stays(transport, direction, read_late,
                                                                            monkeypatch):
    """An owner whose staged job fails for a reason of its own (its device gather of a pull, its scatter of a
    push) tells the requester why before it resets the channel, and the requester, seeing the reset first,
    waits for that word: ``LLM_FAILED`` with the owner's reason, the link up, and the next transfer moves the
    right bytes. Before, the requester mostly failed with ``LLM_LINK_FAILED`` ("Connection reset by peer")
    although the link was up, and always when the word was read after the reset."""
    waited = []
    real_wait = transfers._owners_word

    async def owners_word(*args) -> None:
        waited.append(True)
        await real_wait(*args)

    monkeypatch.setattr(transfers, "_owners_word", owners_word)
    config = {**HOST, "transport": transport}
    async with linked_pair(prompt_config=config, decoder_config=config) as pair:
        small_staging(pair.prompt), small_staging(pair.decoder)
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        dst = pair.dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID, 0))
        owner, requester = (pair.prompt, pair.decoder) if direction == "pull" else (pair.decoder, pair.prompt)
        if read_late:
            _word_read_late(requester, DECODER_ID if direction == "push" else PROMPT_ID, 0.05, apart=True)
        backend = runtime_of(owner).devices
        backend.memcpy_batch = refuse
        try:
            with pytest.raises(LLMException) as info:
                if direction == "pull":
                    await pull(pair, dst, [0, 1], 2000)
                else:
                    await asyncio.wait_for(pair.pm.push_blocks(BlocksCacheKey(DECODER_ID, 0), src, [0, 1], [0, 1],
                                                               timeout=2000), 3.0)
        finally:
            del backend.memcpy_batch
        assert info.value.status_code == S.LLM_FAILED, info.value
        assert "refused by the test" in str(info.value)
        del info
        if read_late and direction == "pull":  # (a push may have sent everything first: it then reads the word)
            assert waited  # the reset was seen first, and the requester waited for the word
        link = link_to(requester, DECODER_ID if direction == "push" else PROMPT_ID)
        assert link_to(pair.decoder, PROMPT_ID).up and link_to(pair.prompt, DECODER_ID).up and not link._resets
        values = fill(src, 10)
        if direction == "pull":
            await pull(pair, dst, [1, 2], 2000)
        else:
            await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID, 0), src, [1, 2], [1, 2], timeout=2000)
        assert all(same([d[1], d[2]], [v[1], v[2]]) for d, v in zip(dst.tensors, values, strict=True))


@pytest.mark.parametrize(("direction", "abort"), [("pull", False), ("push", False), ("pull", True)],
                         ids=["pull", "push", "pull-abort_only"])
async def test_waiting_for_a_silent_owners_word_stays_within_the_call_s_bound(direction, abort):
    """Row 314's wait for the owner's word after a reset is bounded by the call's own time: an owner that resets
    the channel and says nothing (no word, no ABORT) holds a pull no longer than its timeout, and a push no longer
    than its timeout and ``ABORT_ACK_S`` (its cut's bound, row 35). The first form of row 314 waited a full
    ``ABORT_ACK_S`` more after the timeout (a push 2 s with ``timeout=500``; found by its review)."""
    config = {**HOST, "transport": "tcp"}
    async with linked_pair(prompt_config=config, decoder_config=config) as pair:
        small_staging(pair.prompt), small_staging(pair.decoder)
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        dst = pair.dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID, 0))
        owner, requester, peer = ((pair.decoder, pair.prompt, DECODER_ID) if direction == "push"
                                  else (pair.prompt, pair.decoder, PROMPT_ID))
        _silent_after_reset(usable_link(owner, PROMPT_ID if owner is pair.decoder else DECODER_ID), abort)
        backend = runtime_of(owner).devices
        backend.memcpy_batch = refuse
        loop = asyncio.get_running_loop()
        timeout = 3000 if abort else 500  # with its ABORT: the wait ends long before the call's time
        start = loop.time()
        try:
            with pytest.raises(LLMException):
                if direction == "push":
                    await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID, 0), src, [0, 1], [0, 1], timeout=timeout)
                else:
                    await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, [0, 1], [0, 1], timeout=timeout)
        finally:
            del backend.memcpy_batch
        took = loop.time() - start
        assert took < (timeout / 1000 + ABORT_ACK_S if direction == "push" else timeout / 1000) + 0.2, took
        assert not abort or took < 0.6, took  # the ABORT ends the wait, not its bound (ABORT_ACK_S, 1 s here)
        assert not link_to(requester, peer)._resets


async def test_a_channel_the_owner_redialled_first_does_not_hide_its_word(monkeypatch):
    """The requester on the accepting end of the link (the owner dials the channels its requests use): the owner
    resets the channel after its word and dials it again, and that redial is installed here before the word and
    the owner's ABORT are read (the requester's task resumes late, the word later still). The wait still takes
    the word (row 314 waits for the owner's ABORT of the request's channel generation, not for the channel to
    move on). Its first form read the new generation as the ABORT read, and the push failed ``LLM_LINK_FAILED``
    ("Connection reset by peer"; found by its review)."""
    async with linked_pair(prompt_config=HOST, decoder_config=HOST) as pair:
        small_staging(pair.prompt), small_staging(pair.decoder)
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        pair.dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID, 0))
        assert not usable_link(pair.prompt, DECODER_ID).is_client
        _word_read_late(pair.prompt, DECODER_ID, 0.2)
        real_wait = transfers._owners_word

        async def late_task(*args) -> None:
            await asyncio.sleep(0.1)  # the requester's loop was busy: the owner's redial got in first
            await real_wait(*args)

        monkeypatch.setattr(transfers, "_owners_word", late_task)
        backend = runtime_of(pair.decoder).devices
        backend.memcpy_batch = refuse
        try:
            with pytest.raises(LLMException) as info:
                await asyncio.wait_for(pair.pm.push_blocks(BlocksCacheKey(DECODER_ID, 0), src, [0, 1], [0, 1],
                                                           timeout=2000), 3.0)
        finally:
            del backend.memcpy_batch
        assert info.value.status_code == S.LLM_FAILED and "refused by the test" in str(info.value), info.value


async def test_an_abort_of_a_request_alone_does_not_end_later_waits_for_the_owners_word():
    """An ``ABORT`` that names a request only (generation ``NO_GENERATION``: a same-host push given up, or a
    request whose channel was replaced already) resets no channel, and later waits for an owner's word on the
    same channel still wait (row 314). Its second form took it for an ABORT of every generation: from then on
    the link read an owner's reset first as ``LLM_LINK_FAILED`` (found by its review)."""
    async with linked_pair(prompt_config=HOST, decoder_config=HOST) as pair:
        small_staging(pair.prompt), small_staging(pair.decoder)
        pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        dst = pair.dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID, 0))
        owner_link = usable_link(pair.prompt, DECODER_ID)
        for channel in range(len(owner_link.channels)):
            owner_link.send(Msg.ABORT, 2**63 + channel, channel=channel, generation=wire.NO_GENERATION)
        await asyncio.sleep(0.05)
        _word_read_late(pair.decoder, PROMPT_ID, 0.05)
        backend = runtime_of(pair.prompt).devices
        backend.memcpy_batch = refuse
        try:
            with pytest.raises(LLMException) as info:
                await pull(pair, dst, [0, 1], 2000)
        finally:
            del backend.memcpy_batch
        assert info.value.status_code == S.LLM_FAILED and "refused by the test" in str(info.value), info.value


@pytest.mark.parametrize("short_of_memory", ["requester", "owner"])
@pytest.mark.parametrize("error", ["shortage", "fault"])
async def test_a_staging_buffer_that_cannot_be_allocated_is_llm_out_of_memory_on_both_ends(short_of_memory, error):
    """Memory for a staging buffer runs out (torch's allocator raises): the pull fails ``LLM_OUT_OF_MEMORY``
    whichever end could not stage (the owner says so: row 314's word carries that code), the link stays, and
    once memory is back the next pull moves the right bytes. Before, the requester's own shortage escaped as a
    bare ``RuntimeError`` and the owner's reached it as ``LLM_FAILED`` (found by the exhaustion audit). An
    allocator error that is not a shortage (a device fault) is ``LLM_FAILED``, which a requester does not retry
    (the first form called every allocator error a shortage: review)."""
    async with linked_pair(prompt_config=HOST, decoder_config=HOST) as pair:
        small_staging(pair.prompt), small_staging(pair.decoder)
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        pool = runtime_of(pair.decoder if short_of_memory == "requester" else pair.prompt).staging.pool

        def no_memory(nbytes: int):
            if error == "fault":
                raise RuntimeError("pin_memory=True requires a CUDA or other accelerator backend")
            raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {nbytes} bytes")

        pool._allocate, allocate = no_memory, pool._allocate
        try:
            with pytest.raises(LLMException) as info:
                await pull(pair, dst, [0, 1], 2000)
        finally:
            pool._allocate = allocate
        code = S.LLM_OUT_OF_MEMORY if error == "shortage" else S.LLM_FAILED
        assert info.value.status_code == code and "staging buffer" in str(info.value), info.value
        del info
        assert pool.live == 0  # a buffer that could not be made does not count against the pool's bound
        assert link_to(pair.decoder, PROMPT_ID).up
        values = fill(src, 10)
        await pull(pair, dst, [1, 2], 2000)
        assert all(same([d[1], d[2]], [v[1], v[2]]) for d, v in zip(dst.tensors, values, strict=True))


async def test_busy_lets_a_failed_submissions_memory_go_once_the_stream_drained():
    """The memory of a failed submission that carries no ``drained`` hook (an interrupt) goes when ``busy()``
    sees the copy stream drained, not only on the ``Completions.start`` path the test above takes (it passed
    with ``busy()`` keeping that memory; audit, 2026-12-07). The host backend's stream has nothing queued."""
    async with LLMDataDist(LLMRole.MIX, 1) as dd:
        await dd.init({"aio.DeviceType": "host"})
        backend = runtime_of(dd).devices
        backend._failed_submission([bytearray(16)], KeyboardInterrupt())
        assert backend.held == 1
        assert backend.busy() is False and backend.held == 0
        # the next submission lets it go too, also one that fails queueing nothing (audit, 2026-12-07: the
        # tests passed with submissions never looking at what earlier failures held)
        backend._failed_submission([bytearray(16)], KeyboardInterrupt())
        with pytest.raises(LLMException, match="refused by the test"):
            backend.enqueue_and_notify(0, refuse, 0, None, "a device copy")
        assert backend.held == 0


async def test_a_retired_buffer_that_goes_wakes_a_transfer_waiting_for_one():
    """Row 241's "the retired buffer is then replaced": a transfer already waiting for a buffer gets the one made
    in its place as soon as the retired one goes (the test above waits for the pool to be idle first; audit,
    2026-12-07: it passed with the pool counting the buffer gone but waking no one)."""
    pool = StagingPool(4096, 1)
    buf = await pool.acquire()
    pool.retire(buf)
    waiting = asyncio.ensure_future(pool.acquire())
    await asyncio.sleep(0)  # it runs up to its wait: the pool's one buffer is retired, not gone
    assert not waiting.done() and pool.live == 1
    del buf
    gc.collect()
    assert (await asyncio.wait_for(waiting, 1.0)).numel() == 4096 and pool.live == 1


async def test_a_staged_receive_whose_engine_closes_between_a_fill_and_its_scatter_returns():
    """finalize's close (``Runtime.close``: ``Completions.close``) that runs after a chunk came in but before the
    pipeline scatters it: the scatter is refused ("the transfer engine is closed") before anything is queued, and
    the receive fails with that. Before, the scatter's ``settled`` future was listed before ``Completions.start``
    refused it and was never set: the receive waited for it for ever, through cancels (``settle_all``)."""
    from peers import endpoint

    async with endpoint(LLMRole.DECODER, DECODER_ID, **HOST) as dd:
        rt = runtime_of(dd)
        staging = DeviceStaging(rt.completions, rt.devices, chunk_bytes=4096, buffers=4)
        cache = dd.kv_cache_manager.allocate_blocks_cache(BLOCKS)
        loop = asyncio.get_running_loop()

        def fill(chunk, view):
            fut = loop.create_future()
            view.fill_(7)
            loop.call_soon(fut.set_result, view.numel())  # the chunk is in ...
            loop.call_soon(rt.completions.close)  # ... and the engine closes before the pipeline resumes
            return fut

        task = asyncio.ensure_future(staging.receive(cache, 0, 4, list(range(6)), 0, 3 * 512 * 2, fill))
        done, _ = await asyncio.wait([task], timeout=2)
        if not done:
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=1)
            coro = task.get_coro()  # let the stuck wait go, for the teardown
            while coro is not None:
                if getattr(coro, "cr_code", None) is not None and coro.cr_code.co_name == "settle_all":
                    for fut in coro.cr_frame.f_locals["futures"]:
                        if not fut.done():
                            fut.set_result(None)
                coro = getattr(coro, "cr_await", None)
            await asyncio.wait([task], timeout=1)
            raise AssertionError(f"the staged receive did not return within 2 s (nor 1 s after a cancel: {not done})")
        with pytest.raises(LLMException) as info:
            task.result()
        assert info.value.status_code == S.LLM_FAILED and "closed" in str(info.value)
        staging.close()
