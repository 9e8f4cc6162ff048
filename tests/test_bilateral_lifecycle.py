"""``link()`` against finalize, a peer that never answers, a comm that failed, and ``switch_role``.

Each broke before: finalize returned with a link an unlink still waited on open; a dial whose handshake was never
answered held its comm for the whole link time; a FAILED comm kept waiting for its other peers and took the dial
a newer comm of the pair waited for (the two ends disagreeing); a ``link()`` during a ``switch_role`` left a
listener that outlived finalize.
"""

from __future__ import annotations

import asyncio
import errno
import json
import socket

import pytest
from test_bilateral_link import (
    DECODER_ID,
    DECODER_IP,
    PROMPT_ID,
    PROMPT_IP,
    THIRD_ID,
    THIRD_IP,
    free_port,
    rank_table,
    settled,
    v2_options,
)

from aio_datadist import (
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    RegisterMemStatus,
    link_dials,
    link_table,
    protocol,
)
from aio_datadist.links import Link
from aio_datadist.testing import link_table_of, link_to

pytestmark = pytest.mark.asyncio

OK, FAILED = RegisterMemStatus.OK, RegisterMemStatus.FAILED
INFO = {PROMPT_ID: 0, DECODER_ID: 1}


def addresses(*ips: str) -> str:
    return json.dumps({ip: f"{ip}:{free_port(ip)}" for ip in ips})


async def _init_and_link(p: LLMDataDist, d: LLMDataDist, total_s: int) -> list[int]:
    """Initialise ``p`` and ``d`` (CacheManager mode, each rank at an address of its own, ``llm.LinkTotalTime``
    ``total_s``) and link them as comm "c": the two comm ids."""
    ra = addresses(PROMPT_IP, DECODER_IP)
    await p.init(v2_options(rank_addresses=ra, link_total_time=total_s))
    await d.init(v2_options(rank_addresses=ra, link_total_time=total_s))
    table = rank_table(PROMPT_IP, DECODER_IP)
    return await asyncio.gather(p.link("c", INFO, table), d.link("c", INFO, table))


async def _comm_a_up(d: LLMDataDist, p: LLMDataDist, info: dict, table: str) -> tuple[int, int]:
    """Comm "a" at ``d`` and ``p`` (``d`` first), once ``d`` holds its link to the prompt (5 s at most): the two
    comm ids."""
    comm_a = await d.link("a", info, table)
    comm_ap = await p.link("a", info, table)
    loop = asyncio.get_running_loop()
    end = loop.time() + 5
    while link_to(d, PROMPT_ID) is None and loop.time() < end:
        await asyncio.sleep(0.02)
    assert link_to(d, PROMPT_ID) is not None
    return comm_a, comm_ap


def listening(ip: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((ip, port)) == 0


async def test_finalize_during_a_comm_unlink_closes_the_link_it_waits_on(monkeypatch):
    """unlink(comm) takes the link out of the table and waits for the peer's answer: a finalize meanwhile closes
    that link too before it returns."""
    monkeypatch.setattr(link_table, "UNLINK_WAIT_S", 0.1)
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as p, LLMDataDist(LLMRole.DECODER, DECODER_ID) as d:
        comm_p, comm_d = await _init_and_link(p, d, 10)
        assert await settled(p, comm_p, 5) is OK and await settled(d, comm_d, 5) is OK
        d_runtime, dispatch = d._endpoint.runtime, Link._dispatch

        def deaf(self: Link, event: object) -> None:  # d does not answer p's UNLINK (a loaded peer)
            if not (isinstance(event, protocol.Unlink) and self.runtime is d_runtime):
                dispatch(self, event)

        monkeypatch.setattr(Link, "_dispatch", deaf)
        link = link_to(p, DECODER_ID)
        assert link is not None
        unlinking = asyncio.ensure_future(p.unlink(comm_p))
        await asyncio.sleep(0.1)
        assert not unlinking.done()
        await asyncio.wait_for(p.finalize(), 5)
        closed = link.closed
        await asyncio.wait_for(unlinking, 5)
        monkeypatch.setattr(Link, "_dispatch", dispatch)
        assert closed, "finalize returned with a link of the endpoint open"


async def test_finalize_during_a_comm_unlink_waits_for_the_peers_answer_to_it(monkeypatch):
    """The peer answers the unlink's UNLINK late (within UNLINK_WAIT_S): a finalize meanwhile waits for that
    answer before it closes the link, so the unlink reads the peer's answer, not a link closed under it."""
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as p, LLMDataDist(LLMRole.DECODER, DECODER_ID) as d:
        comm_p, comm_d = await _init_and_link(p, d, 10)
        assert await settled(p, comm_p, 5) is OK and await settled(d, comm_d, 5) is OK
        d_runtime, dispatch, disconnect = d._endpoint.runtime, Link._dispatch, link_table.LinkTable.disconnect
        statuses: list[LLMStatusCode] = []

        def slow(self: Link, event: object) -> None:  # d answers p's UNLINK 0.3 s late (a loaded peer)
            if isinstance(event, protocol.Unlink) and self.runtime is d_runtime:
                asyncio.get_running_loop().call_later(0.3, dispatch, self, event)
            else:
                dispatch(self, event)

        async def recorded(self: link_table.LinkTable, *args: object, **kwargs: object) -> LLMStatusCode:
            statuses.append(await disconnect(self, *args, **kwargs))
            return statuses[-1]

        monkeypatch.setattr(Link, "_dispatch", slow)
        monkeypatch.setattr(link_table.LinkTable, "disconnect", recorded)
        link = link_to(p, DECODER_ID)
        assert link is not None and link_table.UNLINK_WAIT_S >= 1
        unlinking = asyncio.ensure_future(p.unlink(comm_p))
        for _ in range(500):  # until the unlink's UNLINK left
            if link.unlinking:
                break
            await asyncio.sleep(0.01)
        assert link.unlinking
        await asyncio.wait_for(p.finalize(), 5)
        assert link.closed
        await asyncio.wait_for(unlinking, 5)
        assert statuses == [LLMStatusCode.LLM_SUCCESS], "finalize closed the link before the peer's answer"


async def test_finalize_tells_the_peer_of_a_comm_unlink_that_had_not_yet(monkeypatch):
    """finalize comes while unlink(comm) still settles the pushes it serves, before its UNLINK left: finalize
    tells the peer (it answers) before it closes the link."""
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as p, LLMDataDist(LLMRole.DECODER, DECODER_ID) as d:
        comm_p, comm_d = await _init_and_link(p, d, 10)
        assert await settled(p, comm_p, 5) is OK and await settled(d, comm_d, 5) is OK
        d_runtime, dispatch, settle_served = d._endpoint.runtime, Link._dispatch, Link.settle_served
        disconnect, statuses = link_table.LinkTable.disconnect, []
        link = link_to(p, DECODER_ID)
        assert link is not None
        entered, gate, told = asyncio.Event(), asyncio.Event(), []

        def heard(self: Link, event: object) -> None:
            if isinstance(event, protocol.Unlink) and self.runtime is d_runtime:
                told.append(event)
                gate.set()  # the unlink goes on while finalize waits for the answer: it reads finalize's
            dispatch(self, event)

        async def recorded(self: link_table.LinkTable, *args: object, **kwargs: object) -> LLMStatusCode:
            statuses.append(await disconnect(self, *args, **kwargs))
            return statuses[-1]

        async def held(self: Link, **kwargs: bool) -> None:  # the unlink's settling (the first) waits for gate
            if self is link and not entered.is_set():
                entered.set()
                await gate.wait()
            await settle_served(self, **kwargs)

        monkeypatch.setattr(Link, "_dispatch", heard)
        monkeypatch.setattr(Link, "settle_served", held)
        monkeypatch.setattr(link_table.LinkTable, "disconnect", recorded)
        unlinking = asyncio.ensure_future(p.unlink(comm_p))
        await asyncio.wait_for(entered.wait(), 5)
        try:
            await asyncio.wait_for(p.finalize(), 5)
        finally:
            gate.set()
        await asyncio.wait_for(unlinking, 5)
        assert link.closed
        assert told, "finalize closed the link without telling the peer"
        assert len(told) == 1 and statuses == [LLMStatusCode.LLM_SUCCESS], "the unlink told the peer again"


async def test_a_dial_whose_handshake_is_never_answered_is_dialled_again(monkeypatch):
    """The rank-1 address first holds a listener that accepts and never answers (a hung old instance); then the
    real peer comes up there: the dialling comm reaches it, dialling again, within the link time."""
    monkeypatch.setattr(link_dials, "BILATERAL_ANSWER_S", 0.3)
    d_port = free_port(DECODER_IP)
    ra = json.dumps({PROMPT_IP: f"{PROMPT_IP}:{free_port(PROMPT_IP)}", DECODER_IP: f"{DECODER_IP}:{d_port}"})
    held: list[asyncio.StreamWriter] = []
    accepted = asyncio.Event()

    def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        accepted.set()

    server = await asyncio.start_server(silent, DECODER_IP, d_port)
    try:
        async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as p, LLMDataDist(LLMRole.DECODER, DECODER_ID) as d:
            await p.init(v2_options(rank_addresses=ra, link_total_time=30))
            comm_p = await p.link("c", INFO, rank_table(PROMPT_IP, DECODER_IP))
            await asyncio.wait_for(accepted.wait(), 5)
            server.close()  # the hung instance's listener goes; its accepted connection stays, unanswered
            await d.init(v2_options(rank_addresses=ra, link_total_time=30))
            comm_d = await d.link("c", INFO, rank_table(PROMPT_IP, DECODER_IP))
            status_p, status_d = await settled(p, comm_p, 5), await settled(d, comm_d, 5)
            await asyncio.gather(p.unlink(comm_p), d.unlink(comm_d))
        assert (status_p, status_d) == (OK, OK)
    finally:
        for writer in held:
            writer.close()
        server.close()


@pytest.mark.parametrize("hangs", [False, True])
async def test_a_connect_that_fails_with_etimedout_is_dialled_again(monkeypatch, hangs):
    """The dial's connect fails with the kernel's ``ETIMEDOUT`` (an ``OSError`` that is also a ``TimeoutError``),
    twice: it is dialled again within the link time and the comm comes up on both ends (the test above covers a
    handshake never answered only, and passed with an ``ETIMEDOUT`` ending the comm; audit, 2026-12-07). With
    ``hangs``, the connect never ends (a SYN dropped): ``BILATERAL_ANSWER_S`` bounds the connect too."""
    monkeypatch.setattr(link_dials, "BILATERAL_ANSWER_S", 0.3)
    real, failed = link_dials.open_control, []

    async def times_out(address, *args, **kwargs):
        if len(failed) < 2:
            failed.append(address)
            if hangs:
                await asyncio.Event().wait()
            raise TimeoutError(errno.ETIMEDOUT, "Connection timed out")
        return await real(address, *args, **kwargs)

    monkeypatch.setattr(link_dials, "open_control", times_out)
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as p, LLMDataDist(LLMRole.DECODER, DECODER_ID) as d:
        comm_p, comm_d = await _init_and_link(p, d, 30)
        status = await settled(p, comm_p, 10), await settled(d, comm_d, 10)
        await asyncio.gather(p.unlink(comm_p), d.unlink(comm_d))
    assert len(failed) == 2
    assert status == (OK, OK)


@pytest.mark.parametrize("first", ["d", "t"])
async def test_a_failed_comm_leaves_the_dials_of_a_newer_comm_of_the_pair_alone(first):
    """d is rank 2 of a comm A {p: 0, t: 1, d: 2}; p links with it, t has not called link() yet. p goes away: A
    is FAILED on d, and stops waiting for t. d and t then link a comm B of their own: both ends read OK (before,
    d's B failed at once as already linked while A took t's dial, and t's B read OK). With t first, t calls
    link() for B and dials d before d calls it: A must have stopped its attempts when its link to p went down,
    not at d's next link() (found by audit: either check alone passed with d first)."""
    cfg = dict(rank_addresses=addresses(PROMPT_IP, DECODER_IP, THIRD_IP), link_total_time=20)
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as d, LLMDataDist(LLMRole.MIX, THIRD_ID) as t:
        await d.init(v2_options(**cfg))
        await t.init(v2_options(**cfg))
        async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as p:
            await p.init(v2_options(**cfg))
            info_a, table_a = {PROMPT_ID: 0, THIRD_ID: 1, DECODER_ID: 2}, rank_table(PROMPT_IP, THIRD_IP, DECODER_IP)
            comm_a, comm_ap = await _comm_a_up(d, p, info_a, table_a)
            await p.unlink(comm_ap)
        assert await settled(d, comm_a, 5) is FAILED
        info_b, table_b = {THIRD_ID: 0, DECODER_ID: 1}, rank_table(THIRD_IP, DECODER_IP)
        if first == "d":
            comm_bd = await d.link("b", info_b, table_b)
            comm_bt = await t.link("b", info_b, table_b)
        else:
            comm_bt = await t.link("b", info_b, table_b)  # t (rank 0) dials d, which has not called link() for B
            loop = asyncio.get_running_loop()
            end = loop.time() + 1
            while link_to(d, THIRD_ID) is None and loop.time() < end:  # a stale A would take the dial meanwhile
                await asyncio.sleep(0.02)
            comm_bd = await d.link("b", info_b, table_b)
        status_d, status_t = await settled(d, comm_bd, 5), await settled(t, comm_bt, 5)
        await asyncio.gather(d.unlink(comm_bd), t.unlink(comm_bt), d.unlink(comm_a))
        assert (status_d, status_t) == (OK, OK)


async def test_a_comm_whose_attempt_ends_without_its_link_stops_its_other_attempts(monkeypatch):
    """d's comm A {d: 0, p: 1, t: 2}: its attempt to p ends without its link (a final status) before t calls
    link(): A fails and stops dialling t at once, so t's comm C {d: 0, t: 1} takes d's dial for C, not A's stale
    one, and reads as d's does (the tests above fail A by a link that went down only)."""
    dial = link_dials.LinkDials._dial_bilateral

    async def refused(self: link_dials.LinkDials, remote_id: int, *args: object) -> object:
        return LLMStatusCode.LLM_LINK_FAILED if remote_id == PROMPT_ID else await dial(self, remote_id, *args)

    monkeypatch.setattr(link_dials.LinkDials, "_dial_bilateral", refused)
    cfg = dict(rank_addresses=addresses(PROMPT_IP, DECODER_IP, THIRD_IP), link_total_time=20)
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as d, LLMDataDist(LLMRole.MIX, THIRD_ID) as t:
        await d.init(v2_options(**cfg))
        await t.init(v2_options(**cfg))
        comm_a = await d.link("a", {DECODER_ID: 0, PROMPT_ID: 1, THIRD_ID: 2},
                              rank_table(DECODER_IP, PROMPT_IP, THIRD_IP))
        assert await settled(d, comm_a, 5) is FAILED
        info_c, table_c = {DECODER_ID: 0, THIRD_ID: 1}, rank_table(DECODER_IP, THIRD_IP)
        comm_ct = await t.link("c", info_c, table_c)  # t listens; a stale A would dial it meanwhile
        loop = asyncio.get_running_loop()
        end = loop.time() + 1
        while link_to(t, DECODER_ID) is None and loop.time() < end:
            await asyncio.sleep(0.02)
        comm_cd = await d.link("c", info_c, table_c)
        status_d, status_t = await settled(d, comm_cd, 5), await settled(t, comm_ct, 5)
        await asyncio.gather(d.unlink(comm_cd), t.unlink(comm_ct), d.unlink(comm_a))
        assert (status_d, status_t) == (OK, OK)


async def test_a_link_a_failed_comm_made_while_it_was_stopped_is_unlinked(monkeypatch):
    """d's comm A {p: 0, t: 1, d: 2} took t's dial, and that link is still being set up when A fails (p unlinks):
    the stopped attempt hands the link over, and A unlinks it (the peer told), so no link outlives its comm."""
    cfg = dict(rank_addresses=addresses(PROMPT_IP, DECODER_IP, THIRD_IP), link_total_time=20)
    entered, gate = asyncio.Event(), asyncio.Event()
    require_transport = link_dials.LinkDials._require_transport
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as d, LLMDataDist(LLMRole.MIX, THIRD_ID) as t:
        await d.init(v2_options(**cfg))
        await t.init(v2_options(**cfg))
        d_table = link_table_of(d)

        async def held(self: link_dials.LinkDials, link: Link) -> None:  # d's link to t: set up once gate is set
            if self is d_table and link.remote_cluster_id == THIRD_ID:
                entered.set()
                await gate.wait()
            await require_transport(self, link)

        monkeypatch.setattr(link_dials.LinkDials, "_require_transport", held)
        info_a, table_a = {PROMPT_ID: 0, THIRD_ID: 1, DECODER_ID: 2}, rank_table(PROMPT_IP, THIRD_IP, DECODER_IP)
        try:
            async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as p:
                await p.init(v2_options(**cfg))
                comm_a, comm_ap = await _comm_a_up(d, p, info_a, table_a)
                comm_at = await t.link("a", info_a, table_a)
                await asyncio.wait_for(entered.wait(), 5)  # d took t's dial; the link is being set up
                taken = link_to(d, THIRD_ID)
                assert taken is not None
                await p.unlink(comm_ap)
            assert await settled(d, comm_a, 5) is FAILED
            loop = asyncio.get_running_loop()
            end = loop.time() + 5
            while not taken.closed and loop.time() < end:
                await asyncio.sleep(0.02)
            assert taken.closed, "a link of the failed comm outlived it"
        finally:
            gate.set()
        await asyncio.gather(d.unlink(comm_a), t.unlink(comm_at))


async def test_link_during_switch_role_leaves_no_listener_behind_finalize():
    """d listens on A; switch_role moves it to B; a link() while the switch stops the old listener waits for the
    switch and is refused (its rank maps to C, not B), and nothing listens after finalize (before, it listened
    on C and the switch's listen on B orphaned that listener, which outlived finalize)."""
    a, b, c = (free_port(DECODER_IP) for _ in range(3))
    ra = json.dumps({PROMPT_IP: f"{PROMPT_IP}:{free_port(PROMPT_IP)}", DECODER_IP: f"{DECODER_IP}:{c}"})
    d = LLMDataDist(LLMRole.DECODER, DECODER_ID)
    options = v2_options(rank_addresses=ra, link_total_time=5)
    options["llm.listenIpInfo"] = f"{DECODER_IP}:{a}"
    await d.init(options)
    try:
        switching = asyncio.ensure_future(d.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"{DECODER_IP}:{b}"}))
        await asyncio.sleep(0)  # the switch stops the listener on A
        with pytest.raises(LLMException) as refused:
            await d.link("c", INFO, rank_table(PROMPT_IP, DECODER_IP))
        await asyncio.wait_for(switching, 5)
        assert refused.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert d.listen_address == (DECODER_IP, b) and d.role is LLMRole.PROMPT
        with pytest.raises(LLMException) as again:  # a second listener would orphan the first
            await d._require_links().listener.listen(DECODER_IP, c)
        assert again.value.status_code == LLMStatusCode.LLM_FAILED and not listening(DECODER_IP, c)
    finally:
        await asyncio.wait_for(d.finalize(), 5)
    assert [port for port in (a, b, c) if listening(DECODER_IP, port)] == []


async def test_a_link_waiting_for_a_switch_that_finalize_ends_is_refused_as_finalized():
    """``link()`` waits while ``switch_role`` holds the listening lock; a ``finalize`` meanwhile makes it raise
    ``LLM_ENGINE_FINALIZED`` as every call after finalize does (a rank that only dials returned a comm id on
    the closed table: found by review)."""
    a, b = free_port(PROMPT_IP), free_port(PROMPT_IP)
    addresses = json.dumps({PROMPT_IP: f"{PROMPT_IP}:{free_port(PROMPT_IP)}",
                            DECODER_IP: f"{DECODER_IP}:{free_port(DECODER_IP)}"})
    prompt = LLMDataDist(LLMRole.PROMPT, PROMPT_ID)
    options = v2_options(rank_addresses=addresses, link_total_time=5)
    options["llm.listenIpInfo"] = f"{PROMPT_IP}:{a}"
    await prompt.init(options)
    switching = asyncio.ensure_future(prompt.switch_role(LLMRole.DECODER, {"llm.listenIpInfo": f"{PROMPT_IP}:{b}"}))
    linking = asyncio.ensure_future(prompt.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, rank_table(PROMPT_IP, DECODER_IP)))
    await asyncio.sleep(0)  # the switch holds the lock, stopping the listener; link() waits for it
    assert link_table_of(prompt).listening.locked() and not linking.done()
    await prompt.finalize()
    done, _ = await asyncio.wait([switching, linking], timeout=5)
    assert len(done) == 2 and isinstance(switching.exception(), LLMException)
    assert isinstance(linking.exception(), LLMException), linking.result()
    assert linking.exception().status_code == LLMStatusCode.LLM_ENGINE_FINALIZED
