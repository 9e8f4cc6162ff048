"""Same-host share protocol 3: the receiver answers every cache record (``MAPPED`` or ``UNMAPPED``), an owner
serves a pull in place only once the peer answered ``MAPPED``, and a region (or ledger) this process may not map
(its budget of peers' mappings spent, ``devices.host``) is refused with the share kept. These are the orderings
an honest pair meets with the answers in between, and what a peer may do with them (rows 104, 377; found by the
review of the change, 2026-12-07)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

import pytest
import torch
from _share_attacker import SEALED, memfd, record
from peers import fill, linked_pair, require_local

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    Placement,
)
from aio_datadist.devices import host
from aio_datadist.testing import loopback_options, usable_link
from aio_datadist.transport import local
from aio_datadist.transport.local import LocalShare

PROMPT, DECODER = 1, 2
SMALL = CacheDesc(1, (1, 4096), DataType.DT_UINT8, Placement.HOST)
LOCAL = {"transport": "local"}
ADD, DEL, MAPPED, UNMAPPED = 1, 2, 5, 8


@pytest.mark.asyncio
async def test_a_cache_allocated_and_pulled_at_once_is_read_in_place():
    """The owner allocates a cache and the requester (``aio.RequireTransport=local``) pulls it at once: the
    requester maps it and answers before it asks (``SameHostPlane.prepare``), so the owner has heard ``MAPPED``
    when the request comes. Without that, the owner served it over TCP and the pull failed
    ``LLM_FEATURE_NOT_ENABLED``."""
    async with linked_pair(prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        dst = pair.dm.allocate_cache(SMALL)
        await asyncio.sleep(0.05)
        require_local(pair.decoder)
        for i in range(20):
            src = pair.pm.allocate_cache(SMALL, [CacheKey(PROMPT, i)])
            values = fill(src, i)
            await pair.dm.pull_cache(CacheKey(PROMPT, i), dst, 0)
            assert torch.equal(dst.tensors[0], values[0]), i
            pair.pm.deallocate_cache(src)  # withdrawn (once the pull's key settled): its answer is forgotten with it
            share = usable_link(pair.prompt, DECODER).local
            async with asyncio.timeout(5):
                while src.cache_id in share.sent:
                    await asyncio.sleep(0.005)
            assert src.cache_id not in share.peer_mapped


@pytest.mark.asyncio
async def test_a_cache_pulled_at_once_while_the_requester_offers_a_batch_is_read_in_place():
    """The requester has just allocated 600 caches (its offers fill its share socket); the owner allocates one and
    the requester (``aio.RequireTransport=local``) pulls it at once. Its ``MAPPED`` leaves ahead of its waiting
    offers, and the pull waits for it to leave. Before, it queued behind them, the owner served over TCP and the
    pull failed ``LLM_FEATURE_NOT_ENABLED``."""
    async with linked_pair(prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        dst = pair.dm.allocate_cache(SMALL)
        await asyncio.sleep(0.05)
        require_local(pair.decoder)
        batch = [pair.dm.allocate_cache(SMALL) for _ in range(600)]
        assert usable_link(pair.decoder, PROMPT).local._out, "the offers all left: the case is not reached"
        src = pair.pm.allocate_cache(SMALL, [CacheKey(PROMPT, 1)])
        values = fill(src, 4)
        await pair.dm.pull_cache(CacheKey(PROMPT, 1), dst, 0)
        assert torch.equal(dst.tensors[0], values[0])
        for cache in batch:
            pair.dm.deallocate_cache(cache)


@pytest.mark.asyncio
async def test_the_last_of_many_caches_pulled_right_after_the_link_is_read_in_place():
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        caches = [pair.pm.allocate_cache(SMALL, [CacheKey(PROMPT, i)]) for i in range(1000)]
        values = fill(caches[-1], 9)
        dst = pair.dm.allocate_cache(SMALL)
        await pair.link()
        require_local(pair.decoder)
        await pair.dm.pull_cache(CacheKey(PROMPT, 999), dst, 0)
        assert torch.equal(dst.tensors[0], values[0])


@pytest.mark.asyncio
async def test_a_cache_allocated_and_pushed_at_once_is_copied_in_place():
    """A push needs only its source's record to have left (the owner maps it when the push names it, and answers
    ``USE_STREAM`` if it cannot): with ``aio.RequireTransport=local`` on the pusher, a cache allocated and pushed
    at once goes in place. While pushes waited for ``MAPPED`` too, it failed ``LLM_FEATURE_NOT_ENABLED``."""
    async with linked_pair(prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        dst = pair.dm.allocate_cache(SMALL)
        await asyncio.sleep(0.05)
        require_local(pair.prompt)
        for i in range(5):
            src = pair.pm.allocate_cache(SMALL)
            values = fill(src, i)
            await pair.pm.push_cache(CacheKeyByIdAndIndex(DECODER, dst.cache_id, 0), src, 0)
            assert torch.equal(dst.tensors[0], values[0]), i


@pytest.mark.asyncio
async def test_a_peer_linked_once_the_mapping_budget_is_spent_keeps_its_share(monkeypatch, caplog):
    """The requester's process maps no more of its peers' regions when a new owner links: the owner's ledger (the
    share's first record, a mapping under the same budget) and its caches are refused, the share stays and every
    pull asks and goes over TCP. Before, the ledger's ``ENOMEM`` dropped the whole share (with
    ``aio.RequireTransport=local`` on both ends the link failed)."""
    caplog.set_level(logging.INFO, logger="aio_datadist")
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        caches = [pair.pm.allocate_cache(SMALL, [CacheKey(PROMPT, i)]) for i in range(2)]
        values = fill(caches[0], 1)
        monkeypatch.setattr(host, "MAX_PEER_MAPPINGS", host._peer_mappings)  # spent before this link
        await pair.link()
        share = usable_link(pair.decoder, PROMPT).local
        assert share is not None and not share.closed and share.peer_ledger is None
        async with asyncio.timeout(5):
            while len(share.refused) < 2:
                await asyncio.sleep(0.01)
        dst = pair.dm.allocate_cache(SMALL)
        await pair.dm.pull_cache(CacheKey(PROMPT, 0), dst, 0)
        assert torch.equal(dst.tensors[0], values[0])
        assert not share.closed and usable_link(pair.decoder, PROMPT).transport == "local"
        assert "dropping the share" not in caplog.text, caplog.text


def _pair() -> tuple[LocalShare, socket.socket, list[bool]]:
    ours, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lost: list[bool] = []
    share = LocalShare(ours, lambda: lost.append(True), None, "test link")
    peer.setblocking(False)
    return share, peer, lost


def _answers(sock: socket.socket) -> list[int]:
    kinds = []
    while True:
        try:
            data = sock.recv(64)
        except OSError:
            return kinds
        if not data:
            return kinds
        kinds.append(data[0])


@pytest.mark.asyncio
async def test_refused_regions_count_against_the_peers_bound(monkeypatch):
    """A peer's regions refused past the budget count against ``MAX_REGIONS`` as mapped ones do (8 here): the
    record past it drops the share; each refused one was answered ``UNMAPPED``, a withdrawn one forgotten."""
    monkeypatch.setattr(local, "MAX_REGIONS", 8)
    monkeypatch.setattr(host, "MAX_PEER_MAPPINGS", host._peer_mappings)  # nothing more may be mapped
    share, peer, lost = _pair()
    fd = memfd(4096, SEALED)
    said: list[int] = []
    try:
        for n in range(1, 9):
            socket.send_fds(peer, [record(1, n, 4096, 1, 4096, 4096, [0])], [fd])
        share.catch_up()
        said += _answers(peer)
        assert said == [UNMAPPED] * 8 and share.refused == set(range(1, 9)) and not share.closed
        peer.send(local._ENTRY.pack(DEL, 3, 0, 0, 0, 0, 0))  # withdrawn: forgotten, room for one more
        socket.send_fds(peer, [record(1, 9, 4096, 1, 4096, 4096, [0])], [fd])
        share.catch_up()
        assert 3 not in share.refused and 9 in share.refused and not share.closed
        socket.send_fds(peer, [record(1, 10, 4096, 1, 4096, 4096, [0])], [fd])
        share.catch_up()
        assert share.closed and lost  # the 9th live one
    finally:
        share.close()
        peer.close()
        os.close(fd)


@pytest.mark.asyncio
async def test_answers_for_no_cache_of_ours_grant_nothing(caplog):
    """A peer's flood of ``MAPPED`` and ``UNMAPPED`` records naming caches we never offered: nothing kept, nothing
    logged, nothing answered, the share kept."""
    caplog.set_level(logging.INFO, logger="aio_datadist")
    share, peer, _ = _pair()
    try:
        for n in range(20000):
            try:
                peer.send(local._ENTRY.pack(MAPPED if n % 2 else UNMAPPED, n % 50 + 1, 0, 0, 0, 0, 0))
            except BlockingIOError:
                share.catch_up()
        share.catch_up()
        for _ in range(100):
            await asyncio.sleep(0)
        assert not share.closed and not share.peer_mapped and not share.peer_refused
        assert _answers(peer) == [] and "could not map our cache" not in caplog.text
    finally:
        share.close()
        peer.close()


@pytest.mark.asyncio
async def test_a_peer_that_never_reads_our_answers_loses_its_share_at_the_bound():
    """A peer sends ADD, DEL, ADD, DEL ... and never reads: each ADD is answered, the answers wait (at most
    ``MAX_UNSENT``), then the share drops."""
    share, peer, lost = _pair()
    fd = memfd(4096, SEALED)
    most = 0
    try:
        for _ in range(40000):
            if share.closed:
                break
            for body, fds in ((record(1, 1, 4096, 1, 4096, 4096, [0]), [fd]),
                              (local._ENTRY.pack(DEL, 1, 0, 0, 0, 0, 0), [])):
                for _ in range(1000):
                    try:
                        socket.send_fds(peer, [body], fds) if fds else peer.send(body)
                        break
                    except BlockingIOError:
                        share.catch_up()
                        await asyncio.sleep(0)
                    except OSError:
                        break
            most = max(most, len(share._answers))
        assert share.closed and lost and most <= local.MAX_UNSENT
    finally:
        share.close()
        peer.close()
        os.close(fd)


async def _one_shared_then_budget_spent(pair, share: LocalShare, monkeypatch) -> tuple[Any, int]:
    """The owner's cache the peer mapped (freed later, it gives room back), then the peer's budget spent: the
    cache and the mappings the budget is set to."""
    first = pair.pm.allocate_cache(SMALL)
    async with asyncio.timeout(5):
        while not share.shared(first):
            await asyncio.sleep(0.005)
    spent = host._peer_mappings
    monkeypatch.setattr(host, "MAX_PEER_MAPPINGS", spent)
    return first, spent


@pytest.mark.asyncio
async def test_a_refused_cache_is_offered_again_once_the_budget_has_room(monkeypatch):
    """The peer refused a cache of ours while its process's budget of peers' mappings was spent; once one of its
    mappings is gone (here: another of our caches, freed), it says how much room it has (``ROOM``) and we offer
    the refused cache again: it is mapped and read in place from then on. Before, a refused cache moved over TCP
    for its whole life (found by the review of the change)."""
    async with linked_pair(prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        share = usable_link(pair.prompt, DECODER).local
        first, _ = await _one_shared_then_budget_spent(pair, share, monkeypatch)
        cache = pair.pm.allocate_cache(SMALL, [CacheKey(PROMPT, 1)])
        values = fill(cache, 2)
        async with asyncio.timeout(5):
            while cache.cache_id not in share.peer_refused:
                await asyncio.sleep(0.005)
        assert pair.prompt.stats().links[DECODER].unmapped_ours == 1
        pair.pm.deallocate_cache(first)  # the peer unmaps it: room for one
        async with asyncio.timeout(5):
            while not share.shared(cache):
                await asyncio.sleep(0.005)
        assert pair.prompt.stats().links[DECODER].unmapped_ours == 0
        require_local(pair.decoder)
        dst = pair.dm.allocate_cache(SMALL)
        await pair.dm.pull_cache(CacheKey(PROMPT, 1), dst, 0)
        assert torch.equal(dst.tensors[0], values[0])


@pytest.mark.asyncio
async def test_a_peers_room_records_are_acted_on_at_most_once_a_second(monkeypatch):
    """A peer that refused our cache and then floods ``ROOM`` records gets it offered again once per
    ``ROOM_EVERY_S``, not once per record; a ``ROOM`` of more caches than a share holds drops the share."""
    monkeypatch.setattr(local, "ROOM_EVERY_S", 0.5)
    async with LLMDataDist(LLMRole.PROMPT, PROMPT) as dd:
        await dd.init(loopback_options())
        cache = dd.kv_cache_manager.allocate_cache(SMALL)
        ours, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        share = LocalShare(ours, lambda: None, None, "test link")
        peer.setblocking(False)
        room = local._ENTRY.pack(local._ROOM, 0, 1, 0, 0, 0, 0)
        try:
            share.offer(cache)
            assert _answers(peer) == [ADD]
            peer.send(local._ENTRY.pack(UNMAPPED, cache.cache_id, 0, 0, 0, 0, 0))
            for _ in range(1000):
                peer.send(room)
                share.catch_up()
            await asyncio.sleep(0.2)
            assert _answers(peer) == [DEL, ADD]  # withdrawn and offered again, once
            peer.send(local._ENTRY.pack(UNMAPPED, cache.cache_id, 0, 0, 0, 0, 0))
            peer.send(room)
            share.catch_up()
            assert _answers(peer) == []  # not yet: the last was under 0.5 s ago
            await asyncio.sleep(0.6)
            assert _answers(peer) == [DEL, ADD]
            peer.send(local._ENTRY.pack(local._ROOM, 0, local.MAX_REGIONS + 1, 0, 0, 0, 0))
            share.catch_up()
            assert share.closed
        finally:
            share.close()
            peer.close()
            dd.kv_cache_manager.deallocate_cache(cache)


async def _owner_stops_reading(pair) -> tuple[LocalShare, LocalShare, list, list]:
    """The owner stops reading its share socket (a held loop would, or records of big regions its walk bound
    reads one a turn); the requester's batch of 600 offers fills the socket, so its answer to the owner's new
    cache (key 1) waits."""
    owner = usable_link(pair.prompt, DECODER).local
    requester = usable_link(pair.decoder, PROMPT).local
    asyncio.get_running_loop().remove_reader(owner.sock.fileno())
    batch = [pair.dm.allocate_cache(SMALL) for _ in range(600)]
    src = pair.pm.allocate_cache(SMALL, [CacheKey(PROMPT, 1)])
    return owner, requester, batch, fill(src, 4)


def _reads_again(owner: LocalShare) -> None:
    if not owner.closed:
        asyncio.get_running_loop().add_reader(owner.sock.fileno(), owner._readable, local.RECORDS_PER_TURN, False,
                                              local.WALK_PER_TURN)


@pytest.mark.asyncio
@pytest.mark.parametrize("timeout", [300, None])  # None: sync_kv_timeout, 1000 ms
async def test_a_pull_that_may_take_tcp_does_not_wait_for_its_answers(timeout, monkeypatch):
    """Only a pull that must take the same-host plane (``aio.RequireTransport=local``) waits for its answers to
    leave; any other asks at once and the owner, not having heard them, serves it over TCP. While every pull
    waited up to 1 s, a pull of 300 ms (or of the default 1000 ms) failed ``LLM_TIMEOUT`` before it asked
    (found by review). Checked on the wait itself (``LocalShare.answers_left``), not by the pull's wall time: both
    endpoints share this process, and a stall of it under load failed a 0.25 s bound (2 runs in 54 under load;
    the wait, capped at half the time left, passed that bound anyway)."""
    async with linked_pair(prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        dst = pair.dm.allocate_cache(SMALL)
        await asyncio.sleep(0.05)
        owner, requester, batch, values = await _owner_stops_reading(pair)
        try:
            assert requester._out
            waited: list[float] = []
            answers_left = LocalShare.answers_left

            async def counted(self, limit_s=local.ANSWERS_WAIT_S):
                waited.append(limit_s)
                await answers_left(self, limit_s)

            monkeypatch.setattr(LocalShare, "answers_left", counted)
            await pair.dm.pull_cache(CacheKey(PROMPT, 1), dst, 0, timeout=timeout)
            assert torch.equal(dst.tensors[0], values[0])
            assert waited == [], f"the pull waited for its answers (up to {waited} s) though it may take TCP"
        finally:
            _reads_again(owner)
            for cache in batch:
                pair.dm.deallocate_cache(cache)


@pytest.mark.asyncio
@pytest.mark.parametrize("end", ["cancelled", "share lost"])
async def test_a_pull_waiting_for_its_answers_ends_with_its_call_or_its_share(end):
    """A pull that must take the same-host plane waits for its answers; cancelled there, it leaves nothing
    behind (the next pull is read in place at once once the owner reads again), and the share lost meanwhile
    ends the wait at once."""
    async with linked_pair(prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        dst = pair.dm.allocate_cache(SMALL)
        await asyncio.sleep(0.05)
        require_local(pair.decoder)
        owner, requester, batch, values = await _owner_stops_reading(pair)
        try:
            tasks = [asyncio.ensure_future(pair.dm.pull_cache(CacheKey(PROMPT, 1), dst, 0, timeout=5000))
                     for _ in range(2)]
            await asyncio.sleep(0.1)
            assert requester.answering and not any(task.done() for task in tasks)
            started = time.monotonic()
            if end == "cancelled":
                for task in tasks:
                    task.cancel()
            else:
                requester._lost()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert time.monotonic() - started < 0.5, "the wait went on"
            if end == "cancelled":
                assert all(isinstance(r, asyncio.CancelledError) for r in results), results
                _reads_again(owner)
                async with asyncio.timeout(5):
                    while requester.answering:
                        await asyncio.sleep(0.01)
                await pair.dm.pull_cache(CacheKey(PROMPT, 1), dst, 0)
                assert torch.equal(dst.tensors[0], values[0])
            else:
                assert all(isinstance(r, LLMException) for r in results), results
        finally:
            _reads_again(owner)
            for cache in batch:
                pair.dm.deallocate_cache(cache)


BLOCKS = CacheDesc(4, (2, 4096), DataType.DT_UINT8, Placement.HOST)


@pytest.mark.asyncio
async def test_a_refused_ledger_keeps_the_share_with_blocks_caches_listed(monkeypatch, caplog):
    """The owner's blocks cache is listed in its ledger (its record names a slot); the requester's budget is
    spent before the link: the ledger is refused, the record taken as unlisted (and refused too), the share
    stays and a pull by blocks key goes over TCP (with the slot kept, the share dropped: review)."""
    caplog.set_level(logging.INFO, logger="aio_datadist")
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT, 0))
        values = fill(src, 3)
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        monkeypatch.setattr(host, "MAX_PEER_MAPPINGS", host._peer_mappings)
        await pair.link()
        share = usable_link(pair.decoder, PROMPT).local
        async with asyncio.timeout(5):
            while src.cache_id not in share.refused and not share.closed:
                await asyncio.sleep(0.01)
        assert not share.closed and share.peer_ledger is None
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT, 0), dst, [1], [0])
        assert torch.equal(dst.tensors[0][0], values[0][1])
        assert "dropping the share" not in caplog.text, caplog.text


@pytest.mark.asyncio
async def test_a_second_ledger_after_a_refused_one_drops_the_share(monkeypatch):
    monkeypatch.setattr(host, "MAX_PEER_MAPPINGS", host._peer_mappings)
    share, peer, lost = _pair()
    fd = memfd(local.LEDGER_BYTES, SEALED)
    ledger_record = local._ENTRY.pack(local._LEDGER, 0, local.LEDGER_BYTES, 0, 0, 0, 0)
    try:
        socket.send_fds(peer, [ledger_record], [fd])
        share.catch_up()
        assert not share.closed and share.peer_ledger is None
        monkeypatch.setattr(host, "MAX_PEER_MAPPINGS", host._peer_mappings + 10)  # room now
        socket.send_fds(peer, [ledger_record], [fd])
        share.catch_up()
        assert share.closed and lost
    finally:
        share.close()
        peer.close()
        os.close(fd)


@pytest.mark.asyncio
async def test_a_receiver_says_room_at_most_once_a_second_and_refuses_without_a_walk(monkeypatch):
    """Past the budget a region is refused before its pages are walked (an owner's offers again cost nothing when
    they do not fit); once room comes the receiver says ``ROOM`` for as many as it could map, at most once per
    ``ROOM_EVERY_S`` however often mappings are given back."""
    monkeypatch.setattr(local, "ROOM_EVERY_S", 0.5)
    monkeypatch.setattr(host, "MAX_PEER_MAPPINGS", host._peer_mappings)
    share, peer, lost = _pair()
    fd = memfd(16 * 4096, SEALED)
    try:
        for n in (1, 2):
            socket.send_fds(peer, [record(1, n, 16 * 4096, 1, 4096, 4096, [0])], [fd])
        share._readable(local.RECORDS_PER_TURN, False, local.WALK_PER_TURN)
        assert share._walked == 0 and share.refused == {1, 2}, "a refused region was walked"
        assert _answers(peer) == [UNMAPPED, UNMAPPED]
        monkeypatch.setattr(host, "MAX_PEER_MAPPINGS", host._peer_mappings + 1)  # room for one
        for _ in range(5):
            local._room_again()  # as each mapping given back does
            await asyncio.sleep(0.01)
        said = [data for data in _records(peer)]
        assert [r[0] for r in said] == [local._ROOM] and local._ENTRY.unpack(said[0])[2] == 1, said
        local._room_again()
        await asyncio.sleep(0.2)
        assert _records(peer) == []  # not again within the second
        await asyncio.sleep(0.5)
        assert [r[0] for r in _records(peer)] == [local._ROOM]  # its timer: refusals still there, room too
        assert not share.closed and not lost
    finally:
        share.close()
        peer.close()
        os.close(fd)


def _records(sock: socket.socket) -> list[bytes]:
    out = []
    while True:
        try:
            data = sock.recv(local.MAX_MESSAGE)
        except OSError:
            return out
        if not data:
            return out
        out.append(data)


@pytest.mark.asyncio
async def test_every_refused_cache_is_offered_again_when_room_is_there_for_all(monkeypatch):
    """A ``ROOM`` for more caches than ``ROOM_BATCH`` is acted on in batches, one per ``ROOM_EVERY_S``, until all
    are offered again. Before, the owner offered the first 256 and forgot the rest (found by review)."""
    monkeypatch.setattr(local, "ROOM_EVERY_S", 0.1)
    monkeypatch.setattr(local, "ROOM_BATCH", 16)
    async with linked_pair(prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        share = usable_link(pair.prompt, DECODER).local
        first, spent = await _one_shared_then_budget_spent(pair, share, monkeypatch)
        caches = [pair.pm.allocate_cache(SMALL) for _ in range(40)]
        async with asyncio.timeout(10):
            while len(share.peer_refused) < 40:
                await asyncio.sleep(0.01)
        monkeypatch.setattr(host, "MAX_PEER_MAPPINGS", spent + 40)  # room for every one once `first` goes
        pair.pm.deallocate_cache(first)  # one mapping given back: the receiver says ROOM (40)
        async with asyncio.timeout(5):
            while sum(share.shared(c) for c in caches) < 40:
                await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_room_given_back_while_a_share_refuses_is_not_lost(monkeypatch):
    """A mapping given back (on another thread) between the receiver's look at the budget and its registering to
    hear of room: it says ``ROOM`` all the same. Before, nobody was told and the share held its refusal while the
    budget had room (found by review: 1 to 4 of 200 rounds with real 8 MiB regions)."""
    monkeypatch.setattr(local, "ROOM_EVERY_S", 0.2)
    spent = host._peer_mappings
    monkeypatch.setattr(host, "MAX_PEER_MAPPINGS", spent)
    real = local.peer_room

    def checked_then_given_back():
        seen = real()  # the receiver reads "spent" ...
        monkeypatch.setattr(host, "MAX_PEER_MAPPINGS", spent + 1)  # ... then a mapping is given back elsewhere
        thread = threading.Thread(target=local._room_again)
        thread.start()
        thread.join()
        monkeypatch.setattr(local, "peer_room", real)
        return seen

    monkeypatch.setattr(local, "peer_room", checked_then_given_back)
    share, peer, _ = _pair()
    fd = memfd(16 * 4096, SEALED)
    try:
        socket.send_fds(peer, [record(1, 1, 16 * 4096, 1, 4096, 4096, [0])], [fd])
        share._readable(local.RECORDS_PER_TURN, False, local.WALK_PER_TURN)
        assert share.refused == {1} and host.peer_room()[0] >= 1
        await asyncio.sleep(0.5)
        kinds = [r[0] for r in _records(peer)]
        assert local._ROOM in kinds, f"room in the budget, a refused region, and no ROOM said: {kinds}"
    finally:
        share.close()
        peer.close()
        os.close(fd)


@pytest.mark.asyncio
async def test_a_bad_fd_drops_the_share_with_the_budget_spent_too(monkeypatch):
    """Past the budget a record is refused before its pages are walked, but its fd is still checked (its kind,
    size and seals: no walk): a pipe, an unsealed memfd or a size past the file drops the share as it does with
    room. Before, they were answered ``UNMAPPED`` and the share kept (found by review)."""
    monkeypatch.setattr(host, "MAX_PEER_MAPPINGS", host._peer_mappings)
    r, w = os.pipe()
    unsealed, small = memfd(4096, 0), memfd(4096, SEALED)
    try:
        for fd, size in ((r, 4096), (unsealed, 4096), (small, 1 << 30)):
            share, peer, lost = _pair()
            try:
                socket.send_fds(peer, [record(1, 1, size, 1, 4096, 4096, [0])], [fd])
                share._readable(local.RECORDS_PER_TURN, False, None)
                assert share.closed and lost and _answers(peer) == [], (fd, size)
            finally:
                share.close()
                peer.close()
    finally:
        for fd in (r, w, unsealed, small):
            os.close(fd)


@pytest.mark.asyncio
async def test_a_peer_of_an_older_share_protocol_is_refused_at_connect():
    """``ROOM`` came with share protocol 4: a version-3 peer would take it for an unknown record and drop the share,
    so a listener that says version 3 is refused when the share connects, and the link uses TCP."""
    assert local.SHARE_VERSION == 4
    name = b"\0aio_datadist.test." + os.urandom(8).hex().encode()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(name)
    listener.listen(1)
    listener.setblocking(False)
    loop = asyncio.get_running_loop()

    async def old_peer() -> None:
        conn, _ = await loop.sock_accept(listener)
        with conn:
            await loop.sock_sendall(conn, local._CHALLENGE.pack(local._MAGIC, 3, os.urandom(32)))
            await asyncio.sleep(0.5)

    serving = asyncio.ensure_future(old_peer())
    try:
        with pytest.raises(ConnectionRefusedError, match="version 3"):
            await local.connect_share(name, os.urandom(16), None)
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        listener.close()


@pytest.mark.asyncio
async def test_a_refused_cache_kept_by_its_key_is_offered_again_too(monkeypatch):
    """A refused cache deallocated but kept by its cache key is still ours to serve: it is offered again with the
    rest when room comes (re-offering through the registry's live caches skipped it, and it took the room of
    those behind it: review). Closing the share lets go of every cache it offered."""
    monkeypatch.setattr(local, "ROOM_EVERY_S", 0.1)
    async with linked_pair(prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        share = usable_link(pair.prompt, DECODER).local
        first, spent = await _one_shared_then_budget_spent(pair, share, monkeypatch)
        kept = pair.pm.allocate_cache(SMALL, [CacheKey(PROMPT, 5)])
        values = fill(kept, 5)
        other = pair.pm.allocate_cache(SMALL)
        async with asyncio.timeout(5):
            while len(share.peer_refused) < 2:
                await asyncio.sleep(0.01)
        pair.pm.deallocate_cache(kept)  # its key keeps it
        monkeypatch.setattr(host, "MAX_PEER_MAPPINGS", spent + 2)
        pair.pm.deallocate_cache(first)  # room
        async with asyncio.timeout(5):
            while not (share.shared(kept) and share.shared(other)):
                await asyncio.sleep(0.02)
        require_local(pair.decoder)
        dst = pair.dm.allocate_cache(SMALL)
        await pair.dm.pull_cache(CacheKey(PROMPT, 5), dst, 0)
        assert torch.equal(dst.tensors[0], values[0])
        share.close()
        assert not share.sent and not share.peer_refused


@pytest.mark.asyncio
async def test_the_room_hook_does_nothing_for_another_process_shares():
    """In a forked child, the parent's shares (and loops) are not the child's: the hook that hears of room (which
    the child's first unmaps may run before the child's own fork hook cleared them) tells none of them."""
    share, peer, _ = _pair()
    said: list[bool] = []
    share._say_room = lambda: said.append(True)  # type: ignore[method-assign]
    try:
        local._refusing[id(share)] = weakref.ref(share)
        real_pid = local._refusing_pid
        local._refusing_pid = os.getpid() + 1  # as in a child before its fork hook ran
        try:
            local._room_again()
        finally:
            local._refusing_pid = real_pid
        await asyncio.sleep(0.05)
        assert not said and id(share) in local._refusing
        local._room_again()  # this process's: told
        await asyncio.sleep(0.05)
        assert said and id(share) not in local._refusing
    finally:
        local._refusing.pop(id(share), None)
        share.close()
        peer.close()


class _AllLayersNow:
    async def synchronize_layer(self, layer: int, timeout: float) -> bool:
        return True


@pytest.mark.asyncio
@pytest.mark.parametrize("side", ["pusher", "owner"])
async def test_a_layer_wise_push_of_many_layers_released_at_once_stays_in_place(side):
    """100 layers released at once to one same-host peer: the pusher keeps at most ``local.MAX_LOCAL_PUSHES`` of
    them in flight on the link, the owner's bound on the copies it runs for a peer, so every layer goes in place
    (``aio.RequireTransport=local`` on either end). Before, the owner answered the 65th and later "stream it" and
    the transfer failed ``LLM_FEATURE_NOT_ENABLED`` (found by a hunt)."""
    from aio_datadist import TransferWithCacheKeyConfig
    layers = 100
    desc = CacheDesc(2 * layers, (1, 128 * 1024), DataType.DT_UINT8, Placement.HOST)
    async with linked_pair(prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        dst = pair.dm.allocate_cache(desc)
        src = pair.pm.allocate_cache(desc)
        values = fill(src, 3)
        await asyncio.sleep(0.1)
        require_local(pair.prompt if side == "pusher" else pair.decoder)
        config = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(DECODER, dst.cache_id, 0))
        async with asyncio.timeout(30):
            await pair.pm.transfer_cache_async(src, _AllLayersNow(), [config])
        assert all(torch.equal(d, v) for d, v in zip(dst.tensors, values, strict=True))


@pytest.mark.asyncio
@pytest.mark.parametrize("strict", ["pusher", "owner"])
async def test_a_row_cut_into_blocks_with_a_shorter_last_piece_goes_in_place(strict):
    """v2 ``transfer_cache_async`` of a contiguous row into a same-host peer's blocks with a
    ``dst_block_memory_size`` that does not divide the row: the last, shorter piece starts inside the row, and
    ``PUSH_LOCAL`` names that offset (``src_offset``, wire version 11), so every piece is copied in place; with
    ``aio.RequireTransport=local`` on either end (which refuses a streamed piece) every byte lands where it
    should. Before, the last piece streamed: refused at the call with the pusher strict, and with the owner
    alone strict the first piece landed before the owner refused the second (found by a hunt)."""
    from _v2peer import v2_options
    from peers import cluster_info, port_of

    from aio_datadist import LLMStatusCode, TransferWithCacheKeyConfig

    class Ready:
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int) -> bool:
            return True

    def options(listen: bool, mine: bool) -> dict[str, Any]:
        base = v2_options(listen=listen, transport="local")
        return {**base, "aio.RequireTransport": "local"} if mine else base

    async with LLMDataDist(LLMRole.PROMPT, 1) as prompt, LLMDataDist(LLMRole.DECODER, 2) as decoder:
        await prompt.init(options(True, strict == "pusher"))
        await decoder.init(options(False, strict == "owner"))
        dst = decoder.cache_manager.allocate_blocks_cache(CacheDesc(2, (8, 96), DataType.DT_FLOAT16,
                                                                    Placement.HOST), BlocksCacheKey(2, 0))
        assert (await decoder.link_clusters([cluster_info(1, port_of(prompt))]))[0] == LLMStatusCode.LLM_SUCCESS
        src = prompt.cache_manager.allocate_cache(CacheDesc(2, (1, 256), DataType.DT_FLOAT16, Placement.HOST))
        values = fill(src, 3)
        await asyncio.sleep(0.05)  # the source's record reached the owner
        task = prompt.cache_manager.transfer_cache_async(src, Ready(), [TransferWithCacheKeyConfig(
            BlocksCacheKey(2, 0))], None, [2, 7, 4], dst_block_memory_size=192)
        assert await task.synchronize(10000) == LLMStatusCode.LLM_SUCCESS
        assert await task.get_results() == [LLMStatusCode.LLM_SUCCESS]
        for got, row in zip(dst.tensors, values, strict=True):
            assert torch.equal(got[2], row[0, :96]) and torch.equal(got[7], row[0, 96:192])
            assert torch.equal(got[4, :64], row[0, 192:]) and not got[4, 64:].any()
            assert not got[[0, 1, 3, 5, 6]].any()


@pytest.mark.asyncio
async def test_a_layer_that_waited_for_a_push_slot_and_is_told_to_stream_keeps_its_time():
    """A layer-wise push's layer waits for one of the link's same-host push slots (within its ``queue_ms``: here
    the 64 slots are held 0.4 s, as another transfer's pushes would) and is then told to stream (a device source
    into the peer's host cache): the stream plane gets the push's time-out, the slot wait counted as queueing.
    Before, it counted against the time-out and the layer failed at once (``timed out``; found by review)."""
    from aio_datadist import TransferWithCacheKeyConfig
    cfg = {"device_type": "host", "transport": "local", "sync_kv_timeout": 300}
    async with linked_pair(prompt_config=cfg, decoder_config=cfg) as pair:
        dst = pair.dm.allocate_cache(CacheDesc(8, (1, 4096), DataType.DT_UINT8, Placement.HOST))
        src = pair.pm.allocate_cache(CacheDesc(8, (1, 4096), DataType.DT_UINT8, Placement.DEVICE))
        values = fill(src, 5)
        await asyncio.sleep(0.1)
        share = usable_link(pair.prompt, DECODER).local
        for _ in range(local.MAX_LOCAL_PUSHES):
            await share.pushes.acquire()
        asyncio.get_running_loop().call_later(
            0.4, lambda: [share.pushes.release() for _ in range(local.MAX_LOCAL_PUSHES)])
        config = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(DECODER, dst.cache_id, 0))
        async with asyncio.timeout(10):
            await pair.pm.transfer_cache_async(src, _AllLayersNow(), [config])
        assert all(torch.equal(d, v.cpu()) for d, v in zip(dst.tensors, values, strict=True))
