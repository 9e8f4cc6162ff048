"""NIXL transfers with an owner that stops making progress, and the NIXL engine's bookkeeping under load.

Over UCX's TCP transport (``UCX_TLS=tcp``, the one used between hosts without RDMA) a READ needs the owner's
progress for every byte. An owner that stops (SIGSTOP here: a paused, stuck or hostile process) leaves a READ in
progress past the cut call's settle bound. Before, the pull raised with the READ still posted, and once the
owner ran again tens of MB landed in the caller's destination; now a transfer still in NIXL's hands past its
settle bound is forced off (its peer's agent let go, the link with it: ``base.nixl_settle``,
``NixlPeer._force_off``), and nothing lands after the call returned. ``finalize`` with such a transfer in
flight froze the whole event loop for 10 s (the engine's worker joined on the loop's thread); it now waits off
the loop. Found by audit.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing.connection
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from peers import (
    DECODER_ID,
    NIXL_MISSING,
    PROMPT_ID,
    CacheSpec,
    EndpointSpec,
    _endpoint_main,
    endpoint,
    fill,
    linked_pair,
    pattern,
    same,
    snapshot,
    spawned,
)

from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMException, LLMRole, LLMStatusCode, Placement
from aio_datadist.testing import link_to, nixl_agent_of
from aio_datadist.transport import base, nixl_engine

BIG = CacheDesc(2, (16, 1 << 20), DataType.DT_INT8, Placement.HOST)  # 2 x 16 MiB: READs that need many rounds
ALL = list(range(16))

pytestmark = [pytest.mark.nixl, pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING),
              pytest.mark.usefixtures("fork_server")]


def _tcp_owner(conn: multiprocessing.connection.Connection, spec: EndpointSpec, parent_pid: int) -> None:
    os.environ["UCX_TLS"] = "tcp"
    _endpoint_main(conn, spec, parent_pid)


async def _reading_from_a_stalled_owner(monkeypatch: pytest.MonkeyPatch, decoder, owner, *, asked: bool,
                                       stop: bool = True):
    """Link ``decoder`` to ``owner``, start a pull of all of its blocks and stop the owner once the READ is
    posted (unless not ``stop``): the pull's task and its destination."""
    dst = decoder.kv_cache_manager.allocate_blocks_cache(BIG)
    await decoder.link_clusters([owner.info], timeout=10_000)
    peer = link_to(decoder, PROMPT_ID).nixl
    async with asyncio.timeout(10):
        while peer.grant_for(0) is None or not peer.caches:
            await asyncio.sleep(0.005)
    if asked:
        peer.granted.grants.clear()  # the asking path: the owner answers, then we READ
        peer.granted.by_model.clear()
    engine = nixl_agent_of(decoder).engine
    before = engine.posted
    pull = asyncio.ensure_future(decoder.kv_cache_manager.pull_blocks(
        BlocksCacheKey(PROMPT_ID, 0), dst, ALL, ALL, timeout=800))
    async with asyncio.timeout(10):
        while engine.posted == before and not pull.done():
            await asyncio.sleep(0)
    assert not pull.done(), pull
    if stop:
        owner.stop()  # the owner stalls while the READ of its rows is in progress
    return pull, dst


def _owner_spec(desc: CacheDesc = BIG) -> EndpointSpec:
    return EndpointSpec(LLMRole.PROMPT, PROMPT_ID, caches=(CacheSpec("src", desc, 5, blocks=True, model_id=0),),
                        config=(("transport", "nixl"),))


@pytest.mark.asyncio
@pytest.mark.loops_take_turns
@pytest.mark.parametrize("asked", [False, True], ids=["without-asking", "asked"])
async def test_a_pull_given_up_on_a_stalled_owner_writes_nothing_after_it_returned(monkeypatch, asked):
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setattr(base, "NIXL_SETTLE_S", 0.3)
    async with spawned(_owner_spec(), target=_tcp_owner) as (owner,), \
            endpoint(LLMRole.DECODER, DECODER_ID, transport="nixl") as decoder:
        pull, dst = await _reading_from_a_stalled_owner(monkeypatch, decoder, owner, asked=asked)
        link = link_to(decoder, PROMPT_ID)
        try:
            started = time.monotonic()
            with pytest.raises(LLMException) as failed:
                async with asyncio.timeout(20):
                    await pull
            took = time.monotonic() - started
            returned = snapshot(dst)
        finally:
            owner.resume()
        await asyncio.sleep(1.5)  # the owner runs again
        assert same(snapshot(dst), returned), "bytes of the READ landed after the pull returned"
        assert failed.value.status_code == LLMStatusCode.LLM_TIMEOUT, failed.value
        assert took < 0.8 + 0.3 + base.NIXL_FORCE_S + 1, took
        assert link.broken is not None and link.broken.status_code == LLMStatusCode.LLM_LINK_FAILED, link.broken


@pytest.mark.asyncio
@pytest.mark.loops_take_turns
async def test_finalize_with_a_transfer_on_a_stalled_owner_does_not_freeze_the_loop(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    async with spawned(_owner_spec(), target=_tcp_owner) as (owner,):
        async with endpoint(LLMRole.DECODER, DECODER_ID, transport="nixl") as decoder:
            pull, _ = await _reading_from_a_stalled_owner(monkeypatch, decoder, owner, asked=False)
            lags: list[float] = []

            async def ticker() -> None:
                loop = asyncio.get_running_loop()
                while True:
                    t = loop.time()
                    await asyncio.sleep(0.01)
                    lags.append(loop.time() - t)

            tick = asyncio.ensure_future(ticker())
            try:
                await asyncio.sleep(0.05)
                started = time.monotonic()
                await decoder.finalize()  # the pull is cut, its READ forced off
                took = time.monotonic() - started
                await asyncio.sleep(0.05)
            finally:
                tick.cancel()
                owner.resume()
            with pytest.raises(LLMException):
                await pull
        assert max(lags) < 0.5, f"the event loop stood still for {max(lags):.2f} s inside finalize ({took:.1f} s)"


@pytest.mark.asyncio
@pytest.mark.loops_take_turns
async def test_a_pull_given_up_while_queued_behind_slow_nixl_work_leaves_the_link_up():
    """A READ the worker had not got to (queued behind slow NIXL calls, as registrations of large caches are)
    is not in NIXL's hands: given up, it is skipped, nothing is forced off and the link to the responsive peer
    stays up (it was failed: found by review)."""
    blocks = CacheDesc(4, (16, 4, 64), DataType.DT_FLOAT16, Placement.HOST)
    async with linked_pair(prompt_config={"transport": "nixl"}, decoder_config={"transport": "nixl"}) as pair:
        src = pair.pm.allocate_blocks_cache(blocks, BlocksCacheKey(PROMPT_ID))
        fill(src, 3)
        dst = pair.dm.allocate_blocks_cache(blocks)
        peer = link_to(pair.decoder, PROMPT_ID).nixl
        async with asyncio.timeout(5):
            while peer.grant_for(0) is None or not peer.caches:
                await asyncio.sleep(0.005)
        agent = nixl_agent_of(pair.decoder)
        engine = agent.engine
        first = agent.run(lambda token: engine.call(token, lambda a: time.sleep(0.3)), "a NIXL call")
        await asyncio.sleep(0.05)  # the worker is in it: the next call and the pull's READ are taken together
        slow = agent.run(lambda token: engine.call(token, lambda a: time.sleep(2.5)), "a slow NIXL call")
        link = link_to(pair.decoder, PROMPT_ID)
        with pytest.raises(LLMException) as failed:
            async with asyncio.timeout(15):
                await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, list(range(16)), list(range(16)),
                                          timeout=300)
        assert failed.value.status_code == LLMStatusCode.LLM_TIMEOUT, failed.value
        async with asyncio.timeout(10):
            await first
            await slow
        assert link.broken is None, link.broken
        async with asyncio.timeout(10):
            await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, list(range(16)), list(range(16)),
                                      timeout=3000)
        assert same(snapshot(dst), snapshot(src))


@pytest.mark.asyncio
@pytest.mark.loops_take_turns
@pytest.mark.parametrize("asked", [False, True], ids=["without-asking", "asked"])
async def test_a_pull_whose_force_waits_for_the_nixl_worker_writes_nothing_after_it_returned(monkeypatch, asked):
    """The force of a given-up READ asked while our NIXL worker is inside a long NIXL call (a stand-in here; a
    registration of a large cache, a metadata load) is applied once it is out, before the worker progresses UCX
    again, and the call waits for that (``Settling.forcing``). Before, the pull returned at the force bound with
    the READ still posted, and the worker's next round moved its bytes into the destination (found by audit)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setattr(base, "NIXL_SETTLE_S", 0.3)
    monkeypatch.setattr(base, "NIXL_FORCE_S", 0.5)
    async with spawned(_owner_spec(), target=_tcp_owner) as (owner,), \
            endpoint(LLMRole.DECODER, DECODER_ID, transport="nixl") as decoder:
        pull, dst = await _reading_from_a_stalled_owner(monkeypatch, decoder, owner, asked=asked, stop=False)
        agent = nixl_agent_of(decoder)
        engine = agent.engine
        # The worker goes into 2.5 s of NIXL work with the READ in flight (the owner keeps running).
        slow = agent.run(lambda token: engine.call(token, lambda a: time.sleep(2.5)), "slow NIXL work")
        failed: LLMException | None = None
        try:
            async with asyncio.timeout(20):
                await pull
        except LLMException as exc:
            failed = exc
        returned = snapshot(dst)
        async with asyncio.timeout(15):
            await slow
        await asyncio.sleep(1.0)
        assert same(snapshot(dst), returned), "bytes of the READ landed after the pull returned"
        if failed is None:  # the READ ended before the force was applied (seen once in a loaded run): all landed
            assert same(returned, pattern(BIG, 5)), "the pull succeeded without its bytes"
        else:
            assert failed.status_code == LLMStatusCode.LLM_TIMEOUT, failed


async def _read_of_a_stopped_owner(owner: Any, decoder: Any, kv: Any, dst: Any, engine: Any) -> asyncio.Future:
    """A pull of all of ``dst``'s rows from ``owner`` (granted), its READ in NIXL's hands as the owner is stopped
    (left stopped): the pull's task."""
    for _attempt in range(5):
        peer = link_to(decoder, PROMPT_ID).nixl
        async with asyncio.timeout(10):
            while peer.grant_for(0) is None or not peer.caches:
                await asyncio.sleep(0.005)
        before = engine.posted
        old = asyncio.ensure_future(kv.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, ALL, ALL, timeout=3000))
        async with asyncio.timeout(10):
            while engine.posted == before and not old.done():
                await asyncio.sleep(0)
        owner.stop()
        await asyncio.sleep(0.3)
        if not old.done():
            return old
        owner.resume()  # it finished before the owner stopped: again
        await old
    raise AssertionError("every pull ended before the owner stopped")


@pytest.mark.asyncio
@pytest.mark.loops_take_turns
async def test_a_force_off_for_an_earlier_link_fails_the_relinked_link_it_invalidates_and_the_next_link_works(
        monkeypatch):
    """NIXL lets go of a peer's agent by its name, which a newer link to the same endpoint shares: forcing off a
    READ of an earlier (force-unlinked) link invalidates what the newer link prepared. That link now fails with
    ``LLM_LINK_FAILED`` saying why, and the next link moves verified bytes over NIXL. Before, it stayed up with
    transport nixl and every transfer on it failed ``NIXL_ERR_NOT_FOUND`` (found by audit)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    # The forced unlink cuts link 1's READ (row 337) and does not wait for it: the READ is forced off once this
    # runs out, after the relink below loaded the owner's agent.
    monkeypatch.setattr(base, "NIXL_SETTLE_S", 3.0)
    # 2 x 64 MiB in one piece: the first link's READ, which the owner serves again once it resumes for the relink,
    # must not end before it is forced off (UCX over loopback TCP moves 12-25 MB/s here), and a cut READ ends with
    # the piece NIXL has (nixl_engine.CHUNK_BYTES).
    monkeypatch.setattr(nixl_engine, "CHUNK_BYTES", 1 << 30)
    huge = CacheDesc(2, (16, 4 << 20), DataType.DT_INT8, Placement.HOST)
    async with spawned(_owner_spec(huge), target=_tcp_owner) as (owner,), \
            endpoint(LLMRole.DECODER, DECODER_ID, transport="nixl") as decoder:
        kv = decoder.kv_cache_manager
        dst = kv.allocate_blocks_cache(huge)
        await decoder.link_clusters([owner.info], timeout=10_000)
        engine = nixl_agent_of(decoder).engine
        # The relink's load of the owner's agent can end the cut READ itself (NIXL fails a transfer whose remote
        # agent was loaded again): then nothing is let go and the relinked link is fine. A few rounds, until the
        # READ is still in NIXL's hands once the relink is up (5 of 6 rounds here).
        for _round in range(4):
            old = await _read_of_a_stopped_owner(owner, decoder, kv, dst, engine)
            try:
                assert not old.done()
                status, _ = await decoder.unlink_clusters([owner.info], force=True)  # this end only
                assert status == LLMStatusCode.LLM_SUCCESS
                relink = asyncio.ensure_future(decoder.link_clusters([owner.info], timeout=10_000))
                await asyncio.sleep(0.1)
            finally:
                owner.resume()
            status, _ = await relink
            assert status == LLMStatusCode.LLM_SUCCESS, status
            if not old.done():
                break
            with pytest.raises(LLMException) as ended:
                await old
            assert ended.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK, ended.value  # the unlink cut it
            assert link_to(decoder, PROMPT_ID).broken is None  # nothing was let go
            await decoder.unlink_clusters([owner.info], force=True)
            assert (await decoder.link_clusters([owner.info], timeout=10_000))[0] == LLMStatusCode.LLM_SUCCESS
        assert not old.done(), "the relink ended the cut READ in every round"
        owner.stop()  # the cut READ settles while the owner makes no progress on it (stopped again) ...
        try:
            second = link_to(decoder, PROMPT_ID)
            assert second.transport == "nixl"
            with pytest.raises(LLMException) as first:  # ... until it is forced off
                async with asyncio.timeout(30):
                    await old
        finally:
            owner.resume()
        assert first.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK, first.value  # the unlink cut it
        assert second.broken is not None and second.broken.status_code == LLMStatusCode.LLM_LINK_FAILED
        assert "let go" in str(second.broken)
        await decoder.unlink_clusters([owner.info], force=True)
        assert (await decoder.link_clusters([owner.info], timeout=10_000))[0] == LLMStatusCode.LLM_SUCCESS
        assert link_to(decoder, PROMPT_ID).transport == "nixl"
        async with asyncio.timeout(15):
            await kv.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, [3], [3], timeout=5000)
        assert all(torch.equal(got[3], want[3]) for got, want in zip(snapshot(dst), owner.expected("src"),
                                                                      strict=True))


@pytest.mark.parametrize("how", ["facade", "explicit"])
def test_a_finalize_at_exit_joins_the_nixl_worker(how):
    """At exit (the facade's atexit finalize, or the program's own) the default executor is gone: the finalize's
    wait for the NIXL worker ran there, failed ("cannot schedule new futures after interpreter shutdown",
    logged as a task exception never retrieved) and the worker was never joined (found by review)."""
    child = pathlib.Path(__file__).with_name("nixl_exit_child.py")
    proc = subprocess.run([sys.executable, str(child), how], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Task exception was never retrieved" not in proc.stderr, proc.stderr[-2000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    assert json.loads(line)["nixl_workers_alive"] == [], line
