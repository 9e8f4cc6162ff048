"""NIXL transfers cut by a timeout: nothing of them moves after the call returned.

UCX over shared memory copies a transfer inside NIXL's posting call, which
cannot be interrupted: the engine posts a large transfer in pieces
(``nixl_engine.CHUNK_BYTES``), posts no piece after a cut, and the cut call
waits for the piece in progress however long it takes (``NIXL_SETTLE_LIMIT_S``
at most). Here the posting is slowed by a hook on the agent, as a cold
destination (pages the framework never touched) or a loaded host slows it.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from typing import Any

import pytest

from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMException, LLMStatusCode, Placement
from aio_datadist.testing import link_to, nixl_agent_of
from aio_datadist.transport import base, nixl_engine, nixl_plane
from peers import DECODER_ID, NIXL_MISSING, PROMPT_ID, linked_pair, same, snapshot

S = LLMStatusCode
NIXL = {"transport": "nixl"}
BIG = CacheDesc(2, (64, 256 * 1024), DataType.DT_INT8, Placement.HOST)  # 2 x 16 MiB: posted by the worker
ALL = list(range(64))

pytestmark = [pytest.mark.asyncio, pytest.mark.nixl, pytest.mark.usefixtures("fork_server"),
              pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING)]


def slow_posting(monkeypatch: Any, engine: Any, delay_s: float) -> list[float]:
    """NIXL's posting call, on ``engine``'s worker and for more than one row, takes ``delay_s`` longer (before it
    copies) while the returned list's first entry is not 0; each such call appends its start."""
    kind = type(engine.agent)
    real_make, real_transfer = kind.make_prepped_xfer, kind.transfer
    worker = weakref.ref(engine._thread)
    rows: set[int] = set()
    calls: list[float] = [1.0]

    def make_prepped_xfer(self, op, local, local_idx, *args, **kwargs):
        handle = real_make(self, op, local, local_idx, *args, **kwargs)
        if len(local_idx) > 1:
            rows.add(id(handle))
        return handle

    def transfer(self, handle, *args, **kwargs):
        if calls[0] and id(handle) in rows and threading.current_thread() is worker():
            calls.append(time.monotonic())
            time.sleep(delay_s)
        return real_transfer(self, handle, *args, **kwargs)

    monkeypatch.setattr(kind, "make_prepped_xfer", make_prepped_xfer)
    monkeypatch.setattr(kind, "transfer", transfer)
    return calls


async def big_pair_caches(pair: Any, pull: bool) -> tuple[Any, Any, Any]:
    """``(source, destination, the moving end's NIXL engine)`` for a pull the decoder reads without asking, or a
    push of the prompt; the source holds 9s, the destination 0s."""
    if pull:
        src = pair.pm.allocate_blocks_cache(BIG, BlocksCacheKey(PROMPT_ID))
        dst = pair.dm.allocate_blocks_cache(BIG)
        peer = link_to(pair.decoder, PROMPT_ID).nixl
        async with asyncio.timeout(5):
            while peer.grant_for(BlocksCacheKey(PROMPT_ID).model_id) is None:
                await asyncio.sleep(0.005)
    else:
        src = pair.pm.allocate_blocks_cache(BIG)
        dst = pair.dm.allocate_blocks_cache(BIG, BlocksCacheKey(DECODER_ID))
        peer = link_to(pair.decoder, PROMPT_ID).nixl
        async with asyncio.timeout(5):
            while dst.cache_id not in peer.prepared:
                await asyncio.sleep(0.005)
    for t in src.tensors:
        t.fill_(9)
    return src, dst, nixl_agent_of(pair.decoder if pull else pair.prompt).engine


def move(pair: Any, pull: bool, src: Any, dst: Any, timeout: int | None = None) -> Any:
    if pull:
        return pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, ALL, ALL, timeout=timeout)
    return pair.pm.push_blocks(BlocksCacheKey(DECODER_ID), src, ALL, ALL, timeout=timeout)


@pytest.mark.parametrize("pull", [True, False], ids=["read-without-asking", "push"])
async def test_a_cut_transfer_whose_posting_outlasts_the_settle_bound_moves_no_byte_after_the_call_returned(
        pull, monkeypatch):
    monkeypatch.setattr(base, "NIXL_SETTLE_S", 0.2)
    monkeypatch.setattr(nixl_plane, "NIXL_SETTLE_S", 0.2, raising=False)
    async with linked_pair(prompt_config=NIXL, decoder_config=NIXL) as pair:
        src, dst, engine = await big_pair_caches(pair, pull)
        calls = slow_posting(monkeypatch, engine, 0.6)  # past the settle bound
        started = time.monotonic()
        call = asyncio.create_task(move(pair, pull, src, dst, timeout=100))
        async with asyncio.timeout(5):
            while len(calls) < 2:
                await asyncio.sleep(0.005)
        assert engine.in_flight() > 0  # a transfer being posted is in flight
        with pytest.raises(LLMException) as exc:
            await call
        assert exc.value.status_code == S.LLM_TIMEOUT, exc.value
        assert time.monotonic() - started < 5  # the slowed posting's end, not NIXL_SETTLE_LIMIT_S
        assert engine.in_flight() == 0
        for t in src.tensors:
            t.fill_(3)  # the caller reuses its source at once
        before = snapshot(dst)
        await asyncio.sleep(0.8)  # past the end of the slowed posting
        assert same(snapshot(dst), before)
        assert not any(bool((t == 3).any()) for t in dst.tensors)
        calls[0] = 0
        await move(pair, pull, src, dst)  # the link goes on
        assert all(bool((t == 3).all()) for t in dst.tensors)


@pytest.mark.parametrize("pull", [True, False], ids=["read-without-asking", "push"])
async def test_a_cut_transfer_posts_no_piece_after_the_cut(pull, monkeypatch):
    monkeypatch.setattr(nixl_engine, "CHUNK_BYTES", 4 << 20, raising=False)  # 32 MiB: 8 pieces
    async with linked_pair(prompt_config=NIXL, decoder_config=NIXL) as pair:
        src, dst, engine = await big_pair_caches(pair, pull)
        calls = slow_posting(monkeypatch, engine, 0.15)
        with pytest.raises(LLMException) as exc:
            await move(pair, pull, src, dst, timeout=100)
        assert exc.value.status_code == S.LLM_TIMEOUT, exc.value
        assert engine.in_flight() == 0
        before = snapshot(dst)
        await asyncio.sleep(0.3)
        assert same(snapshot(dst), before)
        assert 1 <= len(calls) - 1 < 8  # stopped between pieces
        assert any(bool((t == 0).any()) for t in dst.tensors)  # the rows of pieces never posted
        calls[0] = 0
        await move(pair, pull, src, dst)
        assert all(bool((t == 9).all()) for t in dst.tensors)
        assert engine.in_flight() == 0
