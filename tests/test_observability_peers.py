"""What a peer can do to what an operator sees: rows 355-357 (found by a hunt, 2026-12-07; each failed before).

A link's ``up_seconds`` counts from its ``up`` event whatever its peer did before; the same-host share socket logs
refused connections at the listener's pace (row 202); a NIXL peer's ``DECLINE`` reason is shown escaped (row 182).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import pytest

from peers import NIXL_MISSING
from test_observability import cluster

from aio_datadist import LLMDataDist, LLMRole, LLMStatusCode
from aio_datadist.testing import loopback_options, open_pair


@pytest.mark.asyncio
@pytest.mark.loops_take_turns  # (2 s of SHARE_AUTH_S each: one loop per run)
async def test_up_seconds_of_a_link_whose_peer_did_not_finish_sharing_counts_from_its_up_event(caplog, monkeypatch):
    """A peer that attaches the same-host share but never says it is ready: the dialler waits SHARE_AUTH_S (2 s),
    falls back to TCP and only then is the link up; stats() must not say it has been up those 2 s."""
    from aio_datadist.links import Link

    def attach_share_silently(self, sock):  # the peer's end: shares, never announces READY
        self.attach_local(sock)

    monkeypatch.setattr(Link, "attach_share", attach_share_silently)
    caplog.set_level(logging.INFO, logger="aio_datadist")
    prompt, decoder = LLMDataDist(LLMRole.PROMPT, 11), LLMDataDist(LLMRole.DECODER, 12)
    async with prompt, decoder:
        await prompt.init(loopback_options(listen=True, transport="auto"))
        await decoder.init(loopback_options(transport="auto"))
        status, _ = await decoder.link_clusters([cluster(11, prompt.listen_address)], timeout=5000)
        assert status == LLMStatusCode.LLM_SUCCESS
        now = time.time()
        up = [r for r in caplog.records if " up, " in r.getMessage() and r.cluster_id == 12]
        link = decoder.stats().links[11]
        assert link.transport == "tcp"
        assert link.up_seconds <= now - up[-1].created + 0.05, (link.up_seconds, now - up[-1].created)


@pytest.mark.asyncio
async def test_a_process_opening_share_connection_after_connection_cannot_flood_the_log(caplog):
    """As guarantee 202 for the listener: a local process that connects to the same-host share socket again and
    again with a claim that proves nothing gets its refusals logged at WARNING at most once in a while, not one
    WARNING line per connection."""
    from aio_datadist.testing import share_listener_of
    from aio_datadist.transport import local

    caplog.set_level(logging.DEBUG, logger="aio_datadist")
    async with open_pair(prompt_config={"transport": "auto"}, decoder_config={"transport": "auto"}) as pair:
        name = share_listener_of(pair.prompt).name
        loop = asyncio.get_running_loop()
        for _ in range(200):
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
                sock.setblocking(False)
                await loop.sock_connect(sock, name)
                async with asyncio.timeout(2):
                    await loop.sock_recv(sock, 1024)  # the challenge
                    await loop.sock_sendall(sock, local._CLAIM.pack(local._MAGIC, os.urandom(32), os.urandom(32)))
                    assert await loop.sock_recv(sock, 1024) == b""  # refused: closed
        warned = [r for r in caplog.records if r.levelno >= logging.WARNING
                  and "did not prove a live link" in r.getMessage()]
        assert len(warned) <= 1, f"{len(warned)} WARNING lines for 200 refused share connections"


@pytest.mark.asyncio
@pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING or "")
async def test_a_nixl_peers_decline_reason_reaches_the_log_escaped(caplog):
    """Every text from a peer is shown with what is not printable escaped (guarantee 182): a linked NIXL peer's
    DECLINE reason too, else a peer writes whole forged lines (and terminal escapes) into our WARNING."""
    from aio_datadist.testing import link_to
    from aio_datadist.transport import nixl

    caplog.set_level(logging.INFO, logger="aio_datadist")
    prompt, decoder = LLMDataDist(LLMRole.PROMPT, 11), LLMDataDist(LLMRole.DECODER, 12)
    async with prompt, decoder:
        await prompt.init(loopback_options(listen=True, transport="nixl"))
        await decoder.init(loopback_options(transport="nixl"))
        status, _ = await decoder.link_clusters([cluster(11, prompt.listen_address)], timeout=5000)
        assert status == LLMStatusCode.LLM_SUCCESS
        peer = link_to(prompt, 12).nixl
        assert peer is not None
        forged = b"x)\nCRITICAL aio_datadist forged: transfer of cache 1 corrupted \x1b[2J\xe2\x80\xae"
        peer._send(nixl.DECLINE, 0, 0, 0, (), forged)  # the hostile peer's DECLINE
        for _ in range(100):
            said = [r.getMessage() for r in caplog.records if "gave it up" in r.getMessage()]
            if said:
                break
            await asyncio.sleep(0.01)
        assert said, "the decline was not logged"
        assert all(m.isprintable() for m in said), said
