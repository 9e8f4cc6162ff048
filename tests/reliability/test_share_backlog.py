"""A same-host share whose peer reads its records later than they are sent stays a share.

The owner sends a record per cache it offers (ADD, with the cache's memfd) and
withdraws (DEL) on a non-blocking socket. A few hundred at once (a batch of
caches freed, a peer linking to an owner of many) fill it; that was taken for
a lost share: the link fell back to TCP for good, reads without asking
stopped, and with ``aio.RequireTransport=local`` every later pull of that peer
was refused. Now what the socket does not take waits for it to take more, in
order (the peer counts our caches, and a cache withdrawn and offered again
must not be withdrawn after its new offer); a cache whose ADD still waits is
served as one the peer does not have (it is not named to the peer before its
record). The first test's peer runs in a process of its own, reading as its
loop does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from collections import deque

import pytest
import torch
from _forked import forked
from _harness import endpoint
from peers import CacheSpec, EndpointSpec, PeerError, Ref, fill, linked_pair, port_of, tensors_from_dump

from aio_datadist import BlocksCacheKey, CacheDesc, CacheKey, DataType, LLMException, LLMRole, LLMStatusCode, Placement
from aio_datadist import link_dials as link_dials_module
from aio_datadist.devices import host
from aio_datadist.testing import registry_of, runtime_of, usable_link
from aio_datadist.transport import local as local_module

S = LLMStatusCode
PROMPT, DECODER = 1, 2
SMALL = CacheDesc(1, (1, 4096), DataType.DT_UINT8, Placement.HOST)


def decoder_spec(**config: str) -> EndpointSpec:
    return EndpointSpec(LLMRole.DECODER, DECODER, listen=False, caches=(CacheSpec("dst", SMALL, 0),),
                        config=(("transport", "local"), *config.items()))


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_an_owner_that_frees_a_batch_of_caches_keeps_its_share(fork_server):
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="local", require_transport="local") as dd:
        kv = dd.kv_cache_manager
        async with forked(decoder_spec(require_transport="local")) as (dec,):
            assert (await dec.call("link", PROMPT, port_of(dd)[1]))[0] == S.LLM_SUCCESS
            batch = []
            for i in range(1500):  # allocated over time: the peer keeps up with these records
                batch.append(kv.allocate_cache(SMALL))
                if i % 50 == 0:
                    await asyncio.sleep(0.005)
            await asyncio.sleep(0.5)
            share = usable_link(dd, DECODER).local
            assert share is not None
            dec.stop()  # a peer that reads later (stopped here, so the socket fills whatever the host's pace)
            try:
                for cache in batch:  # the batch is done: freed at once
                    kv.deallocate_cache(cache)
                backlog = len(share._out)
            finally:
                dec.resume()
            for _ in range(500):  # the peer reads its way through (a cache offered meanwhile goes over TCP)
                if not share._out:
                    break
                await asyncio.sleep(0.01)
            key = CacheKey(PROMPT, 1)
            cache = kv.allocate_cache(SMALL, [key])
            values = fill(cache, 5)
            kv.deallocate_cache(cache)
            try:
                await dec.call("kv", "pull_cache", key, Ref("dst"), 0)
                failed = None
            except LLMException as exc:
                failed = exc.status_code
            assert backlog > 0  # the socket was full: the case at hand
            assert (usable_link(dd, DECODER).local, failed) == (share, None)
            got = tensors_from_dump(SMALL, await dec.call("dump", "dst"))
            assert torch.equal(got[0], values[0])
            assert not share.closed


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_peer_that_links_to_an_owner_of_many_caches_shares_them(fork_server):
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="local") as dd:
        kv = dd.kv_cache_manager
        caches = [kv.allocate_cache(SMALL) for _ in range(1000)]  # held before the peer links
        async with forked(decoder_spec()) as (dec,):
            try:
                status = (await dec.call("link", PROMPT, port_of(dd)[1]))[0]
            except PeerError as exc:
                status = exc
            transport = usable_link(dd, DECODER).transport if status == S.LLM_SUCCESS else None
        for cache in caches:
            kv.deallocate_cache(cache)
        assert (status, transport) == (S.LLM_SUCCESS, "local")


@pytest.mark.asyncio
async def test_a_share_lost_as_it_attaches_leaves_the_link_over_tcp(monkeypatch):
    """Before, ``link_clusters`` raised a bare AssertionError."""
    async def closed_share(name: bytes, token: bytes, secret: bytes | None) -> socket.socket:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        theirs.close()  # the peer proved the link and closed its end at once
        return mine

    monkeypatch.setattr(link_dials_module, "connect_share", closed_share)
    local = {"transport": "local"}
    async with linked_pair(link=False, prompt_config=local, decoder_config=local) as pair:
        assert await pair.decoder.link_clusters([pair.info], timeout=3000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert usable_link(pair.decoder, PROMPT).transport == "tcp"


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_batch_freed_and_as_many_allocated_at_once_keeps_the_peer_under_its_bound():
    """2400 caches freed and 2400 allocated while the socket is full: in order, the peer never holds more than
    the owner does (the DELs sent last made it hold both batches, past its bound of 4096, and drop the share)."""
    count = 2400
    assert count < local_module.MAX_REGIONS < 2 * count
    local = {"transport": "local"}
    async with linked_pair(prompt_config=local, decoder_config=local) as pair:
        kv = pair.prompt.kv_cache_manager
        share, peer = usable_link(pair.prompt, DECODER).local, usable_link(pair.decoder, PROMPT).local
        assert share is not None and peer is not None
        batch = []
        for i in range(count):
            batch.append(kv.allocate_cache(SMALL))
            if i % 50 == 0:
                await asyncio.sleep(0.005)
        for _ in range(300):
            if len(peer.regions) == count and not share._out:
                break
            await asyncio.sleep(0.01)
        for cache in batch:
            kv.deallocate_cache(cache)
        backlog = len(share._out)
        batch = [kv.allocate_cache(SMALL) for _ in range(count)]
        for _ in range(500):
            await asyncio.sleep(0.01)
            if share.closed or peer.closed or not share._out:
                break
        await asyncio.sleep(0.05)
        peer.catch_up()
        state = (share.closed, peer.closed, len(peer.regions))
        for cache in batch:
            kv.deallocate_cache(cache)
        assert backlog > 0 and state == (False, False, count), (backlog, state)


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_cache_offered_again_behind_a_backlog_stays_shared():
    """``remap_registered_memory``'s step (withdraw, offer again) for a device cache while withdrawals wait: the
    peer ends with the cache mapped, as this end counts it (the new offer went ahead of the withdrawal of the
    old one, and every pull of it failed ``LLM_LINK_FAILED`` on a healthy link)."""
    host = {"device_type": "host", "transport": "local"}
    blocks = CacheDesc(4, (6, 3, 512), DataType.DT_FLOAT16, Placement.DEVICE)
    async with linked_pair(prompt_config=host, decoder_config=host) as pair:
        src = pair.pm.allocate_blocks_cache(blocks, BlocksCacheKey(PROMPT, 0))
        values = fill(src, 7)
        dst = pair.dm.allocate_blocks_cache(blocks)
        share, peer = usable_link(pair.prompt, DECODER).local, usable_link(pair.decoder, PROMPT).local
        assert share is not None and peer is not None
        for _ in range(200):
            share.catch_up()
            if src.cache_id in share.peer_mapped:
                break
            await asyncio.sleep(0.01)
        batch = []
        for i in range(1000):
            batch.append(pair.pm.allocate_cache(SMALL))
            if i % 50 == 0:
                await asyncio.sleep(0.005)
        await asyncio.sleep(0.3)
        for cache in batch:
            pair.pm.deallocate_cache(cache)
        assert share._out
        registry_of(pair.prompt).refresh(src)
        for _ in range(300):
            await asyncio.sleep(0.01)
            share.catch_up()
            if not share._out and src.cache_id in share.peer_mapped:
                break
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT, 0), dst, [0], [1])
        assert all(torch.equal(d[1], v[0]) for d, v in zip(dst.tensors, values, strict=True))


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_peer_that_falls_too_far_behind_loses_its_share(monkeypatch):
    """The records held back are bounded (``MAX_UNSENT``): a peer that reads none while its share changes."""
    monkeypatch.setattr(local_module, "MAX_UNSENT", 64)
    local = {"transport": "local"}
    async with linked_pair(prompt_config=local, decoder_config=local) as pair:
        peer = usable_link(pair.decoder, PROMPT).local
        assert peer is not None
        pair.decoder._endpoint.runtime.loop.remove_reader(peer.sock.fileno())  # it reads nothing more
        kv = pair.prompt.kv_cache_manager
        made = []
        for _ in range(5000):
            made.append(kv.allocate_cache(SMALL))
            if usable_link(pair.prompt, DECODER).local is None:
                break
        for cache in made:
            kv.deallocate_cache(cache)
        assert usable_link(pair.prompt, DECODER).local is None and len(made) < 5000


class _Counted(deque):
    """A deque that counts the walks and searches made of it (searches in C too), for every deque of its kind: the
    share's queue is one, and a compaction makes another (``local.deque`` is this class in the test)."""

    walks = 0

    def _walked(self) -> None:
        _Counted.walks += 1

    def __iter__(self):
        self._walked()
        return super().__iter__()

    def __reversed__(self):
        self._walked()
        return super().__reversed__()

    def __contains__(self, value):
        self._walked()
        return super().__contains__(value)

    def __delitem__(self, index):
        self._walked()
        return super().__delitem__(index)

    def remove(self, value):
        self._walked()
        return super().remove(value)

    def index(self, *args):
        self._walked()
        return super().index(*args)

    def count(self, value):
        self._walked()
        return super().count(value)


def _unsent(share: local_module.LocalShare) -> int:
    """The records ``share`` still has to send (an ADD withdrawn before it left is marked, not removed)."""
    return sum(1 for entry in share._out if entry[0] is not None)


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_an_offer_still_waiting_when_its_cache_is_freed_is_dropped_never_sent():
    """Caches allocated faster than the share socket takes their offers (no await between them): a cache whose
    offer (ADD) still waits is not served as shared, and one freed then has its ADD dropped, with no withdrawal
    (DEL) queued behind it. The tests above passed with the waiting ADD sent and then withdrawn, or with
    ``shared`` blind to waiting ADDs (audit, 2026-12-07)."""
    local = {"transport": "local"}
    async with linked_pair(prompt_config=local, decoder_config=local) as pair:
        kv = pair.prompt.kv_cache_manager
        share = usable_link(pair.prompt, DECODER).local
        assert share is not None
        made = [kv.allocate_cache(SMALL) for _ in range(1500)]  # no await: the socket fills, ADDs wait
        waiting = {entry[2][1] for entry in share._out if entry[2] is not None and entry[2][0] == local_module._ADD}
        assert waiting, "the socket took every record: the case is not reached"
        assert not any(share.shared(cache) for cache in made if cache.cache_id in waiting)
        usable_link(pair.decoder, PROMPT).local.catch_up()  # the socket takes more while records still wait
        made.append(kv.allocate_cache(SMALL))
        assert share._out[-1][2] == (local_module._ADD, made[-1].cache_id), "a record went ahead of those waiting"
        before = _unsent(share)
        freed = [cache for cache in made if cache.cache_id in waiting]
        for cache in freed:
            kv.deallocate_cache(cache)
        left = {entry[2][1] for entry in share._out if entry[2] is not None and entry[2][0] == local_module._ADD}
        assert not left & {cache.cache_id for cache in freed}, "a freed cache's ADD is still to be sent"
        assert _unsent(share) == before - len(freed), "freeing a cache whose ADD waited queued a DEL"
        for cache in made:
            if cache.cache_id not in waiting:
                kv.deallocate_cache(cache)
        async with asyncio.timeout(5):
            while share._out:
                await asyncio.sleep(0.01)
        assert not share.closed


@pytest.mark.asyncio
@pytest.mark.parametrize("when", ["before", "after"])
async def test_an_owner_of_more_caches_than_the_peer_maps_keeps_its_share(monkeypatch, caplog, when):
    """The peer maps at most ``MAX_REGIONS`` of an owner's caches (8 here; 4096 in use): the owner offers no more
    than that, so its caches past the bound are served over the data channels and the share stays, with the pulls
    of the shared caches on it. Before, the owner offered every cache and the peer took the record past its bound
    for a bad one: the whole share dropped (a WARNING), every cache moved over TCP, and pulls in flight on the share
    failed ``LLM_LINK_FAILED`` (an honest owner of 4097 caches; found by a hunt). ``when``: the caches are
    allocated before the link (its first offers) or after it (later offers)."""
    monkeypatch.setattr(local_module, "MAX_REGIONS", 8)
    caplog.set_level(logging.WARNING, logger="aio_datadist")
    local = {"transport": "local"}
    async with linked_pair(link=False, prompt_config=local, decoder_config=local) as pair:
        kv = pair.prompt.kv_cache_manager
        caches = [kv.allocate_cache(SMALL, [CacheKey(PROMPT, i)]) for i in range(12 if when == "before" else 6)]
        await pair.link()
        if when == "after":
            caches += [kv.allocate_cache(SMALL, [CacheKey(PROMPT, i)]) for i in range(6, 12)]
        values = [fill(cache, i) for i, cache in enumerate(caches)]
        share = usable_link(pair.prompt, DECODER).local
        assert share is not None and len(share.sent) == 8
        dst = pair.decoder.kv_cache_manager.allocate_cache(SMALL)
        for i in (0, 7, 8, 11):  # shared, and past the bound
            await pair.decoder.kv_cache_manager.pull_cache(CacheKey(PROMPT, i), dst, 0)
            assert torch.equal(dst.tensors[0], values[i][0]), i
        assert not share.closed and usable_link(pair.decoder, PROMPT).transport == "local"
        kv.deallocate_cache(caches[1])
        kv.remove_cache_key(CacheKey(PROMPT, 1))  # freed, withdrawn: room again, and a cache allocated now is offered
        fresh = kv.allocate_cache(SMALL, [CacheKey(PROMPT, 99)])
        assert fresh.cache_id in share.sent and len(share.sent) == 8
        assert "dropping the share" not in caplog.text, caplog.text


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_batch_freed_in_reverse_behind_a_peer_that_reads_nothing_is_dropped_at_once(monkeypatch):
    """4000 caches whose offers wait behind a peer that reads nothing (stopped, hung), freed newest first: each
    withdrawal marks its waiting ADD instead of searching the queue for it. Before, each searched (the owner's
    loop held 0.27 s for 3722 such caches; quadratic in them). When the peer reads again it gets the records of
    the caches still there, in order, and maps exactly those."""
    local = {"transport": "local"}
    async with linked_pair(prompt_config=local, decoder_config=local) as pair:
        kv = pair.prompt.kv_cache_manager
        share = usable_link(pair.prompt, DECODER).local
        peer = usable_link(pair.decoder, PROMPT).local
        assert share is not None and peer is not None
        loop = asyncio.get_running_loop()
        loop.remove_reader(peer.sock.fileno())  # the peer reads nothing for now
        made = [kv.allocate_cache(SMALL) for _ in range(4000)]  # (the peer maps at most 4096)
        assert _unsent(share) > 3000, "the socket took the records: the case is not reached"
        kept = made[::50]
        monkeypatch.setattr(local_module, "deque", _Counted)
        share._out = _Counted(share._out)  # how often the queue is walked or searched
        _Counted.walks = 0
        started = time.monotonic()
        for cache in reversed(made):
            if cache not in kept:
                kv.deallocate_cache(cache)
        took = time.monotonic() - started
        assert took < 0.15, f"freeing {len(made) - len(kept)} caches took {took:.2f} s"
        walks = _Counted.walks
        assert walks <= 16, f"{len(made) - len(kept)} withdrawals searched the queue {walks} times"  # compactions
        peer._readable(local_module.RECORDS_PER_TURN)  # and it reads again
        loop.add_reader(peer.sock.fileno(), peer._readable, local_module.RECORDS_PER_TURN, False,
                        local_module.WALK_PER_TURN)
        async with asyncio.timeout(10):
            while share._out or set(peer.regions) != {cache.cache_id for cache in kept}:
                await asyncio.sleep(0.01)
        assert not share.closed and not peer.closed
        for cache in kept:
            kv.deallocate_cache(cache)


@pytest.mark.asyncio
async def test_an_owner_whose_caches_the_peer_cannot_map_keeps_its_share(monkeypatch, caplog):
    """The receiving process maps at most ``host.MAX_PEER_MAPPINGS`` regions of all its peers together (row 104).
    Once that is spent (here: set to what it maps now, after the link), the peer answers an owner's new cache
    ``UNMAPPED`` and keeps the share: the owner serves that cache over the data channels and the caches mapped
    before stay in place; with ``aio.RequireTransport=local`` only a pull of a refused cache fails, and says why.
    Before, the region past the budget dropped the owner's whole share as a hostile peer's (a WARNING), and every
    cache moved over TCP (with ``aio.RequireTransport=local`` the link failed; found by a hunt)."""
    caplog.set_level(logging.INFO, logger="aio_datadist")
    local = {"transport": "local"}
    async with linked_pair(link=False, prompt_config=local, decoder_config=local) as pair:
        kv = pair.prompt.kv_cache_manager
        caches = [kv.allocate_cache(SMALL, [CacheKey(PROMPT, i)]) for i in range(3)]
        await pair.link()
        share = usable_link(pair.prompt, DECODER).local
        peer = usable_link(pair.decoder, PROMPT).local
        assert share is not None and peer is not None
        monkeypatch.setattr(host, "MAX_PEER_MAPPINGS", host._peer_mappings)  # no room left in this process
        caches += [kv.allocate_cache(SMALL, [CacheKey(PROMPT, i)]) for i in range(3, 6)]
        values = [fill(cache, i) for i, cache in enumerate(caches)]
        dst = pair.decoder.kv_cache_manager.allocate_cache(SMALL)
        for i in (0, 1, 3, 4):  # (a pull by cache key consumes it: 2 and 5 are pulled below)
            await pair.decoder.kv_cache_manager.pull_cache(CacheKey(PROMPT, i), dst, 0)
            assert torch.equal(dst.tensors[0], values[i][0]), i
        assert [share.shared(cache) for cache in caches] == [True] * 3 + [False] * 3
        assert peer.refused == {cache.cache_id for cache in caches[3:]} and set(peer.regions) >= {
            cache.cache_id for cache in caches[:3]}
        assert not share.closed and not peer.closed and usable_link(pair.decoder, PROMPT).transport == "local"
        ours, theirs = pair.prompt.stats().links[DECODER], pair.decoder.stats().links[PROMPT]
        assert (ours.unmapped_ours, theirs.unmapped_theirs) == (3, 3), (ours, theirs)  # the operator sees them
        assert "dropping the share" not in caplog.text, caplog.text
        assert "cannot map its cache" in caplog.text and "could not map our cache" in caplog.text
        kv.deallocate_cache(caches[4])  # withdrawn: the peer forgets its refusal (it counted against MAX_REGIONS)
        async with asyncio.timeout(5):
            while caches[4].cache_id in peer.refused:
                await asyncio.sleep(0.01)
        rt = runtime_of(pair.decoder)
        monkeypatch.setattr(rt, "settings", dataclasses.replace(rt.settings, require_transport="local"))
        await pair.decoder.kv_cache_manager.pull_cache(CacheKey(PROMPT, 2), dst, 0)  # still read in place
        assert torch.equal(dst.tensors[0], values[2][0])
        with pytest.raises(LLMException) as refused:
            await pair.decoder.kv_cache_manager.pull_cache(CacheKey(PROMPT, 5), dst, 0)
        assert refused.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED, refused.value
        assert not share.closed and not peer.closed
