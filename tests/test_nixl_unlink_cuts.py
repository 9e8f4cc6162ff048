"""A NIXL transfer of ours in flight when its link is unlinked, by us or by the peer, is cut by the unlink
(row 337): it fails ``LLM_NOT_YET_LINK`` by the time the unlink returned, as over the data channels, and NIXL has
let go of it before the peer hears of the unlink. No byte of it lands in our memory after it returned, and none
reads the peer's memory after the peer's unlink returned.

Before, the unlink did not touch it: a pull or push of ours waited out its own timeout (``LLM_TIMEOUT``), or a
pull returned success with bytes it read from the owner after the owner's unlink had returned and the owner
had written that memory again.

The READ or WRITE is held in NIXL's posting call by a hook on the agent (``test_nixl_cuts.slow_posting``), as a
large transfer or a loaded host holds it; over UCX's TCP transport the owner is another process.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest
from peers import (
    DECODER_ID,
    NIXL_MISSING,
    PROMPT_ID,
    EndpointSpec,
    cluster_info,
    linked_pair,
    same,
    snapshot,
)
from test_nixl_cuts import ALL, NIXL, big_pair_caches, granted_over_ucx_tcp, move, slow_posting

from aio_datadist import BlocksCacheKey, CacheDesc, CacheKey, DataType, LLMException, LLMStatusCode, Placement
from aio_datadist.testing import link_to, nixl_agent_of
from aio_datadist.transport import base, nixl_engine

S = LLMStatusCode
#: Rows of 16 MiB: a pull of one index is posted by the worker (past ``nixl_engine.INLINE_MAX``).
ASKED = CacheDesc(2, (2, 16 << 20), DataType.DT_INT8, Placement.HOST)
HELD_S = 0.5  # how long the hook holds the posting call

pytestmark = [pytest.mark.asyncio, pytest.mark.nixl, pytest.mark.usefixtures("fork_server"),
              pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING)]


async def _asked_caches(pair: Any) -> tuple[Any, Any, Any]:
    """A cache of the prompt's bound to ``CacheKey(PROMPT_ID, 1)`` (a pull of it asks the owner), filled with 9s,
    and an empty one of the decoder's; the decoder's NIXL engine."""
    src = pair.pm.allocate_cache(ASKED, [CacheKey(PROMPT_ID, 1), CacheKey(PROMPT_ID, 2)])
    dst = pair.dm.allocate_cache(ASKED)
    for t in src.tensors:
        t.fill_(9)
    peer = link_to(pair.decoder, PROMPT_ID).nixl
    async with asyncio.timeout(5):
        while src.cache_id not in peer.caches:
            await asyncio.sleep(0.005)
    return src, dst, nixl_agent_of(pair.decoder).engine


async def _drained(engine: Any) -> None:
    """The engine has nothing in flight: at once but for the link's own clean-up (its prepared lists and the peer's
    agent let go on the worker, queued as the link closed)."""
    async with asyncio.timeout(2):
        while engine.in_flight():
            await asyncio.sleep(0.01)


@pytest.mark.loops_take_turns
@pytest.mark.parametrize("who", ["we", "we-forced", "peer"])
@pytest.mark.parametrize("kind", ["read-without-asking", "asked-pull", "push"])
async def test_a_nixl_transfer_in_flight_is_cut_by_an_unlink_of_its_link(kind, who, monkeypatch):
    pull = kind != "push"
    async with linked_pair(prompt_config=NIXL, decoder_config=NIXL) as pair:
        if kind == "asked-pull":
            src, dst, engine = await _asked_caches(pair)
        else:
            src, dst, engine = await big_pair_caches(pair, pull)
        calls = slow_posting(monkeypatch, engine, HELD_S)
        started = time.monotonic()
        if kind == "asked-pull":
            call = asyncio.create_task(pair.dm.pull_cache(CacheKey(PROMPT_ID, 1), dst, 0, timeout=8000))
        else:
            call = asyncio.create_task(move(pair, pull, src, dst, timeout=8000))
        async with asyncio.timeout(5):
            while len(calls) < 2:  # the READ or WRITE is being posted
                await asyncio.sleep(0.005)
        ours = pull == (who != "peer")  # whether the decoder unlinks
        unlinking, other = (pair.decoder, pair.prompt) if ours else (pair.prompt, pair.decoder)
        link = link_to(unlinking, other.cluster_id)
        info = cluster_info(other.cluster_id, ("127.0.0.1", 1))
        unlinked = time.monotonic()
        status = await unlinking.unlink_clusters([info], force=who == "we-forced")
        # A forced unlink of ours, which the owner may never hear of, does not wait for our READs of its memory:
        # the pull returns once its READ settled.
        waited = who != "we-forced" or not pull
        if not waited:  # not for the READ held in its posting call (HELD_S) either
            assert time.monotonic() - unlinked < HELD_S / 2, time.monotonic() - unlinked
        if waited:
            for t in src.tensors:
                t.fill_(3)  # the source is written again at once (the owner's memory is its own again)
        assert status == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert link.broken is None, link.broken
        # By the unlink's return, but for the loop passes of its clean-up.
        async with asyncio.timeout(0.5 if waited else HELD_S + 1):
            with pytest.raises(LLMException) as info_:
                await call
        assert info_.value.status_code == S.LLM_NOT_YET_LINK, info_.value
        assert time.monotonic() - started < HELD_S + 2  # not the transfer's own timeout
        await _drained(engine)
        before = snapshot(dst)
        await asyncio.sleep(HELD_S + 0.2)  # past the end of the held posting call
        assert same(snapshot(dst), before)
        assert not any(bool((t == 3).any()) for t in dst.tensors)  # nothing read after the unlink returned


def _tcp_owner(conn: Any, spec: EndpointSpec, parent_pid: int) -> None:
    os.environ["UCX_TLS"] = "tcp"
    from peers import _endpoint_main
    _endpoint_main(conn, spec, parent_pid)


#: 8 rows of 16 MiB in each of two tensors: a READ of all of them takes about a second over UCX's TCP transport.
TCP_READ = CacheDesc(2, (8, 16 << 20), DataType.DT_INT8, Placement.HOST)


@pytest.mark.loops_take_turns
@pytest.mark.parametrize(("who", "settles"), [("we", "in time"), ("peer", "in time"), ("we", "forced off"),
                                              ("peer", "forced off"), ("we, the owner stopped", "forced off")])
async def test_a_read_without_asking_over_ucx_tcp_is_cut_by_an_unlink_of_its_link(who, settles, monkeypatch, caplog):
    """The owner is another process, whose progress the READ needs for every byte: the cut settles the READ
    before the owner lets the link go, so the pull fails at once and not on its timeout.

    A cut READ that does not settle in its bound (``forced off``: a piece of 256 MiB and ``NIXL_SETTLE_S`` 50 ms)
    is forced off, its peer's agent let go, and the unlink goes on: the link is not failed, so the UNLINK or our
    answer still goes out and that unlink succeeds. An owner that is stopped never answers our unlink, which then
    reports ``LLM_NOTIFY_PROMPT_UNLINK_FAILED`` (row 275). Before the review of row 337's first form, the force-off
    failed the link: the owner's unlink failed, and ours returned success without telling the owner."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    if settles == "forced off":
        monkeypatch.setattr(base, "NIXL_SETTLE_S", 0.05)
        monkeypatch.setattr(nixl_engine, "CHUNK_BYTES", 1 << 30)  # the READ in one piece, in NIXL's hands
    async with granted_over_ucx_tcp(TCP_READ, _tcp_owner) as (owner, decoder, dst, engine):
        link = link_to(decoder, PROMPT_ID)
        posted = engine.posted
        started = time.monotonic()
        call = asyncio.create_task(decoder.kv_cache_manager.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, ALL[:8],
                                                                        ALL[:8], timeout=8000))
        async with asyncio.timeout(5):
            while engine.posted == posted:  # the READ of the rows is posted (a ledger word's is not counted)
                await asyncio.sleep(0)
        assert not call.done()
        if who == "peer":
            assert await owner.call("unlink", DECODER_ID, 1) == (0, [0])
        elif who == "we":
            assert await decoder.unlink_clusters([owner.info]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        else:
            owner.stop()
            try:
                status = await decoder.unlink_clusters([owner.info], timeout=500)
            finally:
                owner.resume()
            failed = S.LLM_NOTIFY_PROMPT_UNLINK_FAILED
            assert status == (failed, [failed])
        assert link.broken is None, link.broken
        async with asyncio.timeout(0.5):
            with pytest.raises(LLMException) as info:
                await call
        assert info.value.status_code == S.LLM_NOT_YET_LINK, info.value
        assert time.monotonic() - started < 5
        assert ("did not stop within its settle bound" in caplog.text) == (settles == "forced off"), caplog.text
        await _drained(engine)
        before = snapshot(dst)
        await asyncio.sleep(0.3)
        assert same(snapshot(dst), before)
