"""Authentication with a shared secret: without it there is no link, no cache metadata and no cache byte.

The owner is a PROMPT with a shared secret and keyed caches. Tried against it:
endpoints without the secret or with a wrong one (both directions: a client
never completes a handshake with a server that cannot prove the secret);
raw clients that send requests with no handshake, forge a proof, replay a
captured HELLO/AUTH pair, guess a data-channel token, or replay a captured
data-channel attach record during and after the link it belonged to. Each
gets at most a HELLO_ACK (a nonce and a proof) and a refusal that carries
nothing, the owner's links table never shows them, and the legitimate link's
next pull still returns its own bytes. Nothing identifying (cluster id, role,
blocks layout, channel count, boot id, share socket name) reaches a peer
before it proved the secret, in either direction.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time

import pytest
import torch

from aio_datadist import (BlocksCacheKey, CacheDesc, CacheKey, DataType, LLMClusterInfo, LLMRole, LLMStatusCode,
                          Placement, wire)
from aio_datadist.testing import links_of, share_listener_of
from aio_datadist.transport.local import boot_id
from aio_datadist.types import UINT64_MAX
from aio_datadist.wire import Msg
from peers import LOCALHOST, cluster_info, fill, port_of

from _harness import endpoint, settle, state
from _rawpeer import RawLink, Refused, dial, recv_exactly, recv_frame, rest_of_stream

S = LLMStatusCode
PROMPT, DECODER = 1, 2
SECRET = "s3cret-for-the-cluster"
ROWS = CacheDesc(4, (3, 256), DataType.DT_FLOAT16, Placement.HOST)


def pull_fields(cache_id: int, channel: int = 0) -> dict:
    return dict(channel=channel, target_kind=2, cluster_id=PROMPT, cache_id=cache_id, key_req_id=UINT64_MAX,
                prefix_id=UINT64_MAX, model_id=0, batch_index=0, layer_first=-1, layer_last=-1,
                tensor_num_per_layer=2, tensor_count=4, data_type=1, offset=0, nbytes=512, flags=2 | 4,
                timeout_ms=1000, rows=())


def only_refusals(reply: bytes) -> None:
    """At most a HELLO_ACK and a refusing LINK_OK: no link token, no RESP, no cache byte."""
    pos = 0
    while pos + wire.HEADER.size <= len(reply):
        msg, _, length = wire.parse_header(reply[pos:pos + wire.HEADER.size])
        fields = wire.fields_of(msg, reply[pos + wire.HEADER.size:pos + wire.HEADER.size + length])
        assert msg in (Msg.HELLO_ACK, Msg.LINK_OK), msg
        if msg is Msg.LINK_OK:
            assert fields["status"] == S.LLM_LINK_FAILED and fields["link_token"] == bytes(32)
        pos += wire.HEADER.size + length
    assert pos == len(reply), f"{len(reply) - pos} bytes after the refusal"


def attacks(address: tuple[str, int], cache_id: int, legit: RawLink) -> list[str]:
    """Every attack of the module docstring; returns the names of those that got anything."""
    got = []
    # 1. a request with no handshake
    with dial(address) as sock:
        sock.sendall(wire.encode(Msg.PULL_REQ, 1, **pull_fields(cache_id)))
        only_refusals(rest_of_stream(sock))
    # 2. no secret, a wrong secret
    for name, key in (("no secret", None), ("wrong secret", b"guess")):
        try:
            RawLink(address, 70, PROMPT, key).connect().close()
            got.append(name)
        except Refused as refusal:
            assert refusal.code in (S.LLM_LINK_FAILED, -1), refusal
    # 3. a captured HELLO + AUTH replayed on a new connection (the owner's nonce differs)
    hello, auth = (f for f in legit.captured if f[:4] == wire.MAGIC and f[5] in (Msg.HELLO, Msg.AUTH))
    with dial(address) as sock:
        sock.sendall(hello)
        msg, _, ack = recv_frame(sock)
        assert msg is Msg.HELLO_ACK
        sock.sendall(auth)
        try:
            sock.sendall(wire.encode(Msg.PULL_REQ, 1, **pull_fields(cache_id)))
        except OSError:
            pass  # the owner has closed the connection already
        only_refusals(rest_of_stream(sock))
    # 4. a data channel with a guessed token
    with dial(address) as sock:
        sock.sendall(wire.ATTACH.pack(wire.ATTACH_MAGIC, wire.VERSION, os.urandom(32), 0, 0))
        _, status = wire.ATTACH_OK.unpack(recv_exactly(sock, wire.ATTACH_OK.size))
        assert status == S.LLM_LINK_FAILED
        assert rest_of_stream(sock) == b""
    # 5. the link token (sent in clear in LINK_OK: an eavesdropper has it) re-aimed at the next generation
    for index in range(2 * legit.channels):
        with dial(address) as sock:
            sock.sendall(wire.ATTACH.pack(wire.ATTACH_MAGIC, wire.VERSION, legit.token, index, 1))
            _, status = wire.ATTACH_OK.unpack(recv_exactly(sock, wire.ATTACH_OK.size))
            if status == 0:
                got.append(f"sniffed token on channel {index}")
    # 6. the legit client's captured attach records, replayed while its link is up
    for record in (f for f in legit.captured if f[:4] == wire.ATTACH_MAGIC):
        with dial(address) as sock:
            sock.sendall(record)
            try:
                _, status = wire.ATTACH_OK.unpack(recv_exactly(sock, wire.ATTACH_OK.size))
            except ConnectionError:
                status = S.LLM_LINK_FAILED
            if status == 0:
                got.append(f"replayed attach of channel {wire.ATTACH.unpack(record)[3]}")
                continue
            assert rest_of_stream(sock) == b""
    return got


@pytest.mark.asyncio
async def test_peers_without_the_secret_get_no_link_no_metadata_no_byte():
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, shared_secret=SECRET, transport="tcp") as dd:
        rows = dd.kv_cache_manager.allocate_cache(ROWS, [CacheKey(PROMPT, 1), CacheKey(PROMPT, 2)])
        values = fill(rows, 1)
        baseline = state(dd)
        # library endpoints without the secret, or with another one
        for secret in (None, "wrong"):
            config = {} if secret is None else {"shared_secret": secret}
            async with endpoint(LLMRole.DECODER, DECODER, **config) as dec:
                assert await dec.link_clusters([cluster_info(PROMPT, port_of(dd))]) == (
                    S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
        assert links_of(dd) == {}
        # raw attackers, while a legitimate raw client holds a link
        legit = await asyncio.to_thread(RawLink(port_of(dd), DECODER, PROMPT, SECRET.encode()).connect)
        try:
            got = await asyncio.to_thread(attacks, port_of(dd), rows.cache_id, legit)
            assert got == [], f"attacks that got through: {got}"
            assert sorted(links_of(dd)) == [DECODER]
            # the legitimate link's channels are its own: a pull returns its bytes on its channel
            for channel in range(legit.channels):
                data = await asyncio.to_thread(legit.pull, pull_fields(rows.cache_id, channel))
                assert data == b"".join(v[0].numpy().tobytes() for v in values)
        finally:
            legit.close()
        # replayed after the link is gone: refused
        await asyncio.to_thread(replay_attach_after_close, port_of(dd), legit.captured)
        await settle(dd, baseline, within=2.0)
        async with endpoint(LLMRole.DECODER, DECODER + 1, shared_secret=SECRET) as dec:  # the right secret works
            assert (await dec.link_clusters([cluster_info(PROMPT, port_of(dd))]))[0] == S.LLM_SUCCESS
            mine = dec.kv_cache_manager.allocate_cache(ROWS)
            await dec.kv_cache_manager.pull_cache(CacheKey(PROMPT, 2), mine, 1)
            assert all(torch.equal(m[1], v[1]) for m, v in zip(mine.tensors, values))


def replay_attach_after_close(address: tuple[str, int], captured: list[bytes]) -> None:
    for record in (f for f in captured if f[:4] == wire.ATTACH_MAGIC):
        with dial(address) as sock:
            sock.sendall(record)
            _, status = wire.ATTACH_OK.unpack(recv_exactly(sock, wire.ATTACH_OK.size))
            assert status == S.LLM_LINK_FAILED


class FakeServer:
    """Listens like a peer that does not know the secret, and records every frame a client sends it."""

    def __init__(self) -> None:
        self.frames: list[Msg] = []
        self.received = bytearray()
        self.server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> FakeServer:
        self.server = await asyncio.start_server(self._serve, LOCALHOST, 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header = await reader.readexactly(wire.HEADER.size)
                msg, _, length = wire.parse_header(header)
                self.received += header + await reader.readexactly(length)
                self.frames.append(msg)
                if msg is Msg.HELLO:
                    writer.write(wire.encode(Msg.HELLO_ACK, 0, nonce=os.urandom(32), proof=os.urandom(32)))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.mark.asyncio
async def test_a_client_with_the_secret_does_not_complete_a_handshake_with_an_impostor():
    async with FakeServer() as fake, endpoint(LLMRole.DECODER, DECODER, shared_secret=SECRET) as dec:
        baseline = state(dec)
        address = fake.server.sockets[0].getsockname()[:2]
        assert await dec.link_clusters([cluster_info(PROMPT, address)]) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
        await asyncio.sleep(0.05)
        assert fake.frames == [Msg.HELLO]  # no AUTH: the client's proof and layout never reach an impostor
        assert len(fake.received) == wire.HEADER.size + wire.NONCE_BYTES  # HELLO is a nonce, nothing else
        assert DECODER.to_bytes(8, "big") not in fake.received
        await settle(dec, baseline)


IDENTIFIED = 0x5EC2E7C0FFEE0001  # a cluster id that cannot turn up in the bytes by chance
BLOCKS = CacheDesc(4, (8, 4, 16), DataType.DT_FLOAT16, Placement.HOST)


def handshake_without_the_secret(address: tuple[str, int]) -> bytes:
    """Everything an owner sends a client that goes through the handshake with a forged proof."""
    with dial(address) as sock:
        sock.sendall(wire.encode(Msg.HELLO, 0, nonce=os.urandom(wire.NONCE_BYTES)))
        received = recv_exactly(sock, wire.HEADER.size + 2 * 32)  # HELLO_ACK: a nonce and a proof
        sock.sendall(wire.encode(Msg.AUTH, 0, proof=os.urandom(32), cluster_id=DECODER, role=int(LLMRole.DECODER),
                                 peer_id=IDENTIFIED, instance=bytes(32)))
        return received + rest_of_stream(sock)


@pytest.mark.asyncio
async def test_before_proving_the_secret_a_peer_learns_nothing_but_a_nonce():
    async with endpoint(LLMRole.PROMPT, IDENTIFIED, listen=True, shared_secret=SECRET, transport="auto") as dd:
        dd.kv_cache_manager.allocate_blocks_cache(BLOCKS, BlocksCacheKey(IDENTIFIED))
        identifying = {"cluster id": IDENTIFIED.to_bytes(8, "big"), "boot id": boot_id(),
                       "share socket name": share_listener_of(dd).name[1:]}  # no blocks layout travels (wire 4)
        received = await asyncio.to_thread(handshake_without_the_secret, port_of(dd))
        frames, pos = [], 0
        while pos < len(received):
            msg, _, length = wire.parse_header(received[pos:pos + wire.HEADER.size])
            frames.append((msg, wire.fields_of(msg, received[pos + wire.HEADER.size:pos + wire.HEADER.size + length])))
            pos += wire.HEADER.size + length
        assert [msg for msg, _ in frames] == [Msg.HELLO_ACK, Msg.LINK_OK]
        assert set(frames[0][1]) == {"nonce", "proof"}
        refusal = frames[1][1]
        assert refusal["status"] == S.LLM_LINK_FAILED and refusal["text"] == "authentication failed"
        assert all(not any(v) if isinstance(v, bytes) else v == 0
                   for k, v in refusal.items() if k not in ("status", "text")), refusal
        leaked = [what for what, value in identifying.items() if value in received]
        assert not leaked, f"sent before authentication: {leaked}"
        assert links_of(dd) == {}
        # with the secret, the same owner names itself (after the client's proof)
        with RawLink(port_of(dd), DECODER, IDENTIFIED, SECRET.encode()) as legit:
            await asyncio.to_thread(legit.connect)
            assert sorted(links_of(dd)) == [DECODER]


class TamperingRelay:
    """A man in the middle without the secret: relays a link's control connection and alters LINK_OK's
    boot id (which would aim the client's same-host sharing at a socket of the attacker's choosing)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.tampered = 0
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> TamperingRelay:
        self.server = await asyncio.start_server(self._relay, LOCALHOST, 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()
        await self.server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self.writers += [writer, up_writer]

        async def upstream() -> None:
            while data := await reader.read(65536):
                up_writer.write(data)
            up_writer.transport.abort()  # the client hung up: so does its relayed connection

        async def downstream() -> None:
            while True:
                header = await up_reader.readexactly(wire.HEADER.size)
                msg, req_id, length = wire.parse_header(header)
                fields = wire.fields_of(msg, await up_reader.readexactly(length))
                if msg is Msg.LINK_OK and fields["status"] == 0:
                    fields["boot_id"] = bytes(b ^ 0xFF for b in fields["boot_id"])
                    self.tampered += 1
                writer.write(wire.encode(msg, req_id, **fields))

        try:
            await asyncio.gather(upstream(), downstream())
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()
            up_writer.transport.abort()


@pytest.mark.asyncio
async def test_messages_sent_right_behind_auth_are_answered_after_link_ok():
    """A client that pipelines a PROBE and a pull request behind its AUTH gets LINK_OK first (the
    handshake's last record), then the answers, in order: the accepted link starts reading only once
    LINK_OK is written."""
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, shared_secret=SECRET) as dd:
        early = wire.encode(Msg.PROBE, 7) + wire.encode(Msg.PING, 9)

        def pipelined() -> list[tuple[Msg, int]]:
            with RawLink(port_of(dd), 71, PROMPT, SECRET.encode()).connect(behind_auth=early) as raw:
                assert raw.ctl is not None
                msg, req_id, _ = recv_frame(raw.ctl)  # connect() read LINK_OK first, or it failed
                return [(msg, req_id)]

        assert await asyncio.to_thread(pipelined) == [(Msg.PROBE_ACK, 7)]


@pytest.mark.asyncio
async def test_a_link_ok_altered_on_the_way_fails_the_link():
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, shared_secret=SECRET) as dd, \
            endpoint(LLMRole.DECODER, DECODER, shared_secret=SECRET) as dec, TamperingRelay(port_of(dd)) as relay:
        address = relay.server.sockets[0].getsockname()[:2]
        assert await dec.link_clusters([cluster_info(PROMPT, address)]) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
        assert relay.tampered == 1 and links_of(dec) == {}
        async with asyncio.timeout(2):  # the owner's end breaks once the client hangs up
            while any(link.broken is None for link in links_of(dd).values()):
                await asyncio.sleep(0.01)


REFLECTOR = os.path.join(os.path.dirname(__file__), "_reflector.py")


@pytest.mark.asyncio
@pytest.mark.parametrize(("remote_id", "hangup"), [(None, ()), (PROMPT, ()), (DECODER, ()), (None, ("reset",)),
                                                   (None, ("hold",))],
                         ids=["any", "another's", "its own", "any, reset", "any, held open"])
async def test_a_dialled_process_cannot_hand_the_handshake_back_to_the_dialler(remote_id, hangup, caplog):
    """Reflection (guarantee 146): the decoder dials a process without the secret (``link_clusters`` with no
    remote id, whichever cluster listens there, or naming a cluster, another's or its own), which hands the
    decoder's HELLO to the decoder's own listener, to have it prove the secret over the decoder's nonce, then
    the decoder's AUTH back to it. That listener answers nothing, so the decoder's dial never sends its proof
    and fails saying why, the relay gets no link, and the decoder links to another endpoint as before. Before
    the fix: HELLO_ACK, then AUTH, then LINK_OK with a link token, and a link registered in the decoder. (A
    named remote id and the failure's words were untested until an audit, 2026-12-07; ``reset``: the process hangs
    up on the dial with a reset, whose words went untested until the next; ``held open``: the process keeps the
    dial's connection open, and the dial is ended as soon as its HELLO reached its own listener: before, it waited
    out its whole timeout and failed ``LLM_TIMEOUT`` saying nothing, found by that audit.)"""
    caplog.set_level(logging.WARNING)
    async with (endpoint(LLMRole.DECODER, DECODER, listen=True, shared_secret=SECRET) as dec,
                endpoint(LLMRole.PROMPT, PROMPT, listen=True, shared_secret=SECRET) as other):
        baseline = state(dec)
        proc = await asyncio.create_subprocess_exec(sys.executable, REFLECTOR, *map(str, port_of(dec)), *hangup,
                                                    stdout=asyncio.subprocess.PIPE)
        try:
            assert proc.stdout is not None
            port = int(await asyncio.wait_for(proc.stdout.readline(), 30))
            info = LLMClusterInfo()
            if remote_id is not None:
                info.remote_cluster_id = remote_id
            info.append_remote_ip_info(LOCALHOST, port)
            started = time.monotonic()
            ret, per = await dec.link_clusters([info], timeout=3000)
            took = time.monotonic() - started
            got = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
            assert await asyncio.wait_for(proc.wait(), 10) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert got == {"ack": False, "auth": False, "link_ok": None}, got
        assert (ret, per) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED]), (ret, per, f"{took:.2f} s")
        assert "our HELLO reached this endpoint's own listener" in caplog.text, caplog.text
        assert took < 1.5, f"the dial waited {took:.2f} s of its 3 s"
        assert not links_of(dec)
        await settle(dec, baseline)
        assert await dec.link_clusters([cluster_info(PROMPT, port_of(other))]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])


ATTACH_REFLECTOR = os.path.join(os.path.dirname(__file__), "_attach_reflector.py")


@pytest.mark.asyncio
async def test_an_attach_record_reflected_to_the_dialler_s_own_listener_gets_nothing():
    """A process on the path of a link (no secret) captures the dialler's redial of a data channel (its attach
    record at generation 1) and hands it to the dialler's own listener before relaying it: the dialler never
    dials into its own listener, so that record must get nothing there (as a replayed record gets nothing at
    the owner), and the dialler's link must not take the relay's connection as its data channel."""
    async with (endpoint(LLMRole.PROMPT, PROMPT, listen=True, shared_secret=SECRET) as prompt,
                endpoint(LLMRole.DECODER, DECODER, listen=True, shared_secret=SECRET) as dec):
        proc = await asyncio.create_subprocess_exec(sys.executable, ATTACH_REFLECTOR, str(port_of(prompt)[1]),
                                                    str(port_of(dec)[1]), stdout=asyncio.subprocess.PIPE)
        try:
            assert proc.stdout is not None
            port = int(await asyncio.wait_for(proc.stdout.readline(), 30))
            assert await dec.link_clusters([cluster_info(PROMPT, (LOCALHOST, port))], timeout=3000) == \
                (S.LLM_SUCCESS, [S.LLM_SUCCESS])
            link = links_of(dec)[PROMPT]
            link.reset_channel(0, tell_peer=False)  # as a cut transfer does: the dialler redials it at generation 1
            got = json.loads(await asyncio.wait_for(proc.stdout.readline(), 5))
        finally:
            proc.kill()
            await proc.wait()
        assert got["reflected"] != 0, "the dialler's own listener took its reflected attach record"
