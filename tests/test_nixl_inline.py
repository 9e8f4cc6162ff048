"""Who posts a NIXL transfer, and a pull's ``DONE`` that rides with the next record.

A transfer of at most ``nixl_engine.INLINE_MAX`` bytes is posted from the
loop's thread when the NIXL worker is not inside the agent; otherwise, or when
NIXL leaves it in progress, the worker takes it. A pull that consumes a key
writes its ``DONE`` as it returns (row 272); another pull's ``DONE`` is written
at the end of the loop pass that returned it, or with the next record sent on
the link before then, ahead of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from aio_datadist import wire
from aio_datadist import (BlocksCacheKey, CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType, LLMException,
                          LLMStatusCode, Placement)
from aio_datadist.testing import link_to, nixl_agent_of
from aio_datadist.wire import Msg
from peers import DECODER_ID, NIXL_MISSING, PROMPT_ID, fill, linked_pair, same, snapshot

S = LLMStatusCode
NIXL = {"transport": "nixl"}
BLOCKS = CacheDesc(4, (16, 4, 64), DataType.DT_FLOAT16, Placement.HOST)  # 16 blocks of 512 B
ROWS = CacheDesc(2, (3, 256), DataType.DT_FLOAT16, Placement.HOST)
BUSY_S = 0.3

needs_nixl = pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING)

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("fork_server")]


async def prepared(owner, peer_id: int, cache) -> None:
    peer = link_to(owner, peer_id).nixl
    async with asyncio.timeout(5):
        while cache.cache_id not in peer.prepared:
            await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def blocks_pair(seed: int) -> AsyncIterator[tuple[Any, Any, Any, Any]]:
    """A NIXL pair, the prompt's blocks cache filled with ``seed`` and prepared by the decoder, the decoder's empty
    one: ``(pair, want, dst, the decoder's NIXL engine)``."""
    async with linked_pair(prompt_config=NIXL, decoder_config=NIXL) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID))
        want = fill(src, seed)
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        await prepared(pair.prompt, DECODER_ID, src)
        yield pair, want, dst, nixl_agent_of(pair.decoder).engine


def worker_posts(dd) -> list[int]:
    """Count the transfers ``dd``'s NIXL worker posts itself (not the loop)."""
    engine = nixl_agent_of(dd).engine
    start, posts = engine._start, []

    def counted(token, *args):
        posts.append(token)
        return start(token, *args)

    engine._start = counted
    return posts


def occupy_worker(dd, seconds: float) -> None:
    """Keep ``dd``'s NIXL worker inside the agent for ``seconds`` (as a slow registration would)."""
    nixl_agent_of(dd).engine.call(0, lambda agent: time.sleep(seconds))


async def cancelled_while_left_in_progress(dd, engine, start: Callable[[], Awaitable[Any]]) -> tuple[float, int]:
    """The transfer ``start()`` makes, which NIXL leaves in progress (``PROC``) while ``dd``'s worker is busy
    (``BUSY_S``), cancelled once NIXL took it: how long the cancel took, and how many transfers ``engine`` still
    held when it returned."""
    agent, real_transfer, adopted = engine.agent, engine.agent.transfer, []

    def in_progress(handle, notif=b""):  # on the loop's thread, inside try_post
        state = real_transfer(handle, notif)
        occupy_worker(dd, BUSY_S)  # the worker is busy when the handle is handed over
        adopted.append(state)
        return "PROC"

    agent.transfer = in_progress
    try:
        task = asyncio.create_task(start())
        async with asyncio.timeout(5):
            while not adopted:
                await asyncio.sleep(0.005)
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - started, engine.in_flight()
    finally:
        agent.transfer = real_transfer


@needs_nixl
@pytest.mark.nixl
async def test_a_pull_is_posted_from_the_loop_while_the_worker_is_idle_and_by_the_worker_while_it_is_busy():
    async with blocks_pair(3) as (pair, want, dst, engine):
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [0], [0])  # the link's first READ wires UCX up
        await asyncio.sleep(0.05)  # the worker is idle again
        posts = worker_posts(pair.decoder)
        before = engine.posted
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, list(range(8)), list(range(8)))
        assert engine.posted == before + 1 and posts == []  # the loop posted it; NIXL finished it in the call

        occupy_worker(pair.decoder, BUSY_S)
        await asyncio.sleep(0.05)  # the worker is inside the agent now
        started = time.monotonic()
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, list(range(8, 16)), list(range(8, 16)))
        assert posts  # the loop did not wait for the agent: the worker posted (the first READ) once free
        assert time.monotonic() - started >= BUSY_S / 2
        assert same(snapshot(dst), want)
        assert engine.in_flight() == 0


@needs_nixl
@pytest.mark.nixl
async def test_a_transfer_left_in_progress_is_settled_by_the_worker_before_its_cancelled_pull_returns():
    """NIXL may return from the posting call with the transfer still moving (``PROC``): the worker adopts the
    handle. A pull given up meanwhile returns only once the worker saw NIXL let go of it, even when the
    worker is busy elsewhere when the handle reaches it; then the link moves verified bytes again."""
    async with blocks_pair(5) as (pair, want, dst, engine):
        waited, in_flight = await cancelled_while_left_in_progress(
            pair.decoder, engine, lambda: pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [1, 2], [1, 2]))
        assert waited >= BUSY_S / 2, waited  # it waited for the worker to take and settle the handle
        assert in_flight == 0
        for t in dst.tensors:
            t.zero_()
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, list(range(16)), list(range(16)))
        assert same(snapshot(dst), want)


@needs_nixl
@pytest.mark.nixl
async def test_a_write_left_in_progress_is_settled_before_its_cancelled_push_returns():
    """As above for a push: its WRITE left in progress by NIXL (``PROC``) while the prompt's worker is busy, the
    push is cancelled, and it returns only once NIXL let go of the WRITE; then the link moves verified bytes
    again. Over UCX shared memory NIXL finishes a WRITE inside the posting call, so the cut push's own wait was
    unreached by every test until an audit, 2026-12-07."""
    async with linked_pair(prompt_config=NIXL, decoder_config=NIXL) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS)
        want = fill(src, 5)
        dst = pair.dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID))
        await prepared(pair.decoder, PROMPT_ID, dst)
        owner, serving_at_return = link_to(pair.decoder, PROMPT_ID), []

        async def push() -> None:
            try:
                await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID), src, [1, 2], [1, 2])
            finally:  # as it returns, no loop step later
                serving_at_return.append(set(owner.serving))

        occupy_worker(pair.decoder, BUSY_S)  # the owner hears of the WRITE late: the cut push's DONE comes first
        waited, in_flight = await cancelled_while_left_in_progress(pair.prompt, nixl_agent_of(pair.prompt).engine,
                                                                   push)
        assert in_flight == 0, "the cut push returned with its WRITE still in NIXL's hands"
        assert serving_at_return == [set()], "the cut push returned before the owner answered its failure DONE"
        assert waited >= BUSY_S / 2, waited
        for t in dst.tensors:
            t.zero_()
        await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID), src, list(range(16)), list(range(16)))
        assert same(snapshot(dst), want)


@needs_nixl
@pytest.mark.nixl
async def test_a_transfer_left_in_progress_completes_the_pull_once_the_worker_sees_it_done():
    async with blocks_pair(6) as (pair, want, dst, engine):
        real_transfer = engine.agent.transfer
        engine.agent.transfer = lambda handle, notif=b"": (real_transfer(handle, notif), "PROC")[1]
        try:
            await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, list(range(16)), list(range(16)))
        finally:
            engine.agent.transfer = real_transfer
        assert same(snapshot(dst), want)
        assert engine.in_flight() == 0


@needs_nixl
@pytest.mark.nixl
async def test_a_nixl_post_that_fails_on_the_loop_fails_the_pull_as_a_link_failure_and_posts_nothing():
    async with blocks_pair(7) as (pair, _want, dst, engine):
        real_transfer, before = engine.agent.transfer, engine.posted

        def refused(handle, notif=b""):
            raise RuntimeError("NIXL_ERR_BACKEND (injected)")

        engine.agent.transfer = refused
        try:
            with pytest.raises(LLMException) as info:
                await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [0], [0])
        finally:
            engine.agent.transfer = real_transfer
        assert info.value.status_code == S.LLM_LINK_FAILED
        assert "NIXL_ERR_BACKEND (injected)" in str(info.value)
        assert engine.posted == before and engine.in_flight() == 0
        served = link_to(pair.prompt, DECODER_ID)
        async with asyncio.timeout(5):  # the owner heard the pull was abandoned
            while served.serving:
                await asyncio.sleep(0.01)


@pytest.mark.parametrize("transport", [pytest.param("nixl", marks=[needs_nixl, pytest.mark.nixl]), "local"])
async def test_a_pulls_done_reaches_the_owner_before_whatever_the_caller_sends_next(transport):
    """The ``DONE`` of a pull by key (in place: NIXL, same-host), written as it returns (row 272), reaches the
    owner ahead of whatever follows. A pull followed at once by an unlink still consumes the key, and with
    nothing following, the owner still hears of it: its request is over, the cache's hold gone."""
    config = {"transport": transport}
    async with linked_pair(prompt_config=config, decoder_config=config) as pair:
        src = pair.pm.allocate_cache(ROWS, [CacheKey(PROMPT_ID, 1), CacheKey(PROMPT_ID, 2), CacheKey(PROMPT_ID, 3)])
        want = fill(src, 8)
        dst = pair.dm.allocate_cache(ROWS)
        owner = link_to(pair.prompt, DECODER_ID)
        if transport == "nixl":
            await prepared(pair.prompt, DECODER_ID, src)
        await pair.dm.pull_cache(CacheKey(PROMPT_ID, 1), dst, batch_index=0)
        async with asyncio.timeout(5):  # nothing followed: written at the end of the loop pass
            while owner.serving:
                await asyncio.sleep(0.01)
        await pair.dm.pull_cache(CacheKey(PROMPT_ID, 2), dst, batch_index=1)
        stats = pair.decoder.stats().links[PROMPT_ID].kinds["pull"]
        assert stats.transport == transport, stats
        await pair.unlink()  # in the same step as the pull's return: the UNLINK follows its DONE
        await pair.link()
        with pytest.raises(LLMException) as info:
            await pair.dm.pull_cache(CacheKey(PROMPT_ID, 2), dst, batch_index=2)
        assert info.value.status_code == S.LLM_KV_CACHE_NOT_EXIST  # consumed by the first link's DONE
        await pair.dm.pull_cache(CacheKey(PROMPT_ID, 3), dst, batch_index=2)
        assert same(snapshot(dst), want)


def records(data: bytes) -> list[tuple[Msg, int]]:
    """The (message, request id) of each record in ``data``, a run of whole records."""
    out, at = [], 0
    while at < len(data):
        _magic, _version, msg, _flags, req_id, body = wire.HEADER.unpack_from(data, at)
        out.append((Msg(msg), req_id))
        at += wire.HEADER.size + body
    return out


@pytest.mark.parametrize("transport", [pytest.param("nixl", marks=[needs_nixl, pytest.mark.nixl]), "local"])
async def test_a_pulls_done_goes_out_ahead_of_the_next_request_in_one_write_when_sent_in_the_same_pass(transport):
    """A pull that consumes its key writes its DONE before it returns, on its own (row 272; before, it waited for
    the end of the pass or went in one write with the next request), ahead of the next request either way."""
    config = {"transport": transport}
    async with linked_pair(prompt_config=config, decoder_config=config) as pair:
        src = pair.pm.allocate_cache(ROWS, [CacheKey(PROMPT_ID, 1), CacheKey(PROMPT_ID, 2)])
        fill(src, 9)
        dst = pair.dm.allocate_cache(ROWS)
        if transport == "nixl":
            await prepared(pair.prompt, DECODER_ID, src)
        link = link_to(pair.decoder, PROMPT_ID)
        writes: list[list[tuple[Msg, int]]] = []
        real_write = link.writer.write
        link.writer.write = lambda data: (writes.append(records(bytes(data))), real_write(data))[1]
        try:
            await pair.dm.pull_cache(CacheKey(PROMPT_ID, 1), dst, batch_index=0)
            # by id and index: consumes the key of row 1 too, so its DONE is written before the pull returns
            await pair.dm.pull_cache(CacheKeyByIdAndIndex(PROMPT_ID, src.cache_id, 1), dst, batch_index=1)
            assert writes and writes[-1][-1][0] is Msg.DONE, writes
            await asyncio.sleep(0.05)
        finally:
            link.writer.write = real_write
        sent = [r for w in writes for r in w]
        (_, first), (_, second) = [r for r in sent if r[0] is Msg.PULL_REQ]
        done = [(m, i) for m, i in sent if m is Msg.DONE]
        assert [i for _, i in done] == [first, second], sent
        assert sent.index((Msg.DONE, first)) < sent.index((Msg.PULL_REQ, second)), sent
        assert [(Msg.DONE, first)] in writes, writes  # written at the return, not held for the next record


@pytest.mark.parametrize("transport", [pytest.param("nixl", marks=[needs_nixl, pytest.mark.nixl]), "local"])
async def test_a_held_done_goes_out_ahead_of_the_next_request_in_its_write(transport):
    """A pull that consumes no key (a prefix key) holds its ``DONE`` to the end of the pass (row 272); the next
    request, sent in that pass, takes it along ahead of itself in one write. (The test above pulls keys, whose
    DONE leaves at once: it passed with the held records written after the next one, audit 2026-12-07.)"""
    config = {"transport": transport}
    async with linked_pair(prompt_config=config, decoder_config=config) as pair:
        prefix = CacheKey(PROMPT_ID, 2**64 - 1, prefix_id=7)
        src = pair.pm.allocate_cache(ROWS, [prefix])
        fill(src, 12)
        dst = pair.dm.allocate_cache(ROWS)
        if transport == "nixl":
            await prepared(pair.prompt, DECODER_ID, src)
        link = link_to(pair.decoder, PROMPT_ID)
        writes: list[list[tuple[Msg, int]]] = []
        real_write = link.writer.write
        link.writer.write = lambda data: (writes.append(records(bytes(data))), real_write(data))[1]
        try:
            await pair.dm.pull_cache(prefix, dst, batch_index=0)
            assert link._soon  # held
            await pair.dm.pull_cache(prefix, dst, batch_index=1)
            await asyncio.sleep(0)  # nothing followed: it went out on its own at the end of that pass (found by audit)
            assert not link._soon and [m for m, _ in writes[-1]] == [Msg.DONE], writes
            await asyncio.sleep(0.05)
        finally:
            link.writer.write = real_write
        sent = [r for w in writes for r in w]
        (_, first), (_, second) = [r for r in sent if r[0] is Msg.PULL_REQ]
        assert [(Msg.DONE, first), (Msg.PULL_REQ, second)] in writes, writes


@needs_nixl
@pytest.mark.nixl
async def test_a_push_whose_notification_the_owner_reads_before_its_expectation_reached_the_worker_completes():
    """The owner registers a push's expectation (``expect_notif``, a command for its worker) and answers; the
    worker may be in a round whose commands it took before that, and that round's progress may read the
    push's notification (a pusher posting from its loop gets there the sooner). It is kept for the
    expectation that follows: before, it was dropped as unexpected and the push timed out. The owner's
    rounds are stretched here as on a loaded host (each progress call spread over 40 ms)."""
    async with linked_pair(link=False, prompt_config=NIXL, decoder_config=NIXL) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID))
        dst = pair.dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID))
        want = fill(src, 10)
        await pair.link()
        await prepared(pair.prompt, DECODER_ID, src)
        await prepared(pair.decoder, PROMPT_ID, dst)
        engine = nixl_agent_of(pair.decoder).engine
        real = engine.agent.get_new_notifs

        def slow_round() -> dict:  # on the owner's worker
            out: dict = {}
            for _ in range(8):
                for peer, messages in real().items():
                    out.setdefault(peer, []).extend(messages)
                time.sleep(0.005)
            return out

        engine.agent.get_new_notifs = slow_round
        engine.hold()  # a peer's transfer against our memory is under way: the worker keeps progressing
        try:
            await asyncio.sleep(0.01)
            blocks = list(range(16))
            for block in blocks:
                await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID), src, [block], [block], timeout=2000)
            # At once: a round reads several early notifications, and every one is kept (found by audit).
            want = fill(src, 11)
            await asyncio.gather(*(pair.pm.push_blocks(BlocksCacheKey(DECODER_ID), src, [block], [block],
                                                       timeout=2000) for block in blocks))
        finally:
            engine.unhold()
            engine.agent.get_new_notifs = real
        assert same(snapshot(dst), want)


@pytest.mark.parametrize("transport", [pytest.param("nixl", marks=[needs_nixl, pytest.mark.nixl]), "local"])
async def test_a_held_done_still_reaches_the_owner_when_the_link_closes_in_the_same_pass(transport):
    """A link closed outright (no UNLINK first) in the loop pass its pull by key returned in: the owner consumes
    the key (the DONE left as the pull returned; one held to the end of the pass is written by the close: the
    next test)."""
    config = {"transport": transport}
    async with linked_pair(prompt_config=config, decoder_config=config) as pair:
        src = pair.pm.allocate_cache(ROWS, [CacheKey(PROMPT_ID, 1), CacheKey(PROMPT_ID, 2)])
        want = fill(src, 10)
        dst = pair.dm.allocate_cache(ROWS)
        if transport == "nixl":
            await prepared(pair.prompt, DECODER_ID, src)
        served = link_to(pair.prompt, DECODER_ID)
        link = link_to(pair.decoder, PROMPT_ID)
        await pair.dm.pull_cache(CacheKey(PROMPT_ID, 1), dst, batch_index=0)
        await link.close()  # the same pass: the DONE was still held
        async with asyncio.timeout(5):
            while not (served.closed or served.broken):
                await asyncio.sleep(0.01)
        await pair.unlink(force=True)
        await pair.link()
        with pytest.raises(LLMException) as info:
            await pair.dm.pull_cache(CacheKey(PROMPT_ID, 1), dst, batch_index=1)
        assert info.value.status_code == S.LLM_KV_CACHE_NOT_EXIST  # consumed by the DONE written at the close
        await pair.dm.pull_cache(CacheKey(PROMPT_ID, 2), dst, batch_index=1)
        assert same([t[:2] for t in snapshot(dst)], [w[:2] for w in want])


@pytest.mark.parametrize("transport", [pytest.param("nixl", marks=[needs_nixl, pytest.mark.nixl]), "local"])
async def test_a_held_done_of_a_pull_that_consumes_nothing_reaches_the_owner_when_the_link_closes(transport):
    """A pull that consumes no key (a prefix key here) holds its ``DONE`` to the end of the loop pass (row 272);
    a link closed outright in that pass still writes it: the owner counts the pull it served as a success,
    not as a request the link's end gave up."""
    config = {"transport": transport}
    async with linked_pair(prompt_config=config, decoder_config=config) as pair:
        prefix = CacheKey(PROMPT_ID, 2**64 - 1, prefix_id=7)
        src = pair.pm.allocate_cache(ROWS, [prefix])
        fill(src, 11)
        dst = pair.dm.allocate_cache(ROWS)
        if transport == "nixl":
            await prepared(pair.prompt, DECODER_ID, src)
        served, link = link_to(pair.prompt, DECODER_ID), link_to(pair.decoder, PROMPT_ID)
        await pair.dm.pull_cache(prefix, dst, batch_index=0)
        assert link._soon  # held
        await link.close()  # the same pass
        async with asyncio.timeout(5):
            while not (served.closed or served.broken):
                await asyncio.sleep(0.01)
        kind = served.stats().kinds["served_pull"]
        assert kind.transfers == 1 and not kind.failures, kind
        await pair.unlink(force=True)


@needs_nixl
@pytest.mark.nixl
async def test_a_transfer_whose_handle_fails_to_release_after_it_moved_its_bytes_still_succeeds(monkeypatch, caplog):
    """NIXL finished the READ inside the posting call, then releasing its handle raises: the bytes are in place,
    so the pull succeeds (a warning says what failed) instead of failing the link with ``LLM_LINK_FAILED``."""
    async with blocks_pair(7) as (pair, want, dst, engine):
        handle_type, failures = None, []
        real_make = engine.agent.make_prepped_xfer

        def make(*args, **kwargs):
            nonlocal handle_type
            handle = real_make(*args, **kwargs)
            if handle_type is None:
                handle_type = type(handle)
                real_release = handle_type.release

                def release(self):
                    if not failures and threading.current_thread() is threading.main_thread():  # in try_post
                        failures.append(self)
                        raise RuntimeError("NIXL could not release the handle")
                    real_release(self)

                monkeypatch.setattr(handle_type, "release", release)
            return handle

        monkeypatch.setattr(engine.agent, "make_prepped_xfer", make)
        with caplog.at_level("WARNING", logger="aio_datadist.nixl"):
            for _ in range(50):  # on a busy host the worker may hold the agent: the loop then hands the post over
                for t in dst.tensors:
                    t.zero_()
                await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, list(range(16)), list(range(16)))
                assert same(snapshot(dst), want)
                if failures:
                    break
        assert failures, "no transfer was posted and finished on the loop's thread"
        assert any("could not release" in r.getMessage() for r in caplog.records), caplog.text
        monkeypatch.undo()
        failures.pop().release()  # let NIXL have it back
        caplog.clear()  # the records hold the exception, and through its frames the handle and the agent
