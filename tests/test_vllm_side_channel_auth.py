"""The vLLM connector's side channel with a shared secret, against peers in other processes.

The prefill and the honest decode are the connector's worker agents (as in
``test_vllm_connector_logic.py``); the attacker is
``tests/vllm_side_channel_peer.py`` in a process of its own, over real
loopback sockets: no secret, a wrong secret, a replayed recording, a flood
of silent connections, frame headers that lie.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from aio_datadist import LLMException, LLMStatusCode
from aio_datadist.integrations.vllm_agent import (
    MAX_PENDING_HANDSHAKES,
    SECRET_ENV,
    Agent,
    AgentOptions,
    LoopThread,
    kv_layout,
)
from aio_datadist.integrations.vllm_wire import RemotePrefill
import _vllm_agents
from _own_sockets import own_tcp
from _vllm_agents import BLOCK_TOKENS, BLOCKS, kv_caches, wait
from relay import Relay

agents = _vllm_agents.agents  # the fixture

SECRET = "side-channel-test-secret"
PEER = str(Path(__file__).with_name("vllm_side_channel_peer.py"))




def _peer(*args: object, timeout_s: float = 30) -> dict:
    done = subprocess.run([sys.executable, PEER, *map(str, args)], capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _pull(decode: Agent, host: str, port: int, req: str, timeout_s: float = 20) -> tuple[bool, float]:
    """The honest decode pulls ``req``'s blocks 5 and 2 into its blocks 1 and 6: (ok, seconds)."""
    started = time.monotonic()
    decode.start_pull(f"d-{req}", RemotePrefill("engine-p", req, host, port, (5, 2), 2 * BLOCK_TOKENS), [1, 6])
    while decode.pulls.pending():
        assert time.monotonic() - started < timeout_s, "the honest pull did not finish"
        time.sleep(0.01)
    finished, failed, _ = decode.pulls.take_finished()
    assert finished == {f"d-{req}"}
    return not failed, time.monotonic() - started


def _landed(p_kv: dict[str, torch.Tensor], d_kv: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(d_kv[n][kv][[1, 6]], p_kv[n][kv][[5, 2]]) for n in p_kv for kv in range(2))


def _still_held(prefill: Agent, *reqs: str) -> bool:
    held = prefill.holds.held
    return set(held) == set(reqs) and all(h.owner is None for h in held.values()) \
        and not prefill.holds.take_released()


def _reap(proc: subprocess.Popen) -> None:
    """Kill a peer program (if it still runs), wait for it and close our ends of its pipes."""
    proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def _accepted_on(port: int) -> int:
    """This process's sockets whose local end is ``port`` (the connections its listener there accepted
    and holds, from /proc/net/tcp and tcp6 by socket inode)."""
    return sum(1 for local, state in own_tcp() if local == port and state != "0A")  # 0A: LISTEN


def _sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile
            pass
    return count



def test_a_peer_without_the_secret_can_neither_claim_nor_release(agents) -> None:
    prefill, p_kv = agents(True, shared_secret=SECRET)
    decode, d_kv = agents(False, shared_secret=SECRET)
    prefill.holds.add("r1", lease_s=60)
    host, port = prefill.side_channel
    plain = _peer("plain", host, port, "r1")
    assert plain == {"prefill_proved": None, "got": "", "closed": True}  # not one byte answered
    wrong = _peer("secret", host, port, "r1", "another-secret")
    assert wrong["prefill_proved"] is False and wrong["got"] == "" and wrong["closed"]
    assert _still_held(prefill, "r1") and prefill.refusals == 2
    ok, _ = _pull(decode, host, port, "r1")  # the honest decoder's claim still works
    assert ok and _landed(p_kv, d_kv)
    wait(lambda: not prefill.holds.held)


def test_a_replayed_handshake_is_refused(agents, tmp_path) -> None:
    prefill, p_kv = agents(True, shared_secret=SECRET)
    decode, d_kv = agents(False, shared_secret=SECRET)
    prefill.holds.add("r1", lease_s=60)
    host, port = prefill.side_channel
    transcript = tmp_path / "c2s.bin"
    relay = subprocess.Popen([sys.executable, PEER, "relay", host, str(port), str(transcript)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert relay.stdout is not None
        relay_port = json.loads(relay.stdout.readline())["port"]
        ok, _ = _pull(decode, "127.0.0.1", relay_port, "r1")  # through the sniffing relay
        assert ok and _landed(p_kv, d_kv)
        wait(lambda: not prefill.holds.held)
        decode.close()  # ends the recorded connection
        relay.wait(10)
    finally:
        relay.kill()
        relay.wait()
        assert relay.stdout is not None
        relay.stdout.close()
    recorded = transcript.read_bytes()
    assert len(recorded) > 40 + 32 + 2 * 4  # nonce, proof and at least the hello and claim frames
    assert prefill.holds.take_released() == {"r1"}
    prefill.holds.add("r1", lease_s=60)  # held again: the recorded claim and done name it
    replayed = _peer("replay", host, port, transcript)
    assert replayed["closed"] and len(bytes.fromhex(replayed["got"])) == 64  # a fresh nonce and proof, no more
    assert _still_held(prefill, "r1") and prefill.refusals == 1


def test_a_flood_of_silent_connections_does_not_block_an_honest_decoder(agents, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="aio_datadist.integrations.vllm")
    prefill, p_kv = agents(True, shared_secret=SECRET)
    decode, d_kv = agents(False, shared_secret=SECRET)
    prefill.holds.add("r1", lease_s=60)
    host, port = prefill.side_channel
    before = _sockets()
    flood = subprocess.Popen([sys.executable, PEER, "flood", host, str(port), "300"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert flood.stdout is not None and flood.stdin is not None
        assert json.loads(flood.stdout.readline())["opened"] >= 250
        ok, seconds = _pull(decode, host, port, "r1")  # while new silent connections keep coming
        assert ok and _landed(p_kv, d_kv) and seconds < 10
        # of 300 and more, the flood holds at most MAX_PENDING_HANDSHAKES of the side channel's accepted
        # connections (the honest decode's own may be one more), and few sockets of ours besides (the
        # honest decode's side channel and link: 14, both ends in this process)
        # (a snapshot taken from this thread may also catch connections the loop accepted in its last batch and
        # not yet seen, or evicted and not yet closed: the least of a few snapshots is what the flood holds)
        held = []
        for _ in range(5):
            held.append(_accepted_on(port))
            time.sleep(0.02)
        assert 0 < min(held) <= MAX_PENDING_HANDSHAKES + 1, held
        assert _sockets() - before <= MAX_PENDING_HANDSHAKES + 20, (before, _sockets())
        flood.stdin.close()
        total = json.loads(flood.stdout.readline())["opened"]
        flood.wait(10)
    finally:
        _reap(flood)
    assert prefill.refusals >= total - MAX_PENDING_HANDSHAKES - 1 >= 250
    # and the log holds one WARNING about them, not one each (``refusal_log``)
    said = [r.getMessage() for r in caplog.records if "side channel from" in r.getMessage()]
    assert len(said) == 1 and "(1 refused since the last such warning)" in said[0], said[:3]
    wait(lambda: not prefill.holds.held)


def test_past_the_bound_a_newcomer_evicts_the_oldest_silent_handshake_not_one_that_spoke(agents) -> None:
    """Exactly MAX_PENDING_HANDSHAKES connections stay in the handshake, and a newcomer past them evicts the
    oldest that said nothing: a decode that sent its hello first (its proof still on its way) is kept, older
    than every silent one though it is."""
    from aio_datadist.integrations.vllm_auth import MAGIC

    prefill, _ = agents(True, shared_secret=SECRET)
    host, port = prefill.side_channel
    with socket.create_connection((host, port), timeout=3) as spoke:
        spoke.sendall(MAGIC + os.urandom(32))
        assert len(spoke.recv(64, socket.MSG_WAITALL)) == 64  # its hello was read: nonce and proof came back
        flood = subprocess.Popen([sys.executable, PEER, "flood", host, str(port), "40", "60", ""],  # 40, then none
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert flood.stdout is not None and json.loads(flood.stdout.readline())["opened"] == 40
            # every eviction done (waited for, not assumed 100 ms after the one before: a loaded host is slower)
            wait(lambda: prefill.refusals >= 41 - MAX_PENDING_HANDSHAKES, 5)
            held = []
            for _ in range(5):
                held.append(_accepted_on(port))
                time.sleep(0.02)
            assert (min(held), prefill.refusals) == (MAX_PENDING_HANDSHAKES, 41 - MAX_PENDING_HANDSHAKES), held
            spoke.setblocking(False)
            with pytest.raises(BlockingIOError):  # still open, still waiting for its proof to be read
                spoke.recv(1)
        finally:
            _reap(flood)


def test_a_decode_evicted_from_the_handshake_after_the_prefill_proved_itself_tries_again(agents, monkeypatch) -> None:
    """docs/vllm.md: a decode whose connection the prefill closes in the handshake tries again (3 connections in
    all). Also one evicted while its own proof is on the way (the prefill's proof reached it: its dial returned),
    by 16 newer dialers that all spoke (found by a hunt, 2026-12-07: its load failed, 'side channel closed')."""
    import threading

    from aio_datadist.integrations import vllm_auth

    prefill, p_kv = agents(True, shared_secret=SECRET)
    decode, d_kv = agents(False, shared_secret=SECRET)
    prefill.holds.add("r1", lease_s=60, blocks=[5])
    host, port = prefill.side_channel
    in_flight, go_on = threading.Event(), threading.Event()
    real_proof = vllm_auth.proof

    def proof_on_the_way(secret, role, first, second):  # the decode's first proof takes a while to reach the prefill
        if role == b"decode" and threading.current_thread() is decode.loop._thread and not in_flight.is_set():
            in_flight.set()
            go_on.wait(3)
        return real_proof(secret, role, first, second)

    monkeypatch.setattr(vllm_auth, "proof", proof_on_the_way)
    decode.start_pull("d1", RemotePrefill("engine-p", "r1", host, port, (5,), BLOCK_TOKENS), [2])
    assert in_flight.wait(3)
    hellos: list[socket.socket] = []
    try:
        for _ in range(MAX_PENDING_HANDSHAKES):  # other dialers from the decode's host, each hello read
            hellos.append(socket.create_connection((host, port), timeout=2))
            hellos[-1].sendall(vllm_auth.MAGIC + os.urandom(32))
            assert len(hellos[-1].recv(64, socket.MSG_WAITALL)) == 64
        go_on.set()
        wait(lambda: not decode.pulls.pending(), 5)
        finished, failed, _ = decode.pulls.take_finished()
        assert finished == {"d1"} and not failed, "the load failed: the decode did not try again"
        assert torch.equal(d_kv["layers.0"][:, 2], p_kv["layers.0"][:, 5])
    finally:
        go_on.set()
        for sock in hellos:
            sock.close()


def test_a_handshake_is_limited_to_link_timeout_ms(agents) -> None:
    """A connection silent from the start, and one that sent its hello and never its proof, are both closed
    once ``link_timeout_ms`` ran out, unanswered past the prefill's nonce and proof (the tests above keep
    connections in the handshake only seconds, under the default 5 s: they passed with no time limit)."""
    from aio_datadist.integrations.vllm_auth import MAGIC

    prefill, _ = agents(True, shared_secret=SECRET, link_timeout_ms=300)
    with socket.create_connection(prefill.side_channel, timeout=2) as silent, \
            socket.create_connection(prefill.side_channel, timeout=2) as spoke:
        spoke.sendall(MAGIC + os.urandom(32))
        assert len(spoke.recv(64, socket.MSG_WAITALL)) == 64
        started = time.monotonic()
        assert silent.recv(1) == b"" and spoke.recv(1) == b""  # closed by the prefill, within 2 s
        assert time.monotonic() - started < 1.5
    wait(lambda: prefill.refusals == 2, 2)


class _Distant(Relay):
    """A decode across a network: each chunk forwarded 40 ms late, each way."""

    async def pipe(self, reader, writer) -> None:
        try:
            while data := await reader.read(1 << 16):
                await asyncio.sleep(0.04)
                writer.write(data)
                await writer.drain()
            writer.close()
        except (ConnectionError, OSError):
            writer.transport.abort()


def test_a_flood_of_hellos_from_one_host_does_not_evict_a_distant_decoder(agents) -> None:
    """The hello is 40 bytes anyone can send; a local process sending one on a new connection every 2 ms,
    then stalling, must not push a decode 80 ms away out of the handshake (it can prove the secret, the
    flood cannot): past 16 in the handshake, the host holding the most of them loses its oldest."""
    prefill, p_kv = agents(True, shared_secret=SECRET)
    decode, d_kv = agents(False, shared_secret=SECRET)
    prefill.holds.add("r1", lease_s=60)
    host, port = prefill.side_channel
    from aio_datadist.integrations.vllm_auth import MAGIC

    hellos: list[socket.socket] = []  # one past the bound, each hello read: the host's oldest goes, no newer one
    try:
        for _ in range(MAX_PENDING_HANDSHAKES + 1):
            hellos.append(socket.create_connection((host, port), timeout=2, source_address=("127.0.0.2", 0)))
            hellos[-1].sendall(MAGIC + os.urandom(32))
            assert len(hellos[-1].recv(64, socket.MSG_WAITALL)) == 64
        try:
            assert hellos[0].recv(1) == b""  # evicted (a TimeoutError: still open)
        except ConnectionResetError:
            pass
        hellos[-2].setblocking(False)
        with pytest.raises(BlockingIOError):
            hellos[-2].recv(1)
    finally:
        for sock in hellos:
            sock.close()
    relay_loop = LoopThread("relay")
    relay = relay_loop.call(_Distant((host, port)).__aenter__())
    flood = subprocess.Popen([sys.executable, PEER, "flood", host, str(port), "16", "0.002", "127.0.0.2"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert flood.stdout is not None and flood.stdin is not None
        assert json.loads(flood.stdout.readline())["opened"] == 16
        time.sleep(0.2)  # the flood runs
        ok, _ = _pull(decode, *relay.address, "r1")
        assert ok and _landed(p_kv, d_kv)
        assert prefill.refusals >= 50  # the flood was evicted meanwhile
        flood.stdin.close()
        flood.wait(10)
    finally:
        _reap(flood)
        relay_loop.call(relay.__aexit__(None, None, None))
        relay_loop.stop()


def test_frames_that_lie_about_their_size_are_dropped_and_release_nothing(agents) -> None:
    prefill, p_kv = agents(True, shared_secret=SECRET, link_timeout_ms=1000)  # the handshake's time limit
    decode, d_kv = agents(False, shared_secret=SECRET)
    prefill.holds.add("r1", lease_s=60)
    prefill.holds.add("r2", lease_s=60)
    host, port = prefill.side_channel
    unauthenticated = _peer("lie", host, port, "-")  # too short for the handshake: timed out, unanswered
    assert all(seen == {"got": "", "closed": True} for seen in unauthenticated.values()), unauthenticated
    authenticated = _peer("lie", host, port, SECRET)  # a buggy peer with the secret
    for name, seen in authenticated.items():
        assert seen["closed"], name
        if name != "short_body":  # a header out of bounds is answered with the error, then the connection ends
            assert b"'header'" in bytes.fromhex(seen["got"]), name
    assert _still_held(prefill, "r1", "r2")
    ok, _ = _pull(decode, host, port, "r1")
    assert ok and _landed(p_kv, d_kv)
    wait(lambda: set(prefill.holds.held) == {"r2"})


def test_a_frame_whose_body_never_all_comes_is_not_read_as_a_frame(agents) -> None:
    """A header promising 1000 bytes, then a whole ``done`` frame's body and the end of the stream: the bytes
    that came are not taken for the frame, so nothing answers them and the connection just ends."""
    prefill, _ = agents(True, shared_secret=SECRET)
    prefill.holds.add("r1", lease_s=60)
    host, port = prefill.side_channel
    assert _peer("lie", host, port, SECRET)["short_body"] == {"got": "", "closed": True}
    assert _still_held(prefill, "r1")


def test_the_secret_option_env_and_warning(monkeypatch, caplog) -> None:
    monkeypatch.setenv(SECRET_ENV, "from-env")
    assert AgentOptions.from_extra({}).shared_secret == "from-env"
    assert AgentOptions.from_extra({"shared_secret": "from-config"}).shared_secret == "from-config"  # config wins
    assert "from-config" not in repr(AgentOptions.from_extra({"shared_secret": "from-config"}))
    monkeypatch.delenv(SECRET_ENV)
    assert AgentOptions.from_extra({}).shared_secret == ""
    with pytest.raises(LLMException, match="max_claims_per_connection"):
        AgentOptions.from_extra({"max_claims_per_connection": 0})
    agent = Agent(True, False, "engine-p", AgentOptions())
    try:
        with caplog.at_level(logging.WARNING, logger="aio_datadist.integrations.vllm"):
            tensors, layout, _ = kv_layout(kv_caches(None), BLOCKS, BLOCK_TOKENS)
            agent.register(tensors, layout)
    finally:
        agent.close()
    assert [r.message for r in caplog.records].count(next(
        r.message for r in caplog.records if "unauthenticated" in r.message)) == 1
    caplog.clear()
    agent = Agent(True, False, "engine-p", AgentOptions(shared_secret=SECRET))
    try:
        with caplog.at_level(logging.WARNING, logger="aio_datadist.integrations.vllm"):
            agent.register(tensors, layout)
    finally:
        agent.close()
    assert not [r for r in caplog.records if "unauthenticated" in r.message]  # with a secret: no such warning


@pytest.mark.parametrize("name, value", [("pull_timeout_ms", 2.9), ("link_timeout_ms", 1500.7),
                                         ("link_timeout_ms", 0.5), ("max_claims_per_connection", True),
                                         ("data_port", False), ("lease_s", True)])
def test_numeric_options_refuse_bools_and_fractions_naming_the_value(name: str, value: object) -> None:
    """Before, ``int()`` cut 2.9 to 2 and took ``true`` as 1; 0.5 was refused as "got 0" (found by an audit)."""
    with pytest.raises(LLMException, match=f"'{name}': must be .*, got {re.escape(repr(value))} ") as refused:
        AgentOptions.from_extra({name: value})
    assert refused.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_a_number_option_too_big_for_a_float_is_refused_naming_it() -> None:
    """JSON allows any integer: one past a float's range was an ``OverflowError`` (found by review)."""
    with pytest.raises(LLMException, match="'lease_s': must be a number") as refused:
        AgentOptions.from_extra({"lease_s": 10**400})
    assert refused.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_numeric_options_take_integral_floats_and_digit_strings() -> None:
    opts = AgentOptions.from_extra({"link_timeout_ms": 2000.0, "pull_timeout_ms": "7000", "lease_s": 2})
    assert (opts.link_timeout_ms, opts.pull_timeout_ms, opts.lease_s) == (2000, 7000, 2.0)
    assert type(opts.link_timeout_ms) is int and type(opts.lease_s) is float


def test_a_connection_holds_at_most_its_claim_limit(agents) -> None:
    prefill, _ = agents(True, shared_secret=SECRET, max_claims_per_connection=2)
    for req in ("r0", "r1", "r2", "r3"):
        prefill.holds.add(req, lease_s=60)
    assert prefill.holds.claim("r0", "another connection", 60)  # not counted against the peer's limit
    host, port = prefill.side_channel
    replies = _peer("claims", host, port, SECRET, "r1", "r2", "r3", "r1")["replies"]
    assert [r["ok"] for r in replies] == [True, True, False, True]  # r1 again: its own claim
    assert "2 claims" in replies[2]["error"]
    wait(lambda: set(prefill.holds.held) == {"r0", "r3"})  # its connection closed: its two claims are freed


def test_a_kv_both_worker_is_not_made_to_prove_the_secret_to_itself_for_a_process_without_it(agents) -> None:
    """Reflection (guarantee 147): a worker that is prefill and decode (``kv_both``) holds a request for its
    real decoder; its decode half is sent to pull from a process without the secret (``kv_transfer_params``
    name the host and port, and API clients can send their own: row 142), which hands the decode's hello to
    the worker's own side channel and the answer back, to have the worker prove the secret to itself. The
    side channel answers nothing, the pull fails saying why, and the held request stays held. Before the fix:
    the side channel answered, the decode proved the secret in turn, and the relay claimed and released the
    request (the prefill freed its blocks)."""
    worker = Agent(True, True, "engine-b", AgentOptions(shared_secret=SECRET))
    try:
        tensors, layout, _ = kv_layout(kv_caches(1), BLOCKS, BLOCK_TOKENS)
        worker.register(tensors, layout)
        worker.holds.add("r1", lease_s=60)
        host, port = worker.side_channel
        proc = subprocess.Popen([sys.executable, PEER, "reflect", host, str(port), "r1"], stdout=subprocess.PIPE,
                                text=True)
        try:
            assert proc.stdout is not None
            relay_port = int(proc.stdout.readline())
            worker.start_pull("d-x", RemotePrefill("engine-b", "rX", "127.0.0.1", relay_port, (5, 2),
                                                   2 * BLOCK_TOKENS), [1, 6])
            seen = json.loads(proc.stdout.readline())
            assert proc.wait(timeout=10) == 0
        finally:
            _reap(proc)
        assert seen == {"answered": False, "proved": False, "claim": None, "done": None}, seen
        wait(lambda: not worker.pulls.pending())
        finished, failed, _ = worker.pulls.take_finished()
        assert finished == {"d-x"} and failed == {"d-x"}
        assert _still_held(worker, "r1")
    finally:
        worker.close()


@pytest.mark.parametrize("hangup", ["reflect", "reflect-reset", "reflect-hold"], ids=["closed", "reset", "held open"])
def test_a_pull_refused_as_a_reflection_says_why_and_is_not_retried(agents, caplog, hangup) -> None:
    """Guarantee 147's failure of the pull: the decode half's own hello came back to its side channel, which
    answered nothing; the pull fails saying so (an ``AuthError``), not as a handshake the prefill dropped
    (``HandshakeClosed``, dialled again up to ``HANDSHAKE_ATTEMPTS`` times), whether the relay then closes the
    decode's connection or resets it (``reset``: passed with a reset not taken for the relay's hang-up, audit), or
    keeps it open (``held open``: the dial is ended once its hello reached its own side channel; before, it waited
    out ``link_timeout_ms`` and failed as a ``TimeoutError`` saying nothing, found by the second audit)."""
    worker = Agent(True, True, "engine-b", AgentOptions(shared_secret=SECRET))
    try:
        tensors, layout, _ = kv_layout(kv_caches(1), BLOCKS, BLOCK_TOKENS)
        worker.register(tensors, layout)
        host, port = worker.side_channel
        proc = subprocess.Popen([sys.executable, PEER, hangup, host, str(port), "r1"], stdout=subprocess.PIPE,
                                text=True)
        try:
            assert proc.stdout is not None
            relay_port = int(proc.stdout.readline())
            with caplog.at_level(logging.WARNING, logger="aio_datadist.integrations.vllm"):
                started = time.monotonic()
                worker.start_pull("d-x", RemotePrefill("engine-b", "rX", "127.0.0.1", relay_port, (5, 2),
                                                       2 * BLOCK_TOKENS), [1, 6])
                assert proc.wait(timeout=10) == 0
                wait(lambda: not worker.pulls.pending())
                took = time.monotonic() - started
        finally:
            _reap(proc)
        assert worker.pulls.take_finished()[1] == {"d-x"}
        why = [r.getMessage() for r in caplog.records if "request d-x: pull" in r.getMessage()]
        assert len(why) == 1 and "AuthError" in why[0] and "own side channel" in why[0], why
        assert took < 2.5, f"the pull took {took:.2f} s to fail (link_timeout_ms is 5 s)"
    finally:
        worker.close()
