"""``link()`` at its edges: a link that lands as the comm's time runs out or as it is unlinked, and a dial the
peer took but that failed after.

Each left the two ends disagreeing before: one end's comm FAILED (or forgotten) while the link stayed in its
table, the peer's comm OK for good, and every later ``link()`` of the pair FAILED at once as already linked;
or the dialling end PREPARING for the whole link time while the peer's comm was FAILED already.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
from test_bilateral_link import DECODER_ID, DECODER_IP, PROMPT_ID, PROMPT_IP, free_port, rank_table, settled, v2_options

from aio_datadist import LLMDataDist, LLMRole, RegisterMemStatus
from aio_datadist.testing import link_to

pytestmark = pytest.mark.asyncio

OK, FAILED = RegisterMemStatus.OK, RegisterMemStatus.FAILED
INFO = {PROMPT_ID: 0, DECODER_ID: 1}


def addresses() -> str:
    return json.dumps({PROMPT_IP: f"{PROMPT_IP}:{free_port(PROMPT_IP)}",
                       DECODER_IP: f"{DECODER_IP}:{free_port(DECODER_IP)}"})


async def agree_after_unlink(p: LLMDataDist, comm_p: int, d: LLMDataDist, comm_d: int) -> None:
    """The comms do not disagree (one OK, the other FAILED: a dialler may still be PREPARING, dialling until its
    own link time); once ``d`` unlinked its comm, ``d`` holds no link and ``p``'s comm is not OK."""
    sp, sd = await settled(p, comm_p, 5), await settled(d, comm_d, 5)
    await d.unlink(comm_d)
    loop = asyncio.get_running_loop()
    end = loop.time() + 8
    while p.query_register_mem_status(comm_p) is OK and loop.time() < end:
        await asyncio.sleep(0.05)
    left, status_p = link_to(d, PROMPT_ID), p.query_register_mem_status(comm_p)
    again = await d.link("again", INFO, rank_table(PROMPT_IP, DECODER_IP))  # not refused as already linked
    await d.unlink(again)
    await p.unlink(comm_p)
    assert {sp, sd} != {OK, FAILED} and left is None and status_p is not OK, (sp, sd, left, status_p)


async def test_a_dial_taken_as_the_waiting_ends_time_runs_out_is_its_link():
    """The waiting end's ``take`` registers the link in the loop pass its link time ends: the link is its."""
    rank_addresses = addresses()
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as p, LLMDataDist(LLMRole.DECODER, DECODER_ID) as d:
        await p.init(v2_options(rank_addresses=rank_addresses, link_total_time=30))
        await d.init(v2_options(rank_addresses=rank_addresses, link_total_time=1))
        loop = asyncio.get_running_loop()
        table = d._require_links()
        real_take = table.take
        start = loop.time()
        comm_d = await d.link("c", INFO, rank_table(PROMPT_IP, DECODER_IP))  # d waits for the dial, 1 s

        async def late_take(*args, **kwargs):
            while loop.time() < start + 1.02:  # a loaded host: the dial is taken just as d's time runs out
                time.sleep(0.01)
            await asyncio.sleep(0)
            return await real_take(*args, **kwargs)

        table.take = late_take
        comm_p = await p.link("c", INFO, rank_table(PROMPT_IP, DECODER_IP))
        await agree_after_unlink(p, comm_p, d, comm_d)


async def test_a_dial_whose_handshake_ends_as_the_dialling_ends_time_runs_out_is_its_link():
    """As above on the dialling end: its handshake ends in the loop pass its link time runs out. The comm and
    the table agree (the link is the comm's), and so do the two comms."""
    rank_addresses = addresses()
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as p, LLMDataDist(LLMRole.DECODER, DECODER_ID) as d:
        await p.init(v2_options(rank_addresses=rank_addresses, link_total_time=1))
        await d.init(v2_options(rank_addresses=rank_addresses, link_total_time=30))
        loop = asyncio.get_running_loop()
        table = p._require_links()
        real_handshake = table._handshake
        comm_d = await d.link("c", INFO, rank_table(PROMPT_IP, DECODER_IP))

        async def late_handshake(*args, **kwargs):
            result = await real_handshake(*args, **kwargs)
            while loop.time() < start + 1.02:  # a loaded host: the handshake ends just as p's time runs out
                time.sleep(0.01)
            return result  # no await after: the time-out and the handshake's end land in one loop pass

        table._handshake = late_handshake
        start = loop.time()
        comm_p = await p.link("c", INFO, rank_table(PROMPT_IP, DECODER_IP))
        sp, sd = await settled(p, comm_p, 5), await settled(d, comm_d, 5)
        held = link_to(p, DECODER_ID) is not None
        await p.unlink(comm_p)
        await d.unlink(comm_d)
        assert {sp, sd} != {OK, FAILED} and (sp is OK) == held, (sp, sd, held)


async def test_an_unlink_as_the_dial_is_taken_closes_the_link_and_tells_the_peer(caplog):
    caplog.set_level(logging.INFO, logger="aio_datadist")
    rank_addresses = addresses()
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as p, LLMDataDist(LLMRole.DECODER, DECODER_ID) as d:
        await p.init(v2_options(rank_addresses=rank_addresses, link_total_time=20))
        await d.init(v2_options(rank_addresses=rank_addresses, link_total_time=20))
        table = rank_table(PROMPT_IP, DECODER_IP)
        comm_d = await d.link("c", INFO, table)
        links = d._require_links()
        real_take = links.take
        unlinking: list[asyncio.Future] = []

        async def take(*args, **kwargs):
            unlinking.append(asyncio.ensure_future(d.unlink(comm_d)))  # the caller gives up just now
            await asyncio.sleep(0)
            return await real_take(*args, **kwargs)

        links.take = take
        comm_p = await p.link("c", INFO, table)
        await settled(p, comm_p, 5)
        loop = asyncio.get_running_loop()
        end = loop.time() + 5
        while not unlinking and loop.time() < end:
            await asyncio.sleep(0.01)
        await asyncio.wait_for(unlinking[0], 15)
        end = loop.time() + 8
        while p.query_register_mem_status(comm_p) is OK and loop.time() < end:
            await asyncio.sleep(0.05)
        left, status_p = link_to(d, PROMPT_ID), p.query_register_mem_status(comm_p)
        ended = [m for r in caplog.records if f"to cluster {DECODER_ID}" in (m := r.getMessage())
                 and (" down: " in m or "failed after the peer took the dial" in m)]  # p's end of the link
        again = await d.link("again", INFO, table)
        await d.unlink(again)
        await p.unlink(comm_p)
        assert (left, status_p) == (None, FAILED)
        assert ended and all(m.endswith(" down: unlinked") or "unlinking" in m for m in ended), ended  # told


async def test_a_dial_the_peer_took_that_fails_after_is_final():
    """``aio.RequireTransport=local`` on the dialling end, against a TCP-only peer: the link is dropped after the
    peer's ``link()`` took its one dial, so both comms fail at once, not the dialler's after the link time."""
    rank_addresses = addresses()
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as p, LLMDataDist(LLMRole.DECODER, DECODER_ID) as d:
        await p.init(v2_options(transport="auto", require_transport="local", rank_addresses=rank_addresses,
                                link_total_time=20))
        await d.init(v2_options(transport="tcp", rank_addresses=rank_addresses, link_total_time=20))
        table = rank_table(PROMPT_IP, DECODER_IP)
        comm_d = await d.link("c", INFO, table)
        comm_p = await p.link("c", INFO, table)
        status_d, status_p = await settled(d, comm_d, 5), await settled(p, comm_p, 5)
        await p.unlink(comm_p)
        await d.unlink(comm_d)
        assert (status_d, status_p) == (FAILED, FAILED)
