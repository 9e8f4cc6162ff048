"""The fd budget holds for the fds a link opens after its handshake (docs/transports.md, ``fd_budget.py``).

- an accepting endpoint whose ``RLIMIT_NOFILE`` leaves room for N links
  keeps the fds of each accepted link claimed until its data channels are
  attached: a peer whose handshakes run ahead of its data channels, or a
  burst of honest decoders, gets at most N links, and the endpoint never
  holds more fds than N links take;
- a dialling endpoint claims the data channels a peer's ``LINK_OK`` names
  past its own ``aio.DataChannels`` before it dials them: a peer that names
  16 gets ``LLM_CLUSTER_NUM_EXCEED_LIMIT`` and no data connection, not 33 fds
  against a claim of 5, while one that names as many as ours links.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator

import pytest

from aio_datadist import LLMRole, LLMStatusCode, fd_budget, wire
from aio_datadist.wire import Msg
from peers import cluster_info

from _harness import endpoint, open_fds
from _intruders import Child, limited_main
from _rawpeer import RawLink, Refused, dial, proof, recv_frame

S = LLMStatusCode
ROOM = 2
CONFIG = {"transport": "tcp", "max_pending_handshakes": 4}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _handshake(raw: RawLink) -> None:
    """``raw``'s handshake only (``RawLink.connect`` without its data channels)."""
    raw.ctl = dial(raw.address)
    nonce = os.urandom(wire.NONCE_BYTES)
    raw.send_raw(wire.encode(Msg.HELLO, 0, nonce=nonce))
    msg, _, ack = recv_frame(raw.ctl)
    assert msg is Msg.HELLO_ACK, msg
    identity = (raw.cluster_id.to_bytes(8, "big") + int(raw.role).to_bytes(1, "big")
                + raw.remote_id.to_bytes(8, "big") + bytes(32))
    raw.send_raw(wire.encode(Msg.AUTH, 0, proof=proof(None, b"client", ack["nonce"], nonce, identity),
                             cluster_id=raw.cluster_id, role=int(raw.role), peer_id=raw.remote_id,
                             instance=bytes(32)))
    msg, _, ok = recv_frame(raw.ctl)
    assert msg is Msg.LINK_OK, msg
    if ok["status"] != 0:
        raise Refused(ok["status"], ok["text"])
    raw.token, raw.channels = ok["link_token"], ok["channels"]


def _run_ahead(port: int, n: int) -> tuple[list[int], int, list[RawLink]]:
    """Handshake ``n`` links first, then attach the data channels of those taken: the codes, how many
    attached all their channels, and the links (to close)."""
    raws, codes = [], []
    for cid in range(500, 500 + n):
        raw = RawLink(("127.0.0.1", port), cid, 1, None)
        try:
            _handshake(raw)
            raws.append(raw)
            codes.append(0)
        except Refused as exc:
            codes.append(exc.code)
            raw.close()
    attached = 0
    for raw in raws:
        with contextlib.suppress(Refused, OSError):
            raw.data = [raw.attach(i, 0) for i in range(2 * raw.channels)]
            attached += 1
    return codes, attached, raws


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_links_whose_handshakes_run_ahead_of_their_data_channels_stay_within_the_fd_budget(fork_server):
    async with Child(limited_main, LLMRole.PROMPT, 1, True, CONFIG, ROOM, "uvloop") as child:
        _, info = await child.recv()
        base = await child.call("fds")
        codes, attached, raws = await asyncio.to_thread(_run_ahead, info["port"], ROOM + 4)
        try:
            assert codes == [0] * ROOM + [S.LLM_CLUSTER_NUM_EXCEED_LIMIT] * 4, codes
            assert attached == ROOM
            assert await child.call("links") == ROOM
            # (+ 2: an attached connection's accepted fd, whose dup the link holds, closes a loop pass later)
            assert await child.call("fds") - base <= ROOM * info["per_link"] + 2
        finally:
            for raw in raws:
                raw.close()


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_burst_of_honest_decoders_stays_within_the_fd_budget(fork_server):
    async with contextlib.AsyncExitStack() as stack:
        child = await stack.enter_async_context(Child(limited_main, LLMRole.PROMPT, 1, True, CONFIG, ROOM, "asyncio"))
        _, info = await child.recv()
        decoders = [await stack.enter_async_context(endpoint(LLMRole.DECODER, 20 + n, **CONFIG)) for n in range(8)]
        results = await asyncio.gather(*(d.link_clusters([cluster_info(1, ("127.0.0.1", info["port"]))])
                                         for d in decoders))
        codes = [r[1][0] for r in results]
        linked = codes.count(S.LLM_SUCCESS)
        assert 1 <= linked <= ROOM, codes
        assert set(codes) <= {S.LLM_SUCCESS, S.LLM_CLUSTER_NUM_EXCEED_LIMIT}, codes
        assert await child.call("links") == linked
        assert await child.call("fds") <= info["limit"]


#: A server without a secret, in its own process (its fds are not the dialler's): its ``LINK_OK`` names
#: argv[1] data channels; it takes every attach, answers PROBE and UNLINK, and once its stdin closes prints
#: how many data connections attached.
NAMES_CHANNELS = r'''
import os, selectors, socket, sys
sys.path[:0] = ["tests/reliability", "tests", "."]
from _rawpeer import recv_exactly, recv_frame
from aio_datadist import wire
from aio_datadist.wire import Msg
lsock = socket.create_server(("127.0.0.1", 0))
print(lsock.getsockname()[1], flush=True)
sel = selectors.DefaultSelector()
sel.register(lsock, selectors.EVENT_READ, "accept")
sel.register(sys.stdin, selectors.EVENT_READ, "stop")
held, attaches, ctl = [], 0, None
while True:
    for key, _ in sel.select(10):
        if key.data == "stop":
            print(attaches, flush=True)
            sys.exit(0)
        if key.data == "accept":
            conn, _ = lsock.accept()
            conn.settimeout(5)
            held.append(conn)
            head = recv_exactly(conn, 4)
            if head == wire.ATTACH_MAGIC:
                recv_exactly(conn, wire.ATTACH.size - 4)
                conn.sendall(wire.ATTACH_OK.pack(wire.ATTACH_MAGIC, 0))
                attaches += 1
                continue
            _, rid, length = wire.parse_header(head + recv_exactly(conn, wire.HEADER.size - 4))
            recv_exactly(conn, length)
            conn.sendall(wire.encode(Msg.HELLO_ACK, rid, nonce=os.urandom(32), proof=bytes(32)))
            _, rid, auth = recv_frame(conn)
            conn.sendall(wire.encode(Msg.LINK_OK, rid, status=0, cluster_id=auth["peer_id"], role=1,
                                     link_token=os.urandom(32), channels=int(sys.argv[1]), boot_id=bytes(16),
                                     local_name=bytes(48), instance=bytes(32), proof=bytes(32), text=""))
            sel.register(conn, selectors.EVENT_READ, "control")
        else:
            try:
                msg, rid, _ = recv_frame(key.fileobj)
            except (OSError, ConnectionError):
                sel.unregister(key.fileobj)
                continue
            if msg is Msg.PROBE:
                key.fileobj.sendall(wire.encode(Msg.PROBE_ACK, rid))
            elif msg is Msg.UNLINK:
                key.fileobj.sendall(wire.encode(Msg.UNLINK_ACK, rid))
'''


@contextlib.asynccontextmanager
async def names_channels(channels: int) -> AsyncIterator[tuple[int, asyncio.subprocess.Process]]:
    """The NAMES_CHANNELS server's port and process; on exit, how many attached is its last stdout line."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", NAMES_CHANNELS, str(channels),
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                cwd=ROOT)
    try:
        yield int(await asyncio.wait_for(proc.stdout.readline(), 10)), proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def attaches_of(proc: asyncio.subprocess.Process) -> int:
    proc.stdin.close()
    return int(await asyncio.wait_for(proc.stdout.readline(), 10))


@pytest.mark.asyncio
async def test_a_dialled_peer_that_names_more_data_channels_stays_within_the_dialers_fd_budget(monkeypatch):
    per_link = fd_budget.per_link(2, False)
    async with endpoint(LLMRole.DECODER, 2, transport="tcp", data_channels=2) as dec:  # 5 fds per link
        for channels, expected, held in [(16, S.LLM_CLUSTER_NUM_EXCEED_LIMIT, 0), (2, S.LLM_SUCCESS, per_link)]:
            async with names_channels(channels) as (port, peer):
                # room for exactly one link of ours by the documented formula
                limit = fd_budget.open_count() + fd_budget.RESERVE + per_link + 2
                monkeypatch.setattr(fd_budget, "soft_limit", lambda: limit)
                before = len(open_fds())
                code = (await dec.link_clusters([cluster_info(7, ("127.0.0.1", port))], timeout=3000))[1][0]
                assert (code, len(open_fds()) - before) == (expected, held), channels
                if code == S.LLM_SUCCESS:
                    assert (await dec.unlink_clusters([cluster_info(7, ("127.0.0.1", port))]))[0] == S.LLM_SUCCESS
                assert await attaches_of(peer) == 2 * channels * (code == S.LLM_SUCCESS)


@pytest.mark.asyncio(loop_factories=["asyncio"])
@pytest.mark.parametrize("channels, expected", [(3, LLMStatusCode.LLM_SUCCESS),
                                                (4, LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT)])
async def test_the_channels_a_peer_names_past_ours_are_claimed_in_full(monkeypatch, channels, expected):
    """The dialler claims every fd of the data channels a peer names past its own (two a channel), before it
    dials them: with room for one link of ours and exactly 2 fds more, a peer naming 3 channels (2 fds more)
    links, one naming 4 (4 more) is refused with nothing dialled. The tests above name 16 (refused by any claim)
    or 2 (none past ours), and passed with half the fds claimed (audit, 2026-12-07)."""
    per_link = fd_budget.per_link(2, False)
    async with endpoint(LLMRole.DECODER, 2, transport="tcp", data_channels=2) as dec:
        async with names_channels(channels) as (port, peer):
            # room for one link of ours and 2 fds more (the open control connection is still claimed too)
            limit = fd_budget.open_count() + fd_budget.RESERVE + per_link + 3
            monkeypatch.setattr(fd_budget, "soft_limit", lambda: limit)
            before = len(open_fds())
            code = (await dec.link_clusters([cluster_info(7, ("127.0.0.1", port))], timeout=3000))[1][0]
            held = len(open_fds()) - before
            assert code == expected, (channels, code)
            if code == LLMStatusCode.LLM_SUCCESS:
                assert held == 1 + 2 * channels
                unlinked = await dec.unlink_clusters([cluster_info(7, ("127.0.0.1", port))])
                assert unlinked[0] == LLMStatusCode.LLM_SUCCESS
            else:
                assert held == 0
            assert await attaches_of(peer) == 2 * channels * (code == LLMStatusCode.LLM_SUCCESS)


def _reattach_one(port: int) -> tuple[list[int], list[RawLink]]:
    """Two links that attach their channel 0 again and again (a new generation each time: each replaces the
    last, one fd open) and no other channel, then a third handshake: the codes of the three."""
    raws, codes = [], []
    for cid in range(600, 603):
        raw = RawLink(("127.0.0.1", port), cid, 1, None)
        raws.append(raw)
        try:
            _handshake(raw)
            codes.append(0)
        except Refused as exc:
            codes.append(exc.code)
            continue
        if cid < 602:
            raw.data = [raw.attach(0, generation) for generation in range(2 * raw.channels)]
    return codes, raws


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_channel_attached_again_gives_back_its_claim_once(fork_server):
    """A link's claim shrinks by one fd per channel attached, not per attach: two peers that attach their
    channel 0 at generation after generation (each replacing the last) still hold the claim of their other
    channels, so a third link does not fit the room for two (found by audit: it did with the ``index not in
    opening.channels`` check of ``LinkTable.attached`` dropped)."""
    async with Child(limited_main, LLMRole.PROMPT, 1, True, CONFIG, ROOM, "asyncio") as child:
        _, info = await child.recv()
        codes, raws = await asyncio.to_thread(_reattach_one, info["port"])
        try:
            assert codes == [0, 0, S.LLM_CLUSTER_NUM_EXCEED_LIMIT], codes
        finally:
            for raw in raws:
                raw.close()
