"""One share per link: the dialled peer cannot attach a second one to the link the dialler dials (row 254).

The dialler registers its link before it dials the peer's share socket, and its own share listener offered
that link too; the dialled peer (it knows the link token and the secret, and finds the dialler's share
socket in /proc/net/unix) attached a share there first. ``attach_local`` then replaced it with the share the
dialler dialled, leaking the first, and the first's loss dropped the second (the link fell back to TCP).
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMRole, LLMStatusCode, Placement
from aio_datadist import link_dials
from aio_datadist.testing import link_to, share_listener_of
from aio_datadist.transport import local
from aio_datadist.transport.local import share_proof
from peers import cluster_info, fill, port_of

from _harness import endpoint

SECRET = "local-secret-never-on-the-wire"
PROMPT, DECODER = 1, 2
BLOCKS = CacheDesc(1, (4, 4096), DataType.DT_UINT8, Placement.HOST)
SHARE = {"listen": True, "shared_secret": SECRET, "transport": "auto"}


async def claim_share(name: bytes, token: bytes) -> tuple[socket.socket, bytes]:
    """What the dialled peer does at the dialler's share socket: prove the link; the listener's answer."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, name), 2)
        _, _, server_nonce = local._CHALLENGE.unpack(await asyncio.wait_for(loop.sock_recv(sock, 1024), 2))
        mine = os.urandom(32)
        await loop.sock_sendall(sock, local._CLAIM.pack(local._MAGIC, mine, share_proof(
            SECRET.encode(), token, b"share-client", server_nonce, mine)))
        try:
            answer = await asyncio.wait_for(loop.sock_recv(sock, 1024), 2)
        except OSError:
            answer = b""
    except BaseException:
        sock.close()
        raise
    return sock, answer


@pytest.mark.asyncio
async def test_the_dialled_peer_cannot_attach_a_share_at_the_dialler(monkeypatch):
    async with endpoint(LLMRole.PROMPT, PROMPT, **SHARE) as prompt, \
            endpoint(LLMRole.DECODER, DECODER, **SHARE) as decoder:
        fill(prompt.kv_cache_manager.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT, 0)), 11)
        real = link_dials.connect_share
        rogue: list[tuple[socket.socket, bytes]] = []

        async def connect_share(name: bytes, token: bytes, secret: bytes | None) -> socket.socket:
            rogue.append(await claim_share(share_listener_of(decoder).name, token))  # the peer, first
            return await real(name, token, secret)

        monkeypatch.setattr(link_dials, "connect_share", connect_share)
        assert (await decoder.link_clusters([cluster_info(PROMPT, port_of(prompt))], timeout=5000))[0] == \
            LLMStatusCode.LLM_SUCCESS
        sock, answer = rogue[0]
        try:
            link = link_to(decoder, PROMPT)
            legit = link.local
            assert answer == b"" and legit is not None  # refused; the share the decoder dialled is the link's
            sock.close()
            await asyncio.sleep(0.05)  # the loop would see the rogue share's end
            assert link.local is legit and not legit.closed
        finally:
            sock.close()


@pytest.mark.asyncio
async def test_a_second_share_is_refused_and_the_first_kept():
    """Whoever hands a sharing link a second share: it is closed, and its end leaves the first one in place."""
    async with endpoint(LLMRole.PROMPT, PROMPT, **SHARE) as prompt, \
            endpoint(LLMRole.DECODER, DECODER, **SHARE) as decoder:
        assert (await decoder.link_clusters([cluster_info(PROMPT, port_of(prompt))], timeout=5000))[0] == \
            LLMStatusCode.LLM_SUCCESS
        for dd, peer in ((decoder, PROMPT), (prompt, DECODER)):
            link = link_to(dd, peer)
            legit = link.local
            assert legit is not None
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                link.attach_local(ours)
                theirs.close()
                await asyncio.sleep(0.05)  # the loop would see the second share's end
                assert ours.fileno() == -1, "the second share's socket was kept"
                assert link.local is legit and not legit.closed
            finally:
                ours.close()
                theirs.close()
