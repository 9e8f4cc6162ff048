"""A same-host share whose peer reads its records later than they are sent stays a share.

The owner sends a record per cache it offers (ADD, with the cache's memfd) and
withdraws (DEL) on a non-blocking socket. A few hundred at once (a batch of
caches freed, a peer linking to an owner of many) fill it; that was taken for
a lost share: the link fell back to TCP for good, reads without asking
stopped, and with ``aio.RequireTransport=local`` every later pull of that peer
was refused. Now what the socket does not take waits for it to take more, the
DELs behind everything else; a cache whose ADD still waits is served as one
the peer does not have (it is not named to the peer before its record). The
peer runs in a process of its own, reading as its loop does.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch
from _forked import forked
from _harness import endpoint
from peers import CacheSpec, EndpointSpec, PeerError, Ref, fill, linked_pair, port_of, tensors_from_dump

from aio_datadist import CacheDesc, CacheKey, DataType, LLMException, LLMRole, LLMStatusCode, Placement
from aio_datadist import link_table as link_table_module
from aio_datadist.testing import usable_link

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
            for cache in batch:  # the batch is done: freed at once
                kv.deallocate_cache(cache)
            backlog = len(share._dels)
            key = CacheKey(PROMPT, 1)
            cache = kv.allocate_cache(SMALL, [key])  # offered behind the DELs the socket did not take
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
            for _ in range(200):  # and the peer gets every DEL
                if not share._dels:
                    break
                await asyncio.sleep(0.01)
            assert not share._dels and not share.closed


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

    monkeypatch.setattr(link_table_module, "connect_share", closed_share)
    local = {"transport": "local"}
    async with linked_pair(link=False, prompt_config=local, decoder_config=local) as pair:
        assert await pair.decoder.link_clusters([pair.info], timeout=3000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert usable_link(pair.decoder, PROMPT).transport == "tcp"
