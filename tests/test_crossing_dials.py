"""Two listening endpoints that link each other at once: their dials cross, and both ends keep the same link.

Each round checks both ends with a probe and compares the link tokens: a
link the peer unlinked (both crossing dials dropped, as before row 268)
fails the probe, as the peer's UNLINK arrives before its answer.
"""

from __future__ import annotations

import asyncio

import pytest

from aio_datadist import LLMRole, LLMStatusCode
from aio_datadist.testing import link_to
from peers import EndpointSpec, cluster_info, endpoint, port_of, spawned

S = LLMStatusCode
LINKED = [S.LLM_SUCCESS, S.LLM_ALREADY_LINK]  # the dial whose link stayed, and the one that yielded to it


async def _both_hold_one_link(a, a_id, b, b_id):
    await asyncio.wait_for(asyncio.gather(a.check_link_status(b_id), b.check_link_status(a_id)), 5)
    assert link_to(a, b_id).token == link_to(b, a_id).token  # the same link on both ends


@pytest.mark.asyncio
@pytest.mark.loops_take_turns
@pytest.mark.parametrize("transport", ["tcp", "auto"])
async def test_endpoints_that_link_each_other_at_once_keep_one_link(transport):
    async with endpoint(LLMRole.PROMPT, 1, listen=True, transport=transport) as a, \
            endpoint(LLMRole.PROMPT, 2, listen=True, transport=transport) as b:
        for _ in range(3):
            ra, rb = await asyncio.wait_for(asyncio.gather(
                a.link_clusters([cluster_info(2, port_of(b))], timeout=3000),
                b.link_clusters([cluster_info(1, port_of(a))], timeout=3000)), 10)
            assert sorted([ra[1][0], rb[1][0]]) == LINKED
            await _both_hold_one_link(a, 1, b, 2)
            assert (await a.unlink_clusters([cluster_info(2, port_of(b))]))[0] == S.LLM_SUCCESS


@pytest.mark.asyncio
async def test_two_endpoints_that_both_use_id_0_and_link_each_other_keep_one_link():
    # vllm-ascend's v0 connector uses 0 on both sides: the link tokens decide, not the ids
    async with endpoint(LLMRole.PROMPT, 0, listen=True, transport="tcp") as a, \
            endpoint(LLMRole.DECODER, 0, listen=True, transport="tcp") as b:
        for _ in range(2):
            ra, rb = await asyncio.wait_for(asyncio.gather(
                a.link_clusters([cluster_info(0, port_of(b))], timeout=3000),
                b.link_clusters([cluster_info(0, port_of(a))], timeout=3000)), 10)
            assert sorted([ra[1][0], rb[1][0]]) == LINKED
            await _both_hold_one_link(a, 0, b, 0)
            assert (await a.unlink_clusters([cluster_info(0, port_of(b))]))[0] == S.LLM_SUCCESS


@pytest.mark.asyncio
async def test_a_process_and_this_endpoint_that_link_each_other_at_once_keep_one_link(fork_server):
    spec = EndpointSpec(LLMRole.PROMPT, 1, config=(("transport", "tcp"),), lifetime=30.0)
    async with spawned(spec) as (peer,), endpoint(LLMRole.PROMPT, 2, listen=True, transport="tcp") as b:
        here = cluster_info(1, ("127.0.0.1", peer.port))
        for delay in (0.0, 0.0002, 0.0005):  # the two dials a little apart: each end may see the other's first

            async def ours(delay=delay):
                await asyncio.sleep(delay)
                return await b.link_clusters([here], timeout=3000)

            theirs, mine = await asyncio.wait_for(asyncio.gather(
                peer.call("link", 2, port_of(b)[1], timeout=3000), ours()), 10)
            assert sorted([theirs[1][0], int(mine[1][0])]) == [int(c) for c in LINKED]
            await asyncio.wait_for(asyncio.gather(peer.call("check_link", 2), b.check_link_status(1)), 5)
            assert (await b.unlink_clusters([here]))[0] == S.LLM_SUCCESS


@pytest.mark.asyncio
async def test_a_survivor_and_its_restarted_peer_that_link_each_other_at_once_keep_one_link():
    async with endpoint(LLMRole.PROMPT, 1, listen=True, transport="tcp") as p:
        for _ in range(2):
            async with endpoint(LLMRole.DECODER, 2, listen=True, transport="tcp") as old:
                assert (await old.link_clusters([cluster_info(1, port_of(p))]))[1][0] == S.LLM_SUCCESS
            # the decoder restarted under the same id: the survivor links it again as it links the survivor
            async with endpoint(LLMRole.DECODER, 2, listen=True, transport="tcp") as new:
                rp, rn = await asyncio.wait_for(asyncio.gather(
                    p.link_clusters([cluster_info(2, port_of(new))], timeout=3000),
                    new.link_clusters([cluster_info(1, port_of(p))], timeout=3000)), 10)
                assert sorted([rp[1][0], rn[1][0]]) == LINKED
                await _both_hold_one_link(p, 1, new, 2)
                await p.unlink_clusters([cluster_info(2, port_of(new))], force=True)


@pytest.mark.asyncio
async def test_a_dial_of_ours_hung_at_a_stale_address_does_not_keep_the_peers_dial_out():
    """A dials B at a stale address where a process accepts and never answers, as B dials A: B's dial links
    (with 101e811, A refused it for its own dial, which never reaches B, and B waited out its time)."""
    held = []

    async def hang(reader, writer):
        held.append(writer)
        await reader.read()  # never answers

    hung = await asyncio.start_server(hang, "127.0.0.1", 0)
    stale = hung.sockets[0].getsockname()[:2]
    try:
        async with endpoint(LLMRole.PROMPT, 1, listen=True, transport="tcp") as a, \
                endpoint(LLMRole.DECODER, 2, listen=True, transport="tcp") as b:
            a_call = asyncio.ensure_future(a.link_clusters([cluster_info(2, stale)], timeout=400))
            await asyncio.sleep(0.05)  # A's HELLO sits at the hung address
            rb = await asyncio.wait_for(b.link_clusters([cluster_info(1, port_of(a))], timeout=600), 5)
            ra = await asyncio.wait_for(a_call, 5)
            assert rb[1][0] == S.LLM_SUCCESS, (rb, ra)
            assert ra[1][0] in (S.LLM_ALREADY_LINK, S.LLM_TIMEOUT), ra
            await _both_hold_one_link(a, 1, b, 2)
    finally:
        for w in held:
            w.close()
        hung.close()
        await hung.wait_closed()
