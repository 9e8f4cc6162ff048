"""Two listening endpoints that link each other at once: their dials cross, and exactly one link stays.

Each round checks both ends with a probe: a link the peer unlinked (both
crossing dials dropped, as before row 268) fails it, as the peer's UNLINK
arrives before its answer.
"""

from __future__ import annotations

import asyncio

import pytest

from aio_datadist import LLMRole, LLMStatusCode
from aio_datadist.testing import link_to
from peers import EndpointSpec, cluster_info, endpoint, port_of, spawned

S = LLMStatusCode
LINKED = [S.LLM_SUCCESS, S.LLM_ALREADY_LINK]  # the dial that stayed, and the one that yielded to it


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
            await asyncio.wait_for(asyncio.gather(a.check_link_status(2), b.check_link_status(1)), 5)
            assert link_to(a, 2).token == link_to(b, 1).token  # the same link on both ends
            assert (await a.unlink_clusters([cluster_info(2, port_of(b))]))[0] == S.LLM_SUCCESS


@pytest.mark.asyncio
async def test_two_endpoints_that_both_use_id_0_and_link_each_other_keep_one_link():
    # vllm-ascend's v0 connector uses 0 on both sides: the nonces decide, not the ids
    async with endpoint(LLMRole.PROMPT, 0, listen=True, transport="tcp") as a, \
            endpoint(LLMRole.DECODER, 0, listen=True, transport="tcp") as b:
        ra, rb = await asyncio.wait_for(asyncio.gather(
            a.link_clusters([cluster_info(0, port_of(b))], timeout=3000),
            b.link_clusters([cluster_info(0, port_of(a))], timeout=3000)), 10)
        assert sorted([ra[1][0], rb[1][0]]) == LINKED
        await asyncio.wait_for(asyncio.gather(a.check_link_status(0), b.check_link_status(0)), 5)


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
                await asyncio.wait_for(asyncio.gather(p.check_link_status(2), new.check_link_status(1)), 5)
