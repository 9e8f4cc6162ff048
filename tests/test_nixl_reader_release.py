"""A NIXL pull into a registered destination that the caller releases lands nothing after the release returned.

The reader (a pull without asking, ``transport/nixl_plane._read``) reads nothing into a destination released while
it awaited its loop turn or its ledger word (row 269): there it runs against a stand-in peer that answers the word at
once and records the READ it is asked to post, so the reader's own checks are what is under test. Before, a release
in the reader's first loop turn went unseen and the READ was posted into memory the caller had back.

A READ already posted, asked or not, is stopped by the release (row 282), over real NIXL: the engine posts it in
pieces, each posting slowed so that the release lands while our worker moves one. Before, the release returned at
once and the READ went on writing the caller's memory, and the pull succeeded.
"""

from __future__ import annotations

import asyncio
import threading
import time
import types
from typing import Any

import pytest
import torch

from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMException, LLMStatusCode, Placement
from aio_datadist.testing import link_to, nixl_agent_of, registry_of
from aio_datadist.transport import nixl_engine, nixl_plane

from peers import NIXL_MISSING, PROMPT_ID, linked_pair
from test_nixl_cuts import slow_posting

needs_nixl = pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING)

WORD = 7
CACHE_ID = 3


class StandInPeer:
    """What ``_read`` asks of a NIXL peer: a granted cache, a ledger word that holds, READs done at once."""

    def __init__(self, region: object) -> None:
        self.caches = {CACHE_ID: region}
        self.ledger = object()
        self.agent = types.SimpleNamespace(scratch=[WORD], take_scratch=lambda: 0, give_scratch=lambda index: None)
        self.granted = types.SimpleNamespace(read_ended=lambda cache_id: None, tell_read=lambda *args: None)
        self.posted: list[tuple] = []

    def usable(self) -> bool:
        return True

    def read_started(self, cache_id: int) -> bool:
        return True

    def read_word(self, index: int, slot: int, what: str) -> None:
        return None  # done inside the posting call

    def read_rows(self, *args: object) -> None:
        self.posted.append(args)
        return None


SMALL_BLOCKS = CacheDesc(2, (4, 256), DataType.DT_FLOAT16, Placement.HOST)


def registered_destination(pair: Any) -> tuple[list[torch.Tensor], Any, Any, Any]:
    """A blocks cache the decoder registered over its own tensors, as a read without asking's destination:
    ``(its tensors, the cache, the plan of a one-row read into it, the owner's granted region)``."""
    mine = [torch.zeros(SMALL_BLOCKS.shape, dtype=torch.float16) for _ in range(SMALL_BLOCKS.num_tensors)]
    dst = pair.dm.register_blocks_cache(SMALL_BLOCKS, mine, BlocksCacheKey(2, 0))
    plan = types.SimpleNamespace(local=dst, local_first=0, local_rows=[0], total=512)
    return mine, dst, plan, types.SimpleNamespace(cache_id=CACHE_ID)


@pytest.mark.asyncio
async def test_a_destination_released_in_the_readers_first_turn_gets_no_read() -> None:
    async with linked_pair(link=False) as pair:
        mine, dst, plan, region = registered_destination(pair)
        peer = StandInPeer(region)
        registry = registry_of(pair.decoder)
        read = asyncio.ensure_future(nixl_plane._read(registry, peer, plan, region, 0, WORD, 0, [1], 2, 1000, "pull"))
        await asyncio.sleep(0)  # the reader waits for its loop turn
        pair.dm.deallocate_cache(dst)
        with pytest.raises(LLMException) as info:
            await asyncio.wait_for(read, 5)
        assert info.value.status_code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        assert peer.posted == []

        again = pair.dm.register_blocks_cache(SMALL_BLOCKS, mine, BlocksCacheKey(2, 0))  # alive: the READ is posted
        plan.local = again
        assert await asyncio.wait_for(nixl_plane._read(registry, peer, plan, region, 0, WORD, 0, [1], 2, 1000, "pull"),
                                      5)
        assert len(peer.posted) == 1


class SlowWordPeer(StandInPeer):
    """A stand-in whose ledger word's READ stays in progress until the test ends it (``word``)."""

    def __init__(self, region: Any) -> None:
        super().__init__(region)
        self.word_posted = asyncio.Event()
        self.word: tuple[asyncio.Future, asyncio.Future] | None = None

    def read_word(self, index: int, slot: int, what: str) -> Any:
        loop = asyncio.get_running_loop()
        moved, settled = loop.create_future(), loop.create_future()
        self.word = (moved, settled)
        self.word_posted.set()
        return moved, settled, str


@pytest.mark.asyncio
async def test_a_destination_released_while_the_reader_awaits_the_ledger_word_gets_no_read() -> None:
    """Row 269's second clause: released while the reader waits for its owner's ledger word, the destination gets
    no READ (the test above answers the word at once, so only the first turn was tested: found by audit,
    2026-12-06; with the check moved before the word's wait, a READ was posted into the released memory)."""
    async with linked_pair(link=False) as pair:
        _, dst, plan, region = registered_destination(pair)
        peer = SlowWordPeer(region)
        peer.granted.nudge = lambda: None
        read = asyncio.ensure_future(nixl_plane._read(registry_of(pair.decoder), peer, plan, region, 0, WORD, 0, [1],
                                                      2, 1000, "pull"))
        await asyncio.wait_for(peer.word_posted.wait(), 5)  # past its first turn: the word's READ in progress
        assert not read.done() and peer.word is not None
        pair.dm.deallocate_cache(dst)
        moved, settled = peer.word
        moved.set_result(None)
        settled.set_result(None)
        with pytest.raises(LLMException) as info:
            await asyncio.wait_for(read, 5)
        assert info.value.status_code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        assert peer.posted == [], "a READ was posted into a destination released while the word was read"


NIXL = {"transport": "nixl"}
BIG = CacheDesc(2, (64, 256 * 1024), DataType.DT_INT8, Placement.HOST)  # 2 x 16 MiB: posted by the worker
ALL = list(range(64))
PIECES = 8  # of 4 MiB


async def granted_into_registered(pair: Any) -> tuple[list[torch.Tensor], Any, Any]:
    """The prompt's ``BIG`` blocks cache (9s), granted to the decoder; the decoder's registered destination:
    its memory (0s), the cache, and its NIXL agent, once everything is prepared for a pull without asking."""
    src = pair.pm.allocate_blocks_cache(BIG, BlocksCacheKey(PROMPT_ID))
    for t in src.tensors:
        t.fill_(9)
    mine = [torch.zeros(BIG.shape, dtype=torch.int8) for _ in range(BIG.num_tensors)]
    dst = pair.dm.register_blocks_cache(BIG, mine, BlocksCacheKey(2, 0))
    agent = nixl_agent_of(pair.decoder)
    await agent.registered(dst)
    peer = link_to(pair.decoder, PROMPT_ID).nixl
    async with asyncio.timeout(5):
        while peer.grant_for(BlocksCacheKey(PROMPT_ID).model_id) is None or src.cache_id not in peer.caches:
            await asyncio.sleep(0.005)
    return mine, dst, agent


@needs_nixl
@pytest.mark.nixl
@pytest.mark.asyncio
@pytest.mark.parametrize("asked", [False, True], ids=["without-asking", "asked"])
async def test_a_read_in_flight_into_a_released_destination_stops_before_the_release_returns(asked, monkeypatch):
    monkeypatch.setattr(nixl_engine, "CHUNK_BYTES", BIG.shape[0] * BIG.shape[1] * 2 // PIECES)
    if asked:
        monkeypatch.setattr(nixl_plane.NixlPlane, "reader", lambda *args: None)
    async with linked_pair(prompt_config=NIXL, decoder_config=NIXL) as pair:
        mine, dst, agent = await granted_into_registered(pair)
        calls = slow_posting(monkeypatch, agent.engine, 0.05)  # calls[0]: its switch; then each piece's start
        pull = asyncio.create_task(pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, ALL, ALL))
        async with asyncio.timeout(5):
            while len(calls) < 2:  # our worker posts the first piece
                await asyncio.sleep(0.001)
        pair.dm.deallocate_cache(dst)
        for t in mine:
            t.fill_(5)  # the caller reuses its memory at once
        with pytest.raises(LLMException) as info:
            await asyncio.wait_for(pull, 5)
        assert info.value.status_code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, info.value
        await asyncio.sleep(0.1)  # two more pieces' time
        assert all(bool((t == 5).all()) for t in mine)
        assert len(calls) == 2  # no piece posted after the release
        assert agent.engine.in_flight() == 0

        again = pair.dm.register_blocks_cache(BIG, mine, BlocksCacheKey(2, 0))  # the link goes on
        await agent.registered(again)
        await asyncio.wait_for(pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), again, ALL, ALL), 5)
        assert all(bool((t == 9).all()) for t in mine)


@needs_nixl
@pytest.mark.nixl
@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_read_whose_rows_all_landed_before_its_task_woke_fails_when_released_meanwhile(monkeypatch):
    """Row 282: every row of the READ landed, and the destination is released before the pull's task goes on
    (its memory is the caller's again): the pull fails ``LLM_KV_CACHE_NOT_EXIST``, never ``LLM_SUCCESS``."""
    async with linked_pair(prompt_config=NIXL, decoder_config=NIXL) as pair:
        mine, dst, agent = await granted_into_registered(pair)
        real, released = nixl_plane._settled, []

        async def settled_then_released(posted: Any, *args: Any) -> None:
            await real(posted, *args)
            if posted[0].result() > 8:  # the rows' READ (not the ledger word's): every row landed
                pair.dm.deallocate_cache(dst)  # in the pass the READ settled, before the pull's task goes on
                released.append(True)

        monkeypatch.setattr(nixl_plane, "_settled", settled_then_released)
        with pytest.raises(LLMException) as info:
            await asyncio.wait_for(pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, ALL, ALL), 5)
        assert released, "the READ was not left in progress: nothing tested"
        assert info.value.status_code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, info.value


@needs_nixl
@pytest.mark.nixl
@pytest.mark.asyncio(loop_factories=["asyncio"])  # the engine's waits do not depend on the loop
async def test_a_release_of_a_read_still_queued_behind_a_long_worker_call_returns_at_once(caplog: Any) -> None:
    """Our NIXL worker is in a long call (a large registration, a metadata load: 1.2 s here) with the rows' READ
    queued behind it in the same batch when the destination is released: the READ is cancelled, so it is never
    posted, and the release returns at once; the pull, whose time also ran out meanwhile, fails
    ``LLM_KV_CACHE_NOT_EXIST``, the release's doing. Before, the halt waited for the unrelated call (the loop
    held 1 s, then the peer's agent let go of and an error logged past 2 s), and the pull read ``LLM_TIMEOUT``
    (both found by review of row 282)."""
    async with linked_pair(prompt_config=NIXL, decoder_config=NIXL) as pair:
        mine, dst, agent = await granted_into_registered(pair)
        engine, inside, busy = agent.engine, threading.Event(), []
        real_xfer = engine.xfer

        def slow(_agent: Any) -> None:
            inside.set()
            time.sleep(1.2)

        def xfer(token: int, op: str, local: Any, local_idx: Any, remote: Any, remote_idx: Any, peer_name: bytes,
                 notif: bytes, nbytes: int, counted: bool = True) -> Any:
            args = (token, op, local, local_idx, remote, remote_idx, peer_name, notif, nbytes, counted)
            if nbytes > 8 and not busy:  # the rows' READ (not a ledger word): a long call goes just ahead of it
                with engine._cv:
                    busy.append(agent.run(lambda t: engine.call(t, slow), "slow call"))
                    return real_xfer(*args)
            return real_xfer(*args)

        engine.xfer = xfer
        pull = asyncio.create_task(pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, list(range(64)),
                                                       list(range(64)), timeout=1000))
        async with asyncio.timeout(5):
            while not inside.is_set():
                await asyncio.sleep(0.001)
        started = time.monotonic()
        pair.dm.deallocate_cache(dst)
        held = time.monotonic() - started
        for t in mine:
            t.fill_(5)
        with pytest.raises(LLMException) as info:
            await asyncio.wait_for(pull, 10)
        await asyncio.wait_for(busy[0], 10)
        await asyncio.sleep(0.1)
        assert info.value.status_code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, info.value
        assert held < 0.5, f"the release held the loop {held:.2f} s"
        assert all(bool((t == 5).all()) for t in mine)
        assert not [r for r in caplog.records if r.levelno >= 40], caplog.records
