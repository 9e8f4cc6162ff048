"""The prefill's table of side-channel connections (``vllm_agent.MAX_CONNECTIONS``, patched to 2 here) when it is
full: decodes that vanished without a FIN or RST are pushed out by a newcomer that proved the secret, while
connections holding a claim, and every connection against a process without the secret, stay. Agents and raw
clients on real loopback sockets, as in ``tests/test_vllm_side_channel_peers.py``; no vLLM needed. Each test
failed before its fix (docs/reliability.md row 328; the last three were found by the review of its first
form)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import _vllm_agents
import pytest
from _vllm_agents import wait
from test_vllm_side_channel_peers import _Blackhole, _remote

from aio_datadist.integrations import vllm_agent, vllm_auth
from aio_datadist.integrations.vllm_agent import LoopThread
from aio_datadist.integrations.vllm_wire import HEADER, decode_reply, encode_frame, frame_length

agents = _vllm_agents.agents  # the fixture

SECRET = "side-channel-eviction-secret"
#: What the prefill tells a decode it refuses for a full table (patched to 2 connections, else 1, in the tests).
FULL = ("the side channel is full: 2 connections, each holding or awaiting a claim or admitted under "
        "link_timeout_ms ago")


def _loads(decode, req_id: str, remote) -> bool:
    """Start a pull of one block and wait for it (bounded): whether it was reported loaded."""
    decode.start_pull(req_id, remote, [2])
    wait(lambda: req_id not in decode.pulls.pending(), 10)
    finished, failed, _ = decode.pulls.take_finished()
    assert req_id in finished
    return req_id not in failed


def _keepalive(sock: Any) -> tuple[int, int, int, int]:
    return (sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),  # a host gone is found within about 45 s
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT))


def test_decodes_that_vanished_are_evicted_when_the_table_is_full(agents, monkeypatch) -> None:
    """Two decodes pull once and vanish without a FIN or RST (a relay stops forwarding their flows: a partition,
    a host gone, a NAT that forgot the flow, row 141). Before, their connections counted against
    ``MAX_CONNECTIONS`` for ever (no keepalive, no idle bound) and every later decode was refused; now a new
    decode that proves the secret evicts the one idle longest, and every side-channel socket has TCP keepalive
    (``KEEPALIVE_IDLE_S``) at both ends."""
    monkeypatch.setattr(vllm_agent, "MAX_CONNECTIONS", 2)
    relay_loop = LoopThread("relay")
    prefill, _ = agents(True, shared_secret=SECRET)
    relay = _Blackhole(prefill.side_channel)
    try:
        relay_loop.call(relay.__aenter__())
        gone_writers = []
        for i in range(2):
            gone, _ = agents(False, shared_secret=SECRET, link_timeout_ms=2000)
            prefill.holds.add(f"r{i}", lease_s=60)
            assert _loads(gone, f"d{i}", _remote("engine-p", relay.address, f"r{i}", [5]))
            wait(lambda: f"r{i}" not in prefill.holds.held, 5)  # its done came: the connection holds no claim
            gone_writers.append(next(w for w in prefill._conns if w not in gone_writers))
            relay.drop_existing()  # then it vanishes: nothing of its flow gets through any more
            gone.close()
        assert len(prefill._conns) == 2

        honest, _ = agents(False, shared_secret=SECRET, link_timeout_ms=2000)
        prefill.holds.add("r9", lease_s=60)
        assert _loads(honest, "d9", _remote("engine-p", prefill.side_channel, "r9", [7])), (
            f"a new decode is refused: the table holds {len(prefill._conns)} connections of vanished decodes")
        assert gone_writers[0] not in prefill._conns and gone_writers[1] in prefill._conns  # the idlest went
        expected = (1, vllm_agent.KEEPALIVE_IDLE_S, vllm_agent.KEEPALIVE_INTERVAL_S, vllm_agent.KEEPALIVE_COUNT)
        peer = honest._peers[prefill.side_channel].result()
        assert [_keepalive(w.get_extra_info("socket")) for w in (*prefill._conns, peer.writer)] == [expected] * 3
    finally:
        relay_loop.call(relay.__aexit__(None, None, None))
        relay_loop.stop()


class _Client:
    """A raw side-channel client on its own loop: ``dial`` (with a secret), ``ask`` a frame, ``closed``."""

    def __init__(self, loop: LoopThread, address: tuple[str, int]) -> None:
        self.loop, self.address = loop, address
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.next_id = 1

    def dial(self, secret: str | None, first: bytes = b"") -> None:
        async def dial() -> None:
            self.reader, self.writer = await asyncio.open_connection(*self.address)
            if first:
                self.writer.write(first)
            if secret is not None:
                async with asyncio.timeout(5):
                    await vllm_auth.dial(self.reader, self.writer, secret.encode())
        self.loop.call(dial(), 10)

    def ask(self, op: str, **fields: object) -> dict[str, Any]:
        async def ask() -> dict[str, Any]:
            assert self.reader is not None and self.writer is not None
            rid, self.next_id = self.next_id, self.next_id + 1
            self.writer.write(encode_frame({"id": rid, "op": op, **fields}))
            async with asyncio.timeout(5):
                body = await self.reader.readexactly(frame_length(await self.reader.readexactly(HEADER.size)))
            return decode_reply(body, op)
        return self.loop.call(ask(), 10)

    def closed(self) -> bool:
        """Whether the prefill closed the connection (waits 2 s at most for it)."""
        async def closed() -> bool:
            assert self.reader is not None
            try:
                async with asyncio.timeout(2):
                    return await self.reader.read(1) == b""
            except TimeoutError:
                return False
            except OSError:  # an abort: a reset
                return True
        return self.loop.call(closed(), 10)

    def close(self) -> None:
        async def close() -> None:
            if self.writer is not None:
                self.writer.transport.abort()
        self.loop.call(close(), 10)


def test_only_authenticated_connections_holding_no_claim_are_evicted(agents, monkeypatch) -> None:
    """A full table (2 here): a connection holding a claim is never evicted; processes without the secret (or
    with another one) evict nothing, whatever they send; a decode that proves it evicts the idle connection of
    another decode, which dials again at its next load; once every connection holds a claim, a newcomer is
    refused and the claims stay. Before, the full table refused every newcomer, a live decode's next load
    included."""
    monkeypatch.setattr(vllm_agent, "MAX_CONNECTIONS", 2)
    client_loop = LoopThread("clients")
    clients: list[_Client] = []

    def client(secret: str | None, first: bytes = b"") -> _Client:
        clients.append(_Client(client_loop, prefill.side_channel))
        clients[-1].dial(secret, first)
        return clients[-1]

    prefill, _ = agents(True, shared_secret=SECRET, link_timeout_ms=1000)
    try:
        for req in ("r0", "r1", "r2", "r3", "r4", "r5"):
            prefill.holds.add(req, lease_s=60)
        claimer = client(SECRET)
        assert claimer.ask("claim", req="r1")["ok"]  # the oldest connection, and it holds a claim
        other, _ = agents(False, shared_secret=SECRET)
        assert _loads(other, "d0", _remote("engine-p", prefill.side_channel, "r0", [5]))  # idle, no claim now
        time.sleep(0.05)
        strangers = [client(None, b"GET / HTTP/1.1\r\n" + b"x" * 40) for _ in range(10)]  # not the handshake
        for stranger in strangers:
            assert stranger.closed()
        for _ in range(3):
            with pytest.raises(vllm_auth.AuthError):
                client("another-secret")
        wait(lambda: len(prefill._conns) == 2, 5)  # those with another secret: refused past their handshake
        assert other._peers[prefill.side_channel].result().broken is None

        newcomer, _ = agents(False, shared_secret=SECRET)
        assert _loads(newcomer, "d2", _remote("engine-p", prefill.side_channel, "r2", [6]))  # evicts other's
        wait(lambda: prefill.side_channel not in other._peers, 5)  # other saw its connection close
        assert claimer.ask("held", req="r1")["ok"]  # the claim and its connection stay
        assert _loads(other, "d3", _remote("engine-p", prefill.side_channel, "r3", [7]))  # it dials again
        assert claimer.ask("held", req="r1")["ok"]

        second = client(SECRET)  # evicts the idle one (other's), then claims: every connection holds a claim
        assert second.ask("claim", req="r4")["ok"]
        refused = client(SECRET)  # refused past its handshake, told why: nothing to evict
        assert refused.ask("hello") == {"id": 0, "ok": False, "error": FULL} and refused.closed()
        assert claimer.ask("held", req="r1")["ok"] and second.ask("held", req="r4")["ok"]
        assert {r: h.owner is not None for r, h in prefill.holds.held.items()} == {"r1": True, "r4": True, "r5": False}
    finally:
        for c in clients:
            c.close()
        client_loop.stop()


def test_a_connection_counts_as_idle_from_its_admission_not_its_accept(agents, monkeypatch) -> None:
    """A connection whose handshake took a while (a decode a network away) is weighed by when it was admitted,
    past its handshake: a full table evicts one idle for longer since its last frame. Before, it counted as idle
    from its accept: admitted a moment ago, it was evicted first (found by review)."""
    monkeypatch.setattr(vllm_agent, "MAX_CONNECTIONS", 3)
    loop = LoopThread("clients")
    clients: list[_Client] = []
    prefill, _ = agents(True, shared_secret=SECRET, link_timeout_ms=1500)
    try:
        prefill.holds.add("r1", lease_s=60)
        clients.append(holder := _Client(loop, prefill.side_channel))
        holder.dial(SECRET)
        assert holder.ask("claim", req="r1")["ok"]  # never evicted
        clients.append(slow := _Client(loop, prefill.side_channel))

        async def accepted_only() -> None:
            slow.reader, slow.writer = await asyncio.open_connection(*prefill.side_channel)
        loop.call(accepted_only(), 10)  # t0: accepted, its handshake not begun
        time.sleep(0.2)
        clients.append(idle := _Client(loop, prefill.side_channel))
        idle.dial(SECRET)
        assert idle.ask("hello")["ok"]  # t0 + 0.2 s: its last frame
        time.sleep(0.6)

        async def handshake() -> None:
            assert slow.reader is not None and slow.writer is not None
            async with asyncio.timeout(5):
                await vllm_auth.dial(slow.reader, slow.writer, SECRET.encode())
        loop.call(handshake(), 10)  # t0 + 0.8 s: admitted
        wait(lambda: len(prefill._established) == 3, 5)
        time.sleep(1.6)  # past both grace periods (link_timeout_ms from each admission): both may be evicted
        clients.append(newcomer := _Client(loop, prefill.side_channel))
        newcomer.dial(SECRET)
        assert newcomer.ask("hello")["ok"]
        assert (slow.closed(), idle.closed()) == (False, True), "the connection admitted last was evicted"
        assert len(prefill._established) == 3
        prefill.holds.add("r2", lease_s=60)  # the newcomer claims (no grace left) and is done; then slow speaks
        assert newcomer.ask("claim", req="r2")["ok"] and newcomer.ask("done", req="r2")["ok"]
        assert slow.ask("hello")["ok"]  # its last frame, read after the newcomer's: idle for less time
        clients.append(last := _Client(loop, prefill.side_channel))
        last.dial(SECRET)
        assert last.ask("hello")["ok"]
        assert newcomer.closed(), "weighed by its admission, not by its last frame"
        assert slow.ask("hello")["ok"] and len(prefill._established) == 3
    finally:
        for c in clients:
            c.close()
        loop.stop()


def test_a_decode_still_linking_is_not_evicted_by_one_dialling_after_it(agents, monkeypatch, tmp_path) -> None:
    """A decode between its hello and its first claim is linking (``link_timeout_ms``): a newcomer dialling a
    full table then is refused and told so, rather than evicting it, and once that decode claimed (and is idle
    again) the newcomer's next load evicts it. A connection admitted ``link_timeout_ms`` ago that never claimed
    may be evicted. The table never holds more than ``MAX_CONNECTIONS``. Before, concurrent newcomers evicted
    each other before they could claim (found by review: two decodes loading at once through one free slot lost
    5 loads of 8)."""
    monkeypatch.setattr(vllm_agent, "MAX_CONNECTIONS", 2)
    loop = LoopThread("clients")
    clients: list[_Client] = []

    def client() -> _Client:
        clients.append(_Client(loop, prefill.side_channel))
        clients[-1].dial(SECRET)
        return clients[-1]

    prefill, _ = agents(True, shared_secret=SECRET, link_timeout_ms=2000)
    stats = tmp_path / "decode.jsonl"
    newcomer, _ = agents(False, shared_secret=SECRET, stats_path=str(stats))
    try:
        for req in ("r0", "r1", "r2", "r3"):
            prefill.holds.add(req, lease_s=60)
        holder = client()
        assert holder.ask("claim", req="r0")["ok"]
        linking = client()
        assert linking.ask("hello")["ok"]  # then it links: its claim comes up to link_timeout_ms later
        assert not _loads(newcomer, "d2", _remote("engine-p", prefill.side_channel, "r2", [6]))
        error = json.loads(stats.read_text().splitlines()[-1])["error"]
        assert FULL in error and "shared_secret" not in error, error
        assert linking.ask("claim", req="r1")["ok"], "a decode still linking was evicted"
        assert linking.ask("done", req="r1")["ok"]
        assert len(prefill._established) == 2
        assert _loads(newcomer, "d3", _remote("engine-p", prefill.side_channel, "r3", [7]))  # evicts it now
        assert linking.closed() and holder.ask("held", req="r0")["ok"]

        silent = client()  # evicts the newcomer's idle connection; says hello and never claims
        assert silent.ask("hello")["ok"]
        refused = client()
        assert refused.ask("hello") == {"id": 0, "ok": False, "error": FULL}
        time.sleep(2.1)  # past its grace
        late = client()
        assert late.ask("hello")["ok"] and silent.closed()
        assert len(prefill._established) == 2 and holder.ask("held", req="r0")["ok"]
    finally:
        for c in clients:
            c.close()
        loop.stop()


def test_a_decode_refused_by_a_full_table_is_told_so_not_a_secret_mismatch(agents, monkeypatch, tmp_path) -> None:
    """Every connection holds a claim: a decode with the secret is refused past its handshake and its failed load
    says the side channel is full; a process without the secret gets the handshake's answer as from a table
    with room (it learns nothing of the table). Before, the decode was closed before its handshake and its
    load failed saying the prefill had no shared_secret, or another one (found by review)."""
    monkeypatch.setattr(vllm_agent, "MAX_CONNECTIONS", 1)
    loop = LoopThread("clients")
    prefill, _ = agents(True, shared_secret=SECRET)
    holder = _Client(loop, prefill.side_channel)
    try:
        prefill.holds.add("r0", lease_s=60)
        prefill.holds.add("r1", lease_s=60)
        holder.dial(SECRET)
        assert holder.ask("claim", req="r0")["ok"]
        stats = tmp_path / "decode.jsonl"
        decode, _ = agents(False, shared_secret=SECRET, stats_path=str(stats))
        assert not _loads(decode, "d1", _remote("engine-p", prefill.side_channel, "r1", [5]))
        error = json.loads(stats.read_text().splitlines()[-1])["error"]
        assert FULL.replace("2 connections", "1 connections") in error and "shared_secret" not in error, error
        with socket.create_connection(prefill.side_channel, timeout=5) as stranger:
            stranger.sendall(vllm_auth.MAGIC + bytes(vllm_auth.NONCE_BYTES))
            answer = b""
            for _ in range(10):  # bounded: the nonce and the proof, as from a table with room
                part = stranger.recv(vllm_auth.NONCE_BYTES + vllm_auth.PROOF_BYTES - len(answer))
                answer += part
                if not part or len(answer) == vllm_auth.NONCE_BYTES + vllm_auth.PROOF_BYTES:
                    break
            assert len(answer) == vllm_auth.NONCE_BYTES + vllm_auth.PROOF_BYTES
        assert holder.ask("held", req="r0")["ok"]
    finally:
        holder.close()
        loop.stop()
