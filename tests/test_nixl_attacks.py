"""A linked NIXL peer that lies in its records: what it can and cannot make us keep or do.

The attacker is the decoder of an in-process pair: it sends ``Msg.NIXL``
records of its own making on its link (``NixlPeer._send``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch
from peers import DECODER_ID, NIXL_MISSING, PROMPT_ID, endpoint, fill, linked_pair
from test_nixl_reads import granted

from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMException, LLMRole, LLMStatusCode, Placement
from aio_datadist.testing import link_to, nixl_agent_of
from aio_datadist.transport import base, nixl, nixl_offers

NIXL = {"transport": "nixl"}
BLOCKS = CacheDesc(4, (16, 4, 64), DataType.DT_FLOAT16, Placement.HOST)  # 16 blocks of 512 B

needs_nixl = pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING)

pytestmark = [pytest.mark.asyncio, pytest.mark.nixl, pytest.mark.usefixtures("fork_server")]

_AGENT = b"nixlSerDes|Agent"


def renamed(metadata: bytes, name: bytes) -> bytes:
    """NIXL agent metadata naming agent ``name`` (its connection info unchanged: it still reaches the agent)."""
    assert metadata.startswith(_AGENT)
    (length,) = struct.unpack_from("<Q", metadata, len(_AGENT))
    return _AGENT + struct.pack("<Q", len(name)) + name + metadata[len(_AGENT) + 8 + length:]


async def prepared(owner, peer_id: int, cache) -> None:
    """Until the peer has prepared its NIXL list for ``cache``: until then requests for it use TCP."""
    async with asyncio.timeout(5):
        while True:
            link = link_to(owner, peer_id)
            if link is not None and link.nixl is not None and cache.cache_id in link.nixl.prepared:
                return
            await asyncio.sleep(0.005)


async def on_worker(dd, fn):
    """``fn(nixl_agent)`` run on ``dd``'s NIXL worker (the one thread that calls into its agent)."""
    return await nixl_agent_of(dd).start(fn, "test")


@needs_nixl
async def test_metadata_naming_another_agent_is_not_kept_loaded():
    """An OFFER (or HELLO) whose metadata names an agent other than the peer's is refused, and that other
    agent does not stay loaded in ours: before, every such record left one more remote agent (its sections
    and a UCX endpoint) in our agent for the endpoint's life, after the link was gone."""
    async with linked_pair(prompt_config=NIXL, decoder_config=NIXL) as pair:
        attacker = link_to(pair.decoder, PROMPT_ID).nixl
        victim_link = link_to(pair.prompt, DECODER_ID)
        victim = victim_link.nixl
        assert attacker.usable() and victim.usable()
        metadata = nixl_agent_of(pair.decoder).metadata
        names = [b"forged-%03d" % n for n in range(20)]
        for n, name in enumerate(names):
            attacker._send(nixl.OFFER, 1000 + n, 16, 512, (1 << 20,), renamed(metadata, name))
        async with asyncio.timeout(10):
            while victim._pending:  # every load ran (and failed: the link goes on, those caches take TCP)
                await asyncio.sleep(0.01)
        assert link_to(pair.prompt, DECODER_ID) is victim_link and victim.usable()
        await pair.unlink()
        loaded = await on_worker(pair.prompt, lambda agent: [n for n in names
                                                             if agent.check_remote_metadata(n.decode())])
        assert loaded == [], f"{len(loaded)} agents named by the peer's metadata stay loaded"


@needs_nixl
@pytest.mark.parametrize("nixl_reloads", [False, True])
async def test_metadata_naming_the_agent_of_another_link_leaves_that_agent_loaded(monkeypatch, nixl_reloads):
    """A linked peer whose OFFER's metadata names the agent of another of our links (the decoder's): the record
    is refused, and the agent it named stays loaded for that link, whose NIXL pushes go on. The test above names
    agents no link uses (audit, 2026-12-07). This NIXL (1.x) refuses to load metadata naming an agent it has
    loaded (``NIXL_ERR_NOT_ALLOWED``), so our own guard for that case (``NixlPeer._load``: unload only an agent
    no other link uses) is not reached here: the test holds the outcome, whichever of the two keeps it. With
    ``nixl_reloads`` NIXL takes the forged metadata for the agent it names, as a NIXL that accepts new content
    for a loaded agent would: the guard is reached (without this case it passed removed, audit 2026-12-07)."""
    async with linked_pair(link=False, prompt_config=NIXL, decoder_config=NIXL) as pair, \
            endpoint(LLMRole.DECODER, 3, **NIXL) as attacker_dd:
        src = pair.pm.allocate_blocks_cache(BLOCKS)
        dst = pair.dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID))
        await pair.link()
        status, per_cluster = await attacker_dd.link_clusters([pair.info], timeout=3000)
        assert (status, per_cluster) == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
        await prepared(pair.decoder, PROMPT_ID, dst)
        attacker, victim = link_to(attacker_dd, PROMPT_ID).nixl, link_to(pair.prompt, 3).nixl
        assert attacker.usable() and victim.usable()
        decoders = nixl_agent_of(pair.decoder).name
        forged = renamed(nixl_agent_of(attacker_dd).metadata, decoders)
        if nixl_reloads:
            kind = type(nixl_agent_of(pair.prompt).engine.agent)
            real_add = kind.add_remote_agent
            monkeypatch.setattr(kind, "add_remote_agent", lambda self, metadata: decoders if metadata == forged
                                else real_add(self, metadata))
        attacker._send(nixl.OFFER, 1000, 16, 512, (1 << 20,), forged)
        async with asyncio.timeout(10):
            while victim._pending:  # the load ran, and the record was refused
                await asyncio.sleep(0.01)
        assert await on_worker(pair.prompt, lambda agent: agent.check_remote_metadata(decoders.decode()))
        want = fill(src, 4)
        posted = posted_count(pair.prompt)
        for n in range(3):  # the prompt writes the decoder's cache: its agent must still know the decoder's
            await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID), src, [n], [n], timeout=2000)
        assert posted_count(pair.prompt) == posted + 3  # by NIXL
        assert all(torch.equal(d[:3], w[:3]) for d, w in zip(dst.tensors, want, strict=True))


def slowed_writes(dd, seconds: float) -> tuple[list[float], Callable[[], None]]:
    """Make ``dd``'s NIXL worker post every transfer (none from the loop, as when the worker is busy) and wait
    ``seconds`` before each: when the posting of each began (after the wait), and a function that ends the
    delay."""
    engine = nixl_agent_of(dd).engine
    start, try_post, posting = engine._start, engine.try_post, []

    def slow(*args):
        time.sleep(seconds)
        posting.append(time.monotonic())
        return start(*args)

    def restore() -> None:
        engine._start, engine.try_post = start, try_post

    engine._start, engine.try_post = slow, lambda *args: None
    return posting, restore


def held_in_progress(monkeypatch, engine) -> tuple[list[Any], threading.Event]:
    """NIXL reports the next transfer of more than one row that ``engine``'s agent posts as in progress until the
    returned event is set: its posting call (``transfer``) and every state check (``check_xfer_state``) say
    ``PROC``, whatever NIXL did, as for a transfer whose peer makes no progress on it (over UCX shared memory, a
    WRITE posted after the owner dropped the link). The list gets its handle once it is made."""
    kind = type(engine.agent)
    real_make, real_transfer, real_check = kind.make_prepped_xfer, kind.transfer, kind.check_xfer_state
    release, held = threading.Event(), []

    def holding(handle) -> bool:
        return bool(held) and handle is held[0] and not release.is_set()

    def make_prepped_xfer(self, op, local, local_idx, *args, **kwargs):
        handle = real_make(self, op, local, local_idx, *args, **kwargs)
        if self is engine.agent and not held and len(local_idx) > 1:
            held.append(handle)
        return handle

    def transfer(self, handle, *args, **kwargs):
        state = real_transfer(self, handle, *args, **kwargs)
        return "PROC" if holding(handle) else state

    def check_xfer_state(self, handle):
        return "PROC" if holding(handle) else real_check(self, handle)

    monkeypatch.setattr(kind, "make_prepped_xfer", make_prepped_xfer)
    monkeypatch.setattr(kind, "transfer", transfer)
    monkeypatch.setattr(kind, "check_xfer_state", check_xfer_state)
    return held, release


def unloads_waiting(engine, name: bytes) -> int:
    """How many unloads of agent ``name`` (a link's close: ``NixlPeer.close``) wait on ``engine``'s worker for a
    transfer that uses it."""
    return sum(1 for uses, _ in list(engine._deferred) if uses == (name,))


@needs_nixl
@pytest.mark.loops_take_turns  # (one loop: NIXL and its agent do not care which)
async def test_closing_a_link_does_not_unload_the_agent_of_the_next_link_to_the_same_peer(monkeypatch, caplog):
    """A link's close unloads the peer's agent once no transfer of ours uses it any more. Here a READ of ours (a
    pull without asking) stays in NIXL's hands (``held_in_progress``) past our forced unlink, which cuts it and
    does not wait for it (row 337), so the unload waits; the next link to the same endpoint loads the same agent
    meanwhile (a no-op, it is still loaded). Once the READ settles, the waiting unload must leave the agent to
    that link: before, it took it, and the link's NIXL pulls failed ``LLM_LINK_FAILED``
    (``NIXL_ERR_NOT_FOUND``). The settle bound is raised so that the held READ is not forced off (that would let
    the agent go, row 199's case): the agent stays loaded throughout."""
    monkeypatch.setattr(base, "NIXL_SETTLE_S", 30.0)
    caplog.set_level(logging.WARNING, logger="aio_datadist.nixl")
    async with linked_pair(link=False, prompt_config=NIXL, decoder_config=NIXL) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID))
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        await pair.link()
        await granted(pair.decoder, src)
        engine = nixl_agent_of(pair.decoder).engine
        name = nixl_agent_of(pair.prompt).name
        held, release = held_in_progress(monkeypatch, engine)
        try:
            pull = asyncio.create_task(pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [0, 1], [0, 1],
                                                           timeout=60_000))
            async with asyncio.timeout(5):
                while not (held and engine._active):  # the READ of the rows is in NIXL's hands
                    await asyncio.sleep(0.002)
            await pair.unlink(force=True)  # cuts the READ; a forced unlink does not wait for it
            async with asyncio.timeout(5):
                while not unloads_waiting(engine, name):  # the old link's close: its unload waits for the READ
                    await asyncio.sleep(0.002)
            await pair.link()
            await granted(pair.decoder, src)
            new = link_to(pair.decoder, PROMPT_ID).nixl
            assert new.agent_loaded and new.name == name  # the same agent, loaded again (still loaded)
            # The case: the next link is up on that agent while the old link's unload still waits for the READ.
            assert not pull.done() and engine._active and unloads_waiting(engine, name) == 1
        finally:
            release.set()
        with pytest.raises(LLMException) as exc:
            await asyncio.wait_for(pull, 5)
        assert exc.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK, exc.value
        async with asyncio.timeout(5):
            while unloads_waiting(engine, name):  # the READ settled: the unload ran (and left the agent)
                await asyncio.sleep(0.002)
        want = fill(src, 4)
        posted = engine.posted
        for n in range(3):  # the decoder reads the prompt's cache: its agent must still know the prompt's
            await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [n + 4], [n + 4], timeout=2000)
        assert engine.posted == posted + 3  # by NIXL
        assert all(torch.equal(d[4:7], w[4:7]) for d, w in zip(dst.tensors, want, strict=True))
        assert link_to(pair.decoder, PROMPT_ID).broken is None
        assert await on_worker(pair.decoder, lambda agent: agent.check_remote_metadata(name.decode()))
        assert "letting go of agent" not in caplog.text, caplog.text  # nothing was forced off
        # With no newer link, a close unloads the agent (this test passed with a closed link kept among the
        # agent's peers, so that no close ever unloaded it: audit 2026-12-07).
        await pair.unlink()
        async with asyncio.timeout(5):
            while await on_worker(pair.decoder, lambda agent: agent.check_remote_metadata(name.decode())):
                await asyncio.sleep(0.01)


def posted_count(dd) -> int:
    return nixl_agent_of(dd).engine.posted


@needs_nixl
@pytest.mark.loops_take_turns  # (one loop: NIXL and its agent do not care which)
async def test_a_late_notification_of_an_earlier_link_does_not_confirm_a_push_of_the_next(monkeypatch):
    """Request ids start again on every link. A WRITE of a link's push whose notification comes late (over UCX
    shared memory, a WRITE cut by its link's end stays in flight until the owner's agent progresses, on the next
    link to the same peer) must not confirm the next link's push of the same id. The late notification is the
    first link's own one for that id, sent by the pusher's agent (NIXL ``send_notif``) once the next link is up
    and read by the owner's agent before that link's push starts; the push's WRITE is held 0.3 s before it is
    posted. Before, the owner recorded the push's rows as arrived (its push watch done) before the WRITE was
    posted, their bytes not in place."""
    async with linked_pair(link=False, prompt_config=NIXL, decoder_config=NIXL) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID))
        dst = pair.dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID))
        engine = nixl_agent_of(pair.decoder).engine
        expected: list[tuple[bytes, bytes]] = []  # the notifications the decoder awaits, in turn
        expect_notif = engine.expect_notif

        def recorded(token: int, peer: bytes, message: bytes) -> None:
            expected.append((peer, message))
            expect_notif(token, peer, message)

        monkeypatch.setattr(engine, "expect_notif", recorded)
        await pair.link()
        await prepared(pair.decoder, PROMPT_ID, dst)
        posted = posted_count(pair.prompt)
        await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID), src, [0], [0], timeout=2000)
        assert posted_count(pair.prompt) == posted + 1 and len(expected) == 1  # by NIXL
        late = expected[0]  # the first link's notification of its push
        await pair.unlink()
        await pair.link()
        await prepared(pair.decoder, PROMPT_ID, dst)
        await prepared(pair.prompt, DECODER_ID, src)

        decoder_name = nixl_agent_of(pair.decoder).name.decode()
        # Both workers make progress meanwhile (the send needs the sender's); the decoder's reads notifications:
        # the late one is kept, unmatched (``NixlEngine._early``), for an expectation that may follow.
        sender = nixl_agent_of(pair.prompt).engine
        sender.hold()
        engine.hold()
        try:
            await on_worker(pair.prompt, lambda agent: agent.send_notif(decoder_name, late[1]))
            async with asyncio.timeout(5):
                while late not in engine._early:
                    await asyncio.sleep(0.002)
        finally:
            engine.unhold()
            sender.unhold()

        want = fill(src, 4)
        posting, restore = slowed_writes(pair.prompt, 0.3)
        push = None
        try:
            with pair.dm.watch_pushes(dst, [0]) as watch:
                push = asyncio.create_task(pair.pm.push_blocks(BlocksCacheKey(DECODER_ID), src, [0], [0],
                                                               timeout=3000))
                await watch.wait(timeout=5000)  # the owner recorded the push's rows as arrived
                at_arrival = [t[0].clone() for t in dst.tensors]
                assert posting, "the owner recorded the push as arrived before its WRITE was posted"
                assert all(torch.equal(a, w[0]) for a, w in zip(at_arrival, want, strict=True)), \
                    "recorded as arrived with its bytes not in place"
                await push
        finally:
            restore()
            if push is not None and not push.done():
                push.cancel()
                with contextlib.suppress(BaseException):
                    await push
        assert len(expected) == 2
        assert expected[1][0] == late[0] and expected[1][1][-8:] == late[1][-8:]  # the same agent and request id
        assert all(torch.equal(d[0], w[0]) for d, w in zip(dst.tensors, want, strict=True))
        assert late in engine._early  # it came, and confirmed nothing


ATTACKER_ID = 3


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def watched(stop: asyncio.Event) -> tuple[float, float]:
    """Until ``stop``: the largest growth of this process's RSS over its start (MiB) and the longest wait of a
    5 ms ticker (s), i.e. how long the loop was held."""
    loop = asyncio.get_running_loop()
    start, grown, held = rss_mib(), 0.0, 0.0
    last = loop.time()
    while not stop.is_set():
        await asyncio.sleep(0.005)
        now = loop.time()
        held, last = max(held, now - last), now
        grown = max(grown, rss_mib() - start)
    return grown, held


@needs_nixl
@pytest.mark.parametrize("tensors, rows", [(4096, 1 << 40), (4096, 8192)], ids=["4.5e15", "2**25"])
async def test_an_offer_of_too_many_descriptors_is_refused_and_the_endpoint_stays_healthy(tensors, rows):
    """A linked peer's OFFER declaring more (tensor, row) descriptors than ``nixl_offers.MAX_DESCRIPTORS`` is a protocol
    error on its link: no descriptor list is built for it (before: the endpoint's NIXL worker built one entry per
    tensor and row, 2**25 of 1 byte over the peer's real 16 KiB cache held the worker for seconds and grew the
    process by gigabytes, with every NIXL transfer of the endpoint waiting behind it). The endpoint's other link
    pushes verified bytes by NIXL meanwhile, without waiting."""
    async with linked_pair(link=False, prompt_config=NIXL, decoder_config=NIXL) as pair, \
            endpoint(LLMRole.DECODER, ATTACKER_ID, **NIXL) as attacker_dd:
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID))
        dst = pair.dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID))
        bait = attacker_dd.kv_cache_manager.allocate_cache(CacheDesc(1, (8192,), DataType.DT_FLOAT16,
                                                                     Placement.HOST))
        await pair.link()
        status, per_cluster = await attacker_dd.link_clusters([pair.info], timeout=3000)
        assert (status, per_cluster) == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
        await prepared(pair.decoder, PROMPT_ID, dst)  # the prompt pushes into it by NIXL
        await prepared(attacker_dd, PROMPT_ID, bait)  # the attacker's real cache, registered with NIXL
        attacker = link_to(attacker_dd, PROMPT_ID).nixl
        victim_link = link_to(pair.prompt, ATTACKER_ID)
        assert attacker.usable() and victim_link.nixl.usable()
        want = fill(src, 5)
        await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID), src, [0], [0], timeout=2000)  # warm
        posted = posted_count(pair.prompt)

        # Every tensor at the bait's base, rows of 1 byte: all of it inside the attacker's registered memory.
        attacker._send(nixl.OFFER, 1 << 20, rows, 1, (bait.layout.bases[0],) * tensors,
                       nixl_agent_of(attacker_dd).metadata)
        stop = asyncio.Event()
        watch = asyncio.create_task(watched(stop))
        took = []
        for n in range(1, 6):
            started = time.perf_counter()
            await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID), src, [n], [n], timeout=10_000)
            took.append(time.perf_counter() - started)
        await asyncio.sleep(0.5)  # what the worker was given is done by now, or still under way
        stop.set()
        grown, held = await watch
        refused = victim_link.broken is not None
        summary = (f"refused: {refused}; pushes {', '.join(f'{t * 1000:.0f}' for t in took)} ms; "
                   f"RSS +{grown:.0f} MiB; loop held {held * 1000:.0f} ms")
        print(summary)
        assert refused, summary
        # the per-offer bound's own refusal (the link's budget refuses the larger offer too, with another word)
        assert "protocol error" in str(victim_link.broken) and "bad NIXL offer" in str(victim_link.broken), summary
        assert max(took) < 0.5 and grown < 100, summary
        assert posted_count(pair.prompt) == posted + 5  # by NIXL
        assert all(torch.equal(d[1:6], w[1:6]) for d, w in zip(dst.tensors, want, strict=True))
        # The endpoint's worker is free: nothing of the offer is left queued behind.
        assert await asyncio.wait_for(on_worker(pair.prompt, lambda agent: True), 1.0)


@needs_nixl
async def test_a_cache_of_too_many_descriptors_is_not_offered_and_moves_over_tcp(caplog):
    """Our own side never offers a cache its peer would refuse (``nixl_offers.MAX_DESCRIPTORS``): such a cache is not
    registered with NIXL, says so once (INFO), and moves over TCP; the link stays up and NIXL moves the rest."""
    caplog.set_level(logging.INFO, logger="aio_datadist.nixl")
    big = CacheDesc(4096, (4097, 1), DataType.DT_INT8, Placement.HOST)  # 2**24 + 4096 descriptors, 16 MiB
    assert 4096 * 4097 > nixl_offers.MAX_DESCRIPTORS >= 4096 * 4096
    # the bound itself is allowed (both ends: an honest peer's cache of exactly MAX_DESCRIPTORS is offered, accepted)
    assert nixl_offers.too_many_descriptors(1, nixl_offers.MAX_DESCRIPTORS) is None
    assert nixl_offers.too_many_descriptors(1, nixl_offers.MAX_DESCRIPTORS + 1) is not None
    async with linked_pair(link=False, prompt_config=NIXL, decoder_config=NIXL) as pair:
        src = pair.pm.allocate_blocks_cache(big, BlocksCacheKey(PROMPT_ID))
        dst = pair.dm.allocate_blocks_cache(big)
        small = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 1))
        small_dst = pair.dm.allocate_blocks_cache(BLOCKS)
        await pair.link()
        await prepared(pair.prompt, DECODER_ID, small)
        for dd, cache in ((pair.prompt, src), (pair.decoder, dst)):
            assert not nixl_agent_of(dd).offered(cache)
            assert any(f"cache {cache.cache_id} is not registered with NIXL" in r.getMessage()
                       and "its transfers take TCP" in r.getMessage() for r in caplog.records)
        want, small_want = fill(src, 6), fill(small, 7)
        posted = posted_count(pair.decoder)
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [4096, 3], [0, 4096], timeout=5000)
        assert posted_count(pair.decoder) == posted  # over TCP
        assert all(torch.equal(d[[0, 4096]], w[[4096, 3]]) for d, w in zip(dst.tensors, want, strict=True))
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 1), small_dst, [2], [2], timeout=5000)
        assert posted_count(pair.decoder) == posted + 1  # by NIXL
        assert all(torch.equal(d[2], w[2]) for d, w in zip(small_dst.tensors, small_want, strict=True))
        assert link_to(pair.decoder, PROMPT_ID).broken is None and link_to(pair.prompt, DECODER_ID).broken is None


@needs_nixl
async def test_offers_beyond_the_links_budget_are_refused_and_a_withdrawal_frees_its_share(monkeypatch):
    """A linked peer may keep at most ``nixl_offers.MAX_LINK_CACHES`` caches offered on a link (and
    ``MAX_LINK_DESCRIPTORS`` descriptors in all; the test lowers the first to 3): each offer costs the worker a
    metadata load and a descriptor list, so before, offer after offer, each under ``MAX_DESCRIPTORS``, kept it
    busy without end. A withdrawn cache gives its share back; one offer more than the budget breaks the link
    with a protocol error, and the endpoint's other link moves verified bytes by NIXL meanwhile."""
    monkeypatch.setattr(nixl_offers, "MAX_LINK_CACHES", 3)
    async with linked_pair(link=False, prompt_config=NIXL, decoder_config=NIXL) as pair, \
            endpoint(LLMRole.DECODER, ATTACKER_ID, **NIXL) as attacker_dd:
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID))
        dst = pair.dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID))
        bait = attacker_dd.kv_cache_manager.allocate_cache(CacheDesc(1, (64,), DataType.DT_FLOAT16, Placement.HOST))
        await pair.link()
        assert (await attacker_dd.link_clusters([pair.info], timeout=3000))[0] == LLMStatusCode.LLM_SUCCESS
        await prepared(pair.decoder, PROMPT_ID, dst)
        await prepared(attacker_dd, PROMPT_ID, bait)  # one cache offered on the attacker's link
        attacker = link_to(attacker_dd, PROMPT_ID).nixl
        victim_link = link_to(pair.prompt, ATTACKER_ID)
        metadata = nixl_agent_of(attacker_dd).metadata

        def offer(cache_id: int) -> None:  # 8 rows of 16 bytes inside the bait's registered memory
            attacker._send(nixl.OFFER, cache_id, 8, 16, (bait.layout.bases[0],), metadata)

        async def loaded(cache_id: int) -> None:
            async with asyncio.timeout(5):
                while cache_id not in victim_link.nixl.caches:
                    await asyncio.sleep(0.005)

        offer(1 << 20)
        offer((1 << 20) + 1)  # three offered: the budget
        await loaded((1 << 20) + 1)
        attacker._send(nixl.WITHDRAW, 1 << 20, 0, 0, (), b"")
        offer((1 << 20) + 2)  # fits again
        await loaded((1 << 20) + 2)
        assert victim_link.broken is None
        want = fill(src, 8)
        offer((1 << 20) + 3)  # one more than the budget
        async with asyncio.timeout(5):
            while victim_link.broken is None:
                await asyncio.sleep(0.005)
        assert "protocol error" in str(victim_link.broken), victim_link.broken
        posted = posted_count(pair.prompt)
        await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID), src, [3], [3], timeout=5000)
        assert posted_count(pair.prompt) == posted + 1  # by NIXL
        assert all(torch.equal(d[3], w[3]) for d, w in zip(dst.tensors, want, strict=True))


@needs_nixl
async def test_our_caches_beyond_the_links_budget_are_not_offered_and_move_over_tcp(monkeypatch, caplog):
    """Our own side never offers more than the budget its peer accepts (``nixl_offers.MAX_LINK_CACHES``, lowered to 2
    here): the third cache is not offered on that link, says so once (INFO), and moves over TCP; the link stays up
    and NIXL moves the others."""
    monkeypatch.setattr(nixl_offers, "MAX_LINK_CACHES", 2)
    caplog.set_level(logging.INFO, logger="aio_datadist.nixl")
    async with linked_pair(link=False, prompt_config=NIXL, decoder_config=NIXL) as pair:
        srcs = [pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, m)) for m in range(3)]
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        await pair.link()
        peer = link_to(pair.prompt, DECODER_ID).nixl
        for cache in srcs:  # each offered, or found beyond the budget, as its registration ended
            await nixl_agent_of(pair.prompt).registered(cache)
        async with asyncio.timeout(5):  # whichever two finished registering first are offered (not always srcs[:2])
            while len(peer.offers_sent) < 2:
                await asyncio.sleep(0.005)
        offered = [cache for cache in srcs if cache.cache_id in peer.offers_sent]
        (left,) = [cache for cache in srcs if cache.cache_id not in peer.offers_sent]
        assert len(offered) == 2
        for cache in offered:
            await prepared(pair.prompt, DECODER_ID, cache)
        assert left.cache_id not in peer.offers_sent
        assert any(f"cache {left.cache_id} is not offered over NIXL" in r.getMessage() for r in caplog.records)
        wants = [fill(cache, 10 + m) for m, cache in enumerate(srcs)]
        for m, want in enumerate(wants):
            posted = posted_count(pair.decoder)
            await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, m), dst, [m], [m], timeout=5000)
            assert posted_count(pair.decoder) == posted + (srcs[m] is not left)  # the one left out over TCP
            assert all(torch.equal(d[m], w[m]) for d, w in zip(dst.tensors, want, strict=True))
        assert link_to(pair.decoder, PROMPT_ID).broken is None and peer.usable()
        # A freed cache gives its share of our budget back: the next cache is offered (and prepared) on the link.
        pair.pm.deallocate_cache(offered[0])
        again = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 3))
        await nixl_agent_of(pair.prompt).registered(again)
        assert again.cache_id in peer.offers_sent, "a withdrawn cache's share of the link's budget was not given back"
        await prepared(pair.prompt, DECODER_ID, again)


@contextlib.asynccontextmanager
async def forging_pair() -> AsyncIterator[tuple[Any, Any, Any, Any, bytes]]:
    """A linked NIXL pair whose decoder forges NIXL records to the prompt over its real link: ``(pair, bait,
    attacker, victim_link, metadata)``: the decoder's bait (a cache of 64 fp16 values, registered and prepared by
    the prompt: forged offers point into it), its ``NixlPeer``, the prompt's link to it, the decoder's metadata."""
    async with linked_pair(link=False, prompt_config=NIXL, decoder_config=NIXL) as pair:
        bait = pair.dm.allocate_cache(CacheDesc(1, (64,), DataType.DT_FLOAT16, Placement.HOST))
        await pair.link()
        await prepared(pair.decoder, PROMPT_ID, bait)
        yield (pair, bait, link_to(pair.decoder, PROMPT_ID).nixl, link_to(pair.prompt, DECODER_ID),
               nixl_agent_of(pair.decoder).metadata)


def counted_loads(monkeypatch, first_id: int, seconds: float = 0.0) -> list[int]:
    """The ids (``>= first_id``) of the peer's caches our workers build descriptor lists for, each taking
    ``seconds`` more."""
    loads: list[int] = []
    real = nixl.prepare_remote

    def counting(agent, name, cache_id, *rest):
        if cache_id >= first_id:
            loads.append(cache_id)
            time.sleep(seconds)
        return real(agent, name, cache_id, *rest)

    monkeypatch.setattr(nixl, "prepare_remote", counting)
    return loads


@needs_nixl
async def test_a_cache_offered_again_without_its_withdrawal_is_a_protocol_error(monkeypatch):
    """The budget counts a cache once, so a peer that offers the same cache id again and again (no WITHDRAW
    between: an honest peer never does) would cost the worker a metadata load and a descriptor list each time
    within the budget: the second offer breaks the link, nothing more is loaded for it."""
    loads = counted_loads(monkeypatch, 1 << 20)
    async with forging_pair() as (pair, bait, attacker, victim_link, metadata):
        for _ in range(20):
            attacker._send(nixl.OFFER, 1 << 20, 8, 16, (bait.layout.bases[0],), metadata)
        async with asyncio.timeout(5):
            while victim_link.broken is None:
                await asyncio.sleep(0.005)
        assert "protocol error" in str(victim_link.broken), victim_link.broken
        assert len(loads) <= 1, f"{len(loads)} loads for one cache id"


@needs_nixl
async def test_offers_beyond_the_links_descriptor_budget_are_a_protocol_error(monkeypatch):
    """The link's other bound, ``nixl_offers.MAX_LINK_DESCRIPTORS`` entries offered in all (lowered here to 264:
    the bait takes 64), with each offer well within ``MAX_DESCRIPTORS``: the offer that would go past it breaks
    the link, and nothing is loaded for it."""
    monkeypatch.setattr(nixl_offers, "MAX_LINK_DESCRIPTORS", 264)
    monkeypatch.setattr(nixl_offers, "OFFER_LOAD_ENTRIES", 0)  # entries alone
    loads = counted_loads(monkeypatch, 1 << 20)
    async with forging_pair() as (pair, bait, attacker, victim_link, metadata):
        attacker._send(nixl.OFFER, 1 << 20, 128, 1, (bait.layout.bases[0],), metadata)  # 192 of 264
        await loaded_by(victim_link.nixl, 1 << 20, 5)
        assert victim_link.broken is None
        attacker._send(nixl.OFFER, (1 << 20) + 1, 100, 1, (bait.layout.bases[0],), metadata)  # 292: past it
        async with asyncio.timeout(5):
            while victim_link.broken is None:
                await asyncio.sleep(0.005)
        assert "protocol error" in str(victim_link.broken), victim_link.broken
        assert loads == [1 << 20], loads


@needs_nixl
@pytest.mark.loops_take_turns  # (one loop: NIXL and its agent do not care which)
async def test_grants_name_offered_caches_only_and_go_with_their_withdrawal():
    """A ``GRANT`` of a cache the peer never offered is a protocol error (an honest peer grants a cache right
    after offering it), and a grant the peer never revoked goes with its cache's ``WITHDRAW``. Before, every
    GRANT of a new cache id was kept for the link's life: the audit had 50,000 kept, the link up."""
    from aio_datadist.transport.nixl_grants import GRANT, GRANT_INFO

    async with forging_pair() as (pair, bait, attacker, victim_link, metadata):
        victim = victim_link.nixl
        for n in range(3):  # offered, granted, withdrawn without a REVOKE
            cache_id = (1 << 20) + n
            attacker._send(nixl.OFFER, cache_id, 8, 16, (bait.layout.bases[0],), metadata)
            attacker._send(GRANT, cache_id, 0, 0, (), GRANT_INFO.pack(n + 1, 1, 0, 1))
            attacker._send(nixl.WITHDRAW, cache_id, 0, 0, (), b"")
        marker = (1 << 20) + 9  # read after the records above
        attacker._send(nixl.OFFER, marker, 8, 16, (bait.layout.bases[0],), metadata)
        await loaded_by_record(victim, lambda: marker in victim.offers_in.declared)
        assert (victim.granted.grants, victim.granted.by_model, victim_link.broken) == ({}, {}, None)
        assert not victim.granted._unrevoked, victim.granted._unrevoked  # nothing of them kept (found by audit)
        attacker._send(GRANT, 1 << 21, 0, 0, (), GRANT_INFO.pack(99, 1, 0, 1))  # never offered
        async with asyncio.timeout(5):
            while victim_link.broken is None:
                await asyncio.sleep(0.005)
        assert "protocol error" in str(victim_link.broken), victim_link.broken
        assert not victim.granted.grants


async def test_a_grant_of_an_unknown_data_type_fails_only_that_read_without_asking():
    """A ``GRANT`` whose geometry names a data type this library does not know (a hostile peer, or a newer one):
    the read without asking does not fit it, so the pull asks the owner and gets its ``LLMException``; the link
    goes on. Before, building the mismatch's message raised a bare ``ValueError`` out of ``pull_blocks`` on every
    pull by that key (found by a hunt, 2026-12-07)."""
    from aio_datadist.plans import block_shape_digest
    from aio_datadist.transport import nixl_grants
    from aio_datadist.wire import NixlRecord

    small = CacheDesc(4, (16, 4, 64), DataType.DT_FLOAT16, Placement.HOST)
    async with linked_pair(prompt_config=NIXL, decoder_config=NIXL) as pair:
        offered = pair.pm.allocate_blocks_cache(small)  # offered, never granted: no blocks key
        dst = pair.dm.allocate_blocks_cache(small)
        peer = link_to(pair.decoder, PROMPT_ID).nixl
        async with asyncio.timeout(5):
            while offered.cache_id not in peer.caches or peer.ledger is None:
                await asyncio.sleep(0.005)
        model_id = BlocksCacheKey(PROMPT_ID).model_id
        peer.on_message(NixlRecord(kind=nixl_grants.GRANT, cache_id=offered.cache_id, count=1, row_bytes=0, rows=(),
                                   blob=nixl_grants.GRANT_INFO.pack(model_id, 999, block_shape_digest(offered), 1)))
        assert peer.grant_for(model_id) is not None
        with pytest.raises(LLMException):  # the owner's answer: it has no such key
            await asyncio.wait_for(pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [0], [0]), 5)
        src = pair.pm.allocate_blocks_cache(small, BlocksCacheKey(PROMPT_ID, 1))
        fill(src, 3)
        await asyncio.wait_for(pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 1), dst, [0], [0]), 5)
        assert all(torch.equal(d[0], s[0]) for d, s in zip(dst.tensors, src.tensors))


async def loaded_by_record(victim: Any, done: Callable[[], bool], seconds: float = 5) -> None:
    """Until ``done()``: the records sent before it were read."""
    async with asyncio.timeout(seconds):
        while not done():
            await asyncio.sleep(0.005)


@needs_nixl
@pytest.mark.loops_take_turns  # (one loop: NIXL and its agent do not care which)
async def test_more_registrations_than_the_engine_ever_kept_while_the_loop_is_busy_all_complete():
    """The NIXL engine kept at most 1024 finished results for the loop to take: when the worker finished more
    calls than that before the loop read their completions (the loop busy for a moment, as a serving loop is),
    the oldest were dropped and their futures read None: 76 of 1100 caches were never registered (a
    ``TypeError`` in a callback each), and their registrations were never released once they were freed
    (found by audit). Every result is now kept until its record was taken."""
    errors: list[Any] = []
    loop = asyncio.get_running_loop()
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda lp, ctx: errors.append(ctx.get("exception") or ctx.get("message")))
    desc = CacheDesc(1, (1, 64), DataType.DT_FLOAT16, Placement.HOST)
    try:
        async with endpoint(LLMRole.PROMPT, PROMPT_ID, listen=True, **NIXL) as dd:
            agent = nixl_agent_of(dd)
            engine = agent.engine
            caches = [dd.kv_cache_manager.allocate_cache(desc) for _ in range(1100)]
            deadline = time.monotonic() + 60
            while engine.in_flight() and time.monotonic() < deadline:
                time.sleep(0.05)  # the loop is busy (a model step): the worker finishes the registrations
            async with asyncio.timeout(30):
                while agent._registering:
                    await asyncio.sleep(0.01)
            registered = sum(1 for c in caches if agent.offered(c))
            assert (registered, errors) == (1100, []), (registered, errors[:1])
            for c in caches:
                dd.kv_cache_manager.deallocate_cache(c)
    finally:
        loop.set_exception_handler(old)


@needs_nixl
async def test_offers_withdrawn_before_they_are_loaded_are_not_loaded(monkeypatch):
    """A withdrawal gives a cache's share of the budget back at once, so an offer withdrawn while its load
    still waits for the worker must not be loaded: else OFFER, WITHDRAW, OFFER, ... would queue loads without
    bound within the budget. Nor is a withdrawn cache kept (or said PREPARED) when its load ends after it."""
    loads = counted_loads(monkeypatch, 1 << 20, seconds=0.1)
    built, released, counting, entered = [], [], nixl.prepare_remote, threading.Event()

    class Watched:  # a withdrawn cache's list: released on the worker, never kept
        def __init__(self, dlist: Any) -> None:
            self.dlist = dlist

        def release(self) -> None:
            released.append(self)
            self.dlist.release()

    def watched(agent, name, cache_id, *rest):
        if cache_id == 1 << 22:
            entered.set()
        remote = counting(agent, name, cache_id, *rest)
        if cache_id in (1 << 20, 1 << 22):
            remote.dlist = Watched(remote.dlist)
            built.append(remote.dlist)
        return remote

    monkeypatch.setattr(nixl, "prepare_remote", watched)
    async with forging_pair() as (pair, bait, attacker, victim_link, metadata):
        victim = victim_link.nixl
        attacker._send(nixl.OFFER, 1 << 22, 8, 16, (bait.layout.bases[0],), metadata)
        async with asyncio.timeout(5):
            while not entered.is_set():
                await asyncio.sleep(0.005)
        attacker._send(nixl.WITHDRAW, 1 << 22, 0, 0, (), b"")  # while its list is built: dropped once it is
        for _ in range(20):
            attacker._send(nixl.OFFER, 1 << 20, 8, 16, (bait.layout.bases[0],), metadata)
            attacker._send(nixl.WITHDRAW, 1 << 20, 0, 0, (), b"")
        attacker._send(nixl.OFFER, 1 << 21, 8, 16, (bait.layout.bases[0],), metadata)  # loaded after them all
        async with asyncio.timeout(10):
            while (1 << 21) not in victim.caches:
                await asyncio.sleep(0.01)
        assert victim_link.broken is None and victim.usable()
        loads.remove(1 << 21)
        loads.remove(1 << 22)
        assert len(loads) <= 2, f"{len(loads)} loads of offers withdrawn before they were loaded"
        assert (1 << 20) not in victim.caches and (1 << 22) not in victim.caches
        await on_worker(pair.prompt, lambda agent: True)  # the worker's releases queued before this are done
        assert len(built) == len(loads) + 1 and set(map(id, released)) == set(map(id, built)), (built, released)


@needs_nixl
async def test_a_cache_freed_while_the_link_is_set_up_does_not_hold_up_link_clusters(monkeypatch):
    """The dialling end frees one of its caches after offering it and before the peer prepared it: the link's
    NIXL set-up no longer waits for that cache (its WITHDRAW went instead), so ``link_clusters`` returns as soon
    as the rest is ready, with NIXL up. Before, the set-up waited out its whole share of the call's time
    (``nixl.SETUP_SHARE``: 2 s of a 4 s timeout) for a PREPARED that could not come."""
    async with linked_pair(link=False, prompt_config=NIXL, decoder_config=NIXL) as pair:
        doomed = pair.dm.allocate_blocks_cache(BLOCKS)
        decoder_agent = nixl_agent_of(pair.decoder).engine.name
        real_prepare, entered = nixl.prepare_remote, threading.Event()

        def slow_prepare(agent, name, cache_id, *args):
            if name == decoder_agent and cache_id == doomed.cache_id and not entered.is_set():
                entered.set()
                time.sleep(0.5)  # on the prompt's worker: the decoder's cache is not prepared yet
            return real_prepare(agent, name, cache_id, *args)

        monkeypatch.setattr(nixl, "prepare_remote", slow_prepare)
        started = time.monotonic()
        linking = asyncio.create_task(pair.decoder.link_clusters([pair.info], timeout=4000))
        async with asyncio.timeout(5):
            while not entered.is_set():
                await asyncio.sleep(0.005)
        pair.dm.deallocate_cache(doomed)  # WITHDRAW, before the prompt said PREPARED
        assert await linking == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
        took = time.monotonic() - started
        assert took < 1.5, f"link_clusters took {took:.2f} s"
        assert link_to(pair.decoder, PROMPT_ID).nixl.usable()


async def offered_and_withdrawn_in_turn(attacker: Any, victim: Any, bait: Any, metadata: bytes, rows: int) -> float:
    """12 caches of ``rows`` one-byte rows inside the bait, each offered, waited for (0.15 s at most: a paced
    one is not loaded by then) and withdrawn in turn: how long it took."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    for n in range(12):
        cache_id = (1 << 20) + n
        attacker._send(nixl.OFFER, cache_id, rows, 1, (bait.layout.bases[0],), metadata)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.15):
                while cache_id not in victim.caches:
                    await asyncio.sleep(0.005)
        attacker._send(nixl.WITHDRAW, cache_id, 0, 0, (), b"")
    return loop.time() - started


@needs_nixl
@pytest.mark.loops_take_turns  # (one loop: NIXL and its agent do not care which)
async def test_a_peer_that_offers_and_withdraws_in_turn_is_paced(monkeypatch):
    """Offering a cache, waiting for it to be prepared, withdrawing it and again stays within the budget each
    time, so the budget alone let a peer keep the worker building one list after another. The loads draw on
    ``nixl_offers.MAX_LINK_DESCRIPTORS`` entries given back at ``nixl_offers.OFFER_RATE`` (lowered here to 256
    entries and 128 a second, offers of 128, the bait takes 64): after the first, about one load a second, the
    offers in between wait (their caches move over TCP meanwhile), and a paced offer is still prepared once its
    turn comes. Before, the peer had 12 lists built in the same time. (A load's own cost is left out here: the
    next test.)"""
    monkeypatch.setattr(nixl_offers, "MAX_LINK_DESCRIPTORS", 256)
    monkeypatch.setattr(nixl_offers, "OFFER_RATE", 128.0)
    monkeypatch.setattr(nixl_offers, "OFFER_LOAD_ENTRIES", 0)
    loads = counted_loads(monkeypatch, 1 << 20)
    async with forging_pair() as (pair, bait, attacker, victim_link, metadata):  # the bait: 64 entries
        victim = victim_link.nixl
        took = await offered_and_withdrawn_in_turn(attacker, victim, bait, metadata, 128)  # 128 entries each
        assert victim_link.broken is None and victim.usable()
        assert len(loads) <= 2 + took * 128 / 128 + 1, f"{len(loads)} lists built in {took:.1f} s"
        last = (1 << 20) + 12
        attacker._send(nixl.OFFER, last, 128, 1, (bait.layout.bases[0],), metadata)  # waits its turn, then loads
        async with asyncio.timeout(5):
            while last not in victim.caches:
                await asyncio.sleep(0.01)


@needs_nixl
@pytest.mark.loops_take_turns  # (one loop: NIXL and its agent do not care which)
async def test_a_peer_that_offers_and_withdraws_one_entry_caches_in_turn_is_paced(monkeypatch):
    """Each offer is a load of the peer's whole agent metadata, whatever its entries: it draws
    ``nixl_offers.OFFER_LOAD_ENTRIES`` beside them. Here 1024 of a budget of 4096 given back at 1024 a second:
    one-entry offers made, prepared and withdrawn in turn get about one load a second after the first four.
    Before, they drew one entry each and were never paced: the audit had 23,000 lists loaded in 4 s, every
    NIXL call of the endpoint 40 ms behind them; here all 12."""
    monkeypatch.setattr(nixl_offers, "MAX_LINK_DESCRIPTORS", 4096)
    monkeypatch.setattr(nixl_offers, "OFFER_RATE", 1024.0)
    loads = counted_loads(monkeypatch, 1 << 20)
    async with forging_pair() as (pair, bait, attacker, victim_link, metadata):  # the bait: 64 entries
        victim = victim_link.nixl
        took = await offered_and_withdrawn_in_turn(attacker, victim, bait, metadata, 1)
        assert victim_link.broken is None and victim.usable()
        assert len(loads) <= 3 + took + 1, f"{len(loads)} lists built in {took:.1f} s"


@contextlib.asynccontextmanager
async def paced_link(monkeypatch) -> AsyncIterator[tuple[Callable[..., None], Any]]:
    """A NIXL pair whose pace is lowered to 256 entries and 1 per second, the decoder forging the prompt's
    offers: a cache of 150 entries was offered, loaded and withdrawn, so 42 entries are left. Yields ``(send,
    the prompt's NixlPeer)``, ``send(kind, cache_id, rows)`` a record over the decoder's 64-entry bait."""
    monkeypatch.setattr(nixl_offers, "MAX_LINK_DESCRIPTORS", 256)
    monkeypatch.setattr(nixl_offers, "OFFER_RATE", 1.0)
    monkeypatch.setattr(nixl_offers, "OFFER_LOAD_ENTRIES", 0)  # entries alone, as these tests count them
    async with forging_pair() as (_pair, bait, attacker, victim_link, metadata):  # the bait: 64 entries

        def send(kind: int, cache_id: int, rows: int = 0) -> None:
            if kind == nixl.OFFER:
                attacker._send(nixl.OFFER, cache_id, rows, 1, (bait.layout.bases[0],), metadata)
            else:
                attacker._send(kind, cache_id, 0, 0, (), b"")

        send(nixl.OFFER, 1 << 20, 150)  # 150 of the 192 left: loaded at once
        await loaded_by(victim_link.nixl, 1 << 20, 5)
        send(nixl.WITHDRAW, 1 << 20)
        yield send, victim_link.nixl
        assert victim_link.broken is None and victim_link.nixl.usable()


async def loaded_by(victim: Any, cache_id: int, seconds: float) -> None:
    async with asyncio.timeout(seconds):
        while cache_id not in victim.caches:
            await asyncio.sleep(0.005)


@needs_nixl
async def test_an_offer_withdrawn_at_once_while_paced_gives_its_entries_back(monkeypatch):
    """An offer past the pace's entries that the peer withdraws in the same breath (its WITHDRAW read with its
    OFFER, before the delayed load's task first ran) was never loaded: its entries come back, and the peer's
    next offer within what is left is loaded at once. Before, a task cancelled before its first step never
    reached the refund, so the entries were lost and the next offer waited for them (minutes at this rate)."""
    async with paced_link(monkeypatch) as (send, victim):
        for n in range(1, 4):  # past the 42 left: paced, and withdrawn before anything ran
            send(nixl.OFFER, (1 << 20) + n, 150)
            send(nixl.WITHDRAW, (1 << 20) + n)
        await asyncio.sleep(0.2)  # the withdrawals are read
        send(nixl.OFFER, (1 << 20) + 9, 40)  # within the 42 left: loaded at once
        await loaded_by(victim, (1 << 20) + 9, 3)


@needs_nixl
async def test_a_paced_cache_withdrawn_and_offered_again_at_once_is_charged_once(monkeypatch):
    """A peer frees a cache whose load still waits its turn and registers it again under the same id (WITHDRAW
    and OFFER read in one pass, as an honest peer sends them): the withdrawn load's entries are back before the
    new offer draws on them, so a new offer within what is left is loaded at once. Before, they came back only
    once the cancelled task ended, a loop pass later, and the new offer waited for the old one's entries too."""
    async with paced_link(monkeypatch) as (send, victim):
        refreshed = (1 << 20) + 1
        send(nixl.OFFER, refreshed, 150)  # past the 42 left: paced
        await asyncio.sleep(0.2)  # read, its load waits
        assert refreshed not in victim.caches
        send(nixl.WITHDRAW, refreshed)
        send(nixl.OFFER, refreshed, 40)  # within the 42 left: loaded at once
        await loaded_by(victim, refreshed, 3)
