"""The vLLM connector's own logic, without vLLM: its codec, its tables, and two workers' agents on loopback.

The agents here are the connector's worker machinery as vLLM drives it (a
prefill registers paged KV tensors and holds a finished request's blocks; a
decode pulls them), over real sockets; ``tests/test_vllm_integration.py``
runs the connector inside real vLLM engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import _vllm_agents
import pytest
import torch
from _vllm_agents import BLOCK_TOKENS, BLOCKS, DIM, HEADS, LAYERS, kv_caches, wait
from relay import Relay

from aio_datadist import LLMException, LLMStatusCode
from aio_datadist.integrations.vllm_agent import LoopThread, kv_layout
from aio_datadist.integrations.vllm_state import DecodePulls, PrefillHolds
from aio_datadist.integrations.vllm_wire import (
    MAX_FRAME,
    RemotePrefill,
    decode_frame,
    decode_reply,
    encode_frame,
    frame_length,
    parse_transfer_params,
    transfer_params,
)

agents = _vllm_agents.agents  # the fixture



def _params(**change: object) -> dict:
    params = transfer_params(engine_id="p0", request_id="r1", host="127.0.0.1", port=5000, block_ids=[4, 2, 9],
                             num_tokens=20)
    params.update(change)
    return params


def test_transfer_params_round_trip_and_refusals() -> None:
    remote = parse_transfer_params(_params())
    assert remote == RemotePrefill("p0", "r1", "127.0.0.1", 5000, (4, 2, 9), 20)
    assert parse_transfer_params(_params(remote_block_ids=[[4, 2, 9]])).block_ids == (4, 2, 9)  # vLLM's groups
    for field, bad in (("remote_block_ids", []), ("remote_block_ids", [1, 1]), ("remote_block_ids", [1, -2]),
                       ("remote_block_ids", "1,2"), ("remote_port", 0), ("remote_port", "5000"),
                       ("remote_host", ""), ("remote_host", "h" * 300), ("remote_num_tokens", True),
                       ("remote_engine_id", None)):
        with pytest.raises(LLMException) as caught:
            parse_transfer_params(_params(**{field: bad}))
        assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID and field in str(caught.value)
    with pytest.raises(LLMException, match="connector"):
        parse_transfer_params(_params(connector="nixl"))


def test_the_codec_refuses_bad_frames() -> None:
    frame = encode_frame({"id": 7, "op": "claim", "req": "r1"})
    assert frame_length(frame[:4]) == len(frame) - 4
    assert decode_frame(frame[4:]) == {"id": 7, "op": "claim", "req": "r1"}
    bad_bodies = {
        b"\xff\xfe": "frame", b"[1, 2]": "frame", b'{"id": 1, "op": "hello"': "frame",
        b'{"id": -1, "op": "hello"}': "id", b'{"id": 1.5, "op": "hello"}': "id", b'{"op": "hello"}': "id",
        b'{"id": 1, "op": "pickle"}': "op", b'{"id": 1, "op": "claim"}': "req",
        b'{"id": 1, "op": "claim", "req": 5}': "req",
        b'{"id": 1, "op": "hello", "x": 1}': "x", b'{"id": NaN, "op": "hello"}': "frame",
        b'{"id": true, "op": "hello"}': "id", b'{"id": 18446744073709551616, "op": "hello"}': "id",
        b'{"id": 1, "op": "held"}': "req", b'{"id": 1, "op": "done", "req": ""}': "req",
        b'{"id": 1, "op": "done", "req": "' + b"r" * 257 + b'"}': "req",
        b"[" * 100_000: "frame",
    }
    for body, field in bad_bodies.items():
        with pytest.raises(LLMException) as caught:
            decode_frame(body)
        assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID and f"'{field}'" in str(caught.value)
    for header in (struct.pack(">I", 0), struct.pack(">I", MAX_FRAME + 1), b"\x00\x01"):
        with pytest.raises(LLMException, match="'header'"):
            frame_length(header)
    with pytest.raises(LLMException, match="'message'"):
        encode_frame({"id": 1, "op": "claim", "req": "x" * MAX_FRAME})
    with pytest.raises(LLMException, match="'layout'"):
        decode_reply(b'{"id": 1, "ok": true, "cluster_id": 3, "data_host": "h", "data_port": 1, "engine_id": "e"}',
                     "hello")


def test_prefill_holds_free_once_done_closed_or_timed_out() -> None:
    now = [100.0]
    holds = PrefillHolds(clock=lambda: now[0])
    for req in ("a", "b", "c", "d"):
        holds.add(req, lease_s=10)
    assert not holds.claim("zzz", "conn1", 5)  # never held
    assert holds.claim("a", "conn1", 5) and holds.claim("b", "conn1", 5) and holds.claim("c", "conn2", 5)
    assert not holds.claim("a", "conn2", 5)  # another decoder cannot take it over
    assert not holds.done("d", "conn1")  # nor release one that no one claimed
    assert not holds.done("a", "conn2") and holds.done("a", "conn1")
    assert holds.take_released() == {"a"} and holds.take_released() == set()
    assert holds.drop_owner("conn1") == ["b"]  # its decoder's side channel closed
    now[0] += 5.5  # past c's claim (5 s), before d's lease (10 s)
    assert holds.take_released() == {"b", "c"}
    assert set(holds.held) == {"d"}
    now[0] += 5
    assert holds.take_released() == {"d"} and not holds.held
    assert not holds.claim("d", "conn1", 5)  # a late decoder is refused


def test_a_claim_past_the_lease_is_refused_before_the_next_expiry_pass() -> None:
    """The expiry pass runs every 0.5 s: a claim that comes after the lease (or a re-claim after its own hold)
    ran out, but before that pass, is refused and frees the request then, instead of holding it again."""
    now = [100.0]
    holds = PrefillHolds(clock=lambda: now[0])
    holds.add("late", lease_s=10)
    holds.add("mine", lease_s=10)
    assert holds.claim("mine", "conn1", 5)
    now[0] += 10.4  # "late"'s lease and "mine"'s hold are over; no expire() ran
    assert not holds.claim("late", "conn2", 5) and not holds.claim("mine", "conn1", 5)
    assert not holds.held and holds.take_released() == {"late", "mine"}
    assert sorted(holds.take_expired()) == ["late", "mine"]  # logged once, as an expiry pass would have


def test_decode_pulls_report_only_stopped_pulls() -> None:
    pulls = DecodePulls()
    cancelled: list[str] = []
    pulls.start("x", (1, 2))
    pulls.start("y", (3,))
    pulls.set_cancel("x", lambda: cancelled.append("x"))
    with pytest.raises(ValueError):
        pulls.start("x", (5,))
    pulls.abort({"x", "other"})
    assert cancelled == ["x"]
    assert pulls.take_finished() == (set(), set(), set())  # aborted, not yet stopped: not reported
    pulls.end("x", ok=False, error="aborted")
    pulls.end("y", ok=True)
    assert pulls.take_finished() == ({"x", "y"}, {"x"}, {1, 2})
    assert pulls.pending() == set()



def test_kv_layout_splits_k_and_v_and_refuses_other_shapes() -> None:
    tensors, layout, per_layer = kv_layout(kv_caches(0), BLOCKS, BLOCK_TOKENS)
    assert per_layer == 2 and layout.tensors == 2 * LAYERS and layout.num_blocks == BLOCKS
    assert layout.block_bytes == HEADS * BLOCK_TOKENS * DIM * 2 and all(t.shape[0] == BLOCKS for t in tensors)
    with pytest.raises(LLMException, match="blocks outermost"):
        kv_layout({"l0": torch.zeros(BLOCKS + 1, 4)}, BLOCKS, BLOCK_TOKENS)
    with pytest.raises(LLMException, match="not contiguous"):
        kv_layout({"l0": torch.zeros(4, BLOCKS).t()}, BLOCKS, BLOCK_TOKENS)




def test_a_decode_pulls_held_blocks_and_the_prefill_frees_them(agents) -> None:
    prefill, p_kv = agents(True)
    decode, d_kv = agents(False)
    host, port = prefill.side_channel
    prefill.holds.add("r1", lease_s=60)
    remote = parse_transfer_params(transfer_params(engine_id="engine-p", request_id="r1", host=host, port=port,
                                                   block_ids=[5, 3, 11], num_tokens=3 * BLOCK_TOKENS))
    decode.start_pull("d1", remote, [2, 7])  # a local prefix-cache hit covered the first block: the tail moves
    wait(lambda: not decode.pulls.pending())
    assert decode.pulls.take_finished() == ({"d1"}, set(), set())
    for name in p_kv:
        for k_or_v in range(2):
            assert torch.equal(d_kv[name][k_or_v][[2, 7]], p_kv[name][k_or_v][[3, 11]])
            assert not d_kv[name][k_or_v][[0, 1, 3]].any()  # nothing else written
    wait(lambda: prefill.holds.take_released() == {"r1"})


def test_an_unheld_request_fails_its_pull_and_writes_nothing(agents) -> None:
    prefill, _ = agents(True, claim_wait_s=0.2)
    decode, d_kv = agents(False)
    host, port = prefill.side_channel
    remote = parse_transfer_params(transfer_params(engine_id="engine-p", request_id="gone", host=host, port=port,
                                                   block_ids=[1], num_tokens=BLOCK_TOKENS))
    decode.start_pull("d2", remote, [4])
    wait(lambda: not decode.pulls.pending())
    assert decode.pulls.take_finished() == ({"d2"}, {"d2"}, {4})  # reported failed: vLLM recomputes
    assert not any(t.any() for t in d_kv.values())


def test_a_bad_frame_ends_the_connection_and_frees_its_claims(agents) -> None:
    prefill, _ = agents(True)
    prefill.holds.add("r9", lease_s=60)
    with socket.create_connection(prefill.side_channel, timeout=5) as sock:
        sock.sendall(encode_frame({"id": 1, "op": "claim", "req": "r9"}))
        reply = sock.recv(4096)
        assert decode_reply(reply[4:], "claim")["ok"]
        sock.sendall(struct.pack(">I", 9) + b"cos\nsystem")  # a pickle-looking body: refused, never loaded
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
        error = decode_reply(data[4:], "claim")
        assert not error["ok"] and "'frame'" in error["error"]
    wait(lambda: prefill.holds.take_released() == {"r9"})  # the claimer is gone: its blocks are freed


def test_a_claimer_whose_side_channel_closes_lets_the_prefill_free_its_blocks(agents) -> None:
    """A decode killed after its claim: its side channel is reset (no done, no bad frame) and the prefill frees
    the blocks at once, not at the claim's timeout or the lease; the request is not held for anyone after."""
    prefill, _ = agents(True)
    prefill.holds.add("r9", lease_s=60)
    with socket.create_connection(prefill.side_channel, timeout=5) as sock:
        sock.sendall(encode_frame({"id": 1, "op": "claim", "req": "r9"}))
        assert decode_reply(sock.recv(4096)[4:], "claim")["ok"]
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # closed as a kill does
    _released_soon(prefill, "r9")
    assert not prefill.holds.claim("r9", "late", 5)


def test_a_claim_waiting_when_its_side_channel_closes_is_never_granted(agents) -> None:
    """A claim waiting for vLLM to name its request, its connection reset meanwhile: once named, the request is
    not claimed for the gone connection (its blocks held to the claim's timeout for no one) but free to claim."""
    prefill, _ = agents(True, claim_wait_s=3.0)
    with socket.create_connection(prefill.side_channel, timeout=3) as sock:
        sock.sendall(encode_frame({"id": 1, "op": "claim", "req": "r7"}))
        wait(lambda: "r7" in prefill._naming, 3)  # the claim waits
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    wait(lambda: not prefill.loop.call(_conns(prefill)), 3)
    prefill.holds.add("r7", lease_s=60)
    with socket.create_connection(prefill.side_channel, timeout=3) as sock:
        sock.sendall(encode_frame({"id": 2, "op": "claim", "req": "r7"}))
        assert decode_reply(sock.recv(4096)[4:], "claim")["ok"]


@pytest.mark.parametrize("length", [MAX_FRAME + 1, 2**31, 0])
def test_the_server_refuses_a_header_past_the_bound_at_once_and_frees_claims(agents, length) -> None:
    """The side channel's server bounds a frame itself: a header announcing 0 bytes or more than 64 KiB is
    answered (``'header'``) and the connection ended within 2 s, its claims freed, with no body read. The tests
    above check the codec's own bound, and passed with the server reading whatever the header said (audit,
    2026-12-07)."""
    prefill, _ = agents(True)
    prefill.holds.add("r9", lease_s=60)
    with socket.create_connection(prefill.side_channel, timeout=3) as sock:
        sock.sendall(encode_frame({"id": 1, "op": "claim", "req": "r9"}))
        assert decode_reply(sock.recv(4096)[4:], "claim")["ok"]
        start = time.monotonic()
        sock.sendall(struct.pack(">I", length))  # no body follows: a bounded server answers the header alone
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
        assert time.monotonic() - start < 2
        error = decode_reply(data[4:], "claim")
        assert not error["ok"] and "'header'" in error["error"]
    wait(lambda: prefill.holds.take_released() == {"r9"})


def test_every_field_of_a_hello_and_a_claim_reply_is_checked() -> None:
    """Each field of a hello's and a claim's reply is checked (the codec test above checks ``layout`` only, and
    passed with ``hold_ms`` unchecked; audit, 2026-12-07)."""
    hello = {"id": 1, "ok": True, "cluster_id": 3, "data_host": "h", "data_port": 1, "engine_id": "e",
             "layout": {"tensors": 1, "num_blocks": 1, "block_bytes": 1, "block_tokens": 1, "dtype": "f"}}
    decode_reply(json.dumps(hello).encode(), "hello")
    for field, bad in (("cluster_id", -1), ("data_port", 0), ("data_port", 70000), ("data_host", ""),
                       ("engine_id", 5)):
        with pytest.raises(LLMException) as caught:
            decode_reply(json.dumps({**hello, field: bad}).encode(), "hello")
        assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID and f"'{field}'" in str(caught.value)
    for claim in ({"id": 1, "ok": True}, {"id": 1, "ok": True, "hold_ms": 0}, {"id": 1, "ok": True, "hold_ms": "5"},
                  {"id": 1, "ok": True, "hold_ms": 2**31}):
        with pytest.raises(LLMException, match="'hold_ms'"):
            decode_reply(json.dumps(claim).encode(), "claim")
    with pytest.raises(LLMException, match="'error'"):
        decode_reply(b'{"id": 1, "ok": false}', "claim")


def _remote(prefill, req: str, blocks: list[int]) -> RemotePrefill:
    host, port = prefill.side_channel
    return parse_transfer_params(transfer_params(engine_id="engine-p", request_id=req, host=host, port=port,
                                                 block_ids=blocks, num_tokens=len(blocks) * BLOCK_TOKENS))


def _pull_one(prefill, decode) -> None:
    """A first pull (prefill block 5 into decode block 2): the decode's side channel and link are up."""
    prefill.holds.add("r1", lease_s=60)
    decode.start_pull("d1", _remote(prefill, "r1", [5]), [2])
    wait(lambda: not decode.pulls.pending())
    assert decode.pulls.take_finished() == ({"d1"}, set(), set())


def _assert_block(d_kv, dst: int, p_kv, src: int) -> None:
    """Decode block ``dst`` holds prefill block ``src``, K and V of every layer."""
    for name in p_kv:
        for k_or_v in range(2):
            assert torch.equal(d_kv[name][k_or_v][dst], p_kv[name][k_or_v][src])


def test_a_side_channel_lost_while_the_link_stays_up_is_dialled_again(agents) -> None:
    prefill, p_kv = agents(True)
    decode, d_kv = agents(False)
    _pull_one(prefill, decode)
    peer_task = decode._peers[prefill.side_channel]  # a lost side channel leaves the table: taken before

    async def drop_side_channels() -> None:  # e.g. an idle timeout on the way; the KV link stays up
        for writer in list(prefill._conns):
            writer.transport.abort()

    prefill.loop.call(drop_side_channels())
    wait(lambda: peer_task.done() and peer_task.result().broken is not None)
    wait(lambda: prefill.side_channel not in decode._peers)
    prefill.holds.add("r2", lease_s=60)
    decode.start_pull("d2", _remote(prefill, "r2", [9]), [4])
    wait(lambda: not decode.pulls.pending())
    assert decode.pulls.take_finished() == ({"d2"}, set(), set())
    _assert_block(d_kv, 4, p_kv, 9)


def test_a_kv_link_lost_while_the_side_channel_stays_up_is_linked_again(agents) -> None:
    prefill, p_kv = agents(True)
    decode, d_kv = agents(False)
    _pull_one(prefill, decode)
    peer = decode._peers[prefill.side_channel].result()

    async def drop_kv_link() -> None:  # e.g. the data network failed for a while; the side channel stays up
        link = decode._dd._links.links[peer.cluster_id]
        link.writer.transport.abort()
        for _ in range(200):
            if link.broken is not None:
                return
            await asyncio.sleep(0.01)

    decode.loop.call(drop_kv_link())
    assert peer.broken is None
    pulled = set()
    for i, (req, blocks) in enumerate([("r2", [9]), ("r3", [11])]):  # the first may fail: it finds the link gone
        prefill.holds.add(req, lease_s=60)
        decode.start_pull(f"d{i + 2}", _remote(prefill, req, blocks), [4 + i])
        wait(lambda: not decode.pulls.pending())
        pulled |= decode.pulls.take_finished()[0]
    assert "d3" in pulled
    _assert_block(d_kv, 5, p_kv, 11)


def test_pulls_waiting_on_a_failed_relink_fail_with_it(agents) -> None:
    prefill, _ = agents(True)
    decode, _ = agents(False)
    _pull_one(prefill, decode)
    peer = decode._peers[prefill.side_channel].result()
    attempts = []

    async def link_fails(cluster) -> None:  # the prefill's data port no longer answers
        attempts.append(cluster.remote_cluster_id)
        await asyncio.sleep(0.3)
        raise ConnectionError("link refused")

    decode._link = link_fails
    peer.link_lost = True
    started = time.monotonic()
    for i in range(3):
        prefill.holds.add(f"r{i + 2}", lease_s=60)
        decode.start_pull(f"d{i + 2}", _remote(prefill, f"r{i + 2}", [9 + i]), [4 + i])
    wait(lambda: not decode.pulls.pending())
    finished, failed, _ = decode.pulls.take_finished()
    assert finished == failed == {"d2", "d3", "d4"}
    assert attempts == [peer.cluster_id]  # one attempt for the three, not one each in turn
    assert time.monotonic() - started < 2.0


def test_an_aborted_pull_that_was_linking_again_does_not_fail_the_pulls_waiting_on_it(agents) -> None:
    """The one attempt above, aborted by vLLM (its request's task cancelled while it links) is no failed link:
    the pulls waiting on it link again in their turn and load (found by a hunt, 2026-12-07: they failed
    'linking again failed' without trying)."""
    prefill, p_kv = agents(True)
    decode, d_kv = agents(False)
    _pull_one(prefill, decode)
    peer = decode._peers[prefill.side_channel].result()
    real_link, linking = decode._link, []

    async def slow_link(cluster) -> None:  # linking again takes a while (a data network coming back)
        linking.append(cluster.remote_cluster_id)
        await asyncio.sleep(0.3)
        await real_link(cluster)

    decode._link = slow_link
    peer.link_lost = True
    for i in range(3):
        prefill.holds.add(f"r{i + 2}", lease_s=60)
        decode.start_pull(f"d{i + 2}", _remote(prefill, f"r{i + 2}", [10 + i]), [4 + i])
    wait(lambda: len(linking) == 1)
    decode.pulls.abort({"d2"})  # the user of the request whose pull links went away
    wait(lambda: not decode.pulls.pending())
    finished, failed, _ = decode.pulls.take_finished()
    assert finished == {"d2", "d3", "d4"} and failed == {"d2"}, failed
    _assert_block(d_kv, 5, p_kv, 11)
    _assert_block(d_kv, 6, p_kv, 12)


def test_a_claim_waiting_for_its_request_does_not_hold_up_the_others(agents) -> None:
    prefill, p_kv = agents(True, claim_wait_s=3.0)
    decode, d_kv = agents(False)
    decode.start_pull("ghost", _remote(prefill, "unknown-yet", [3]), [1])  # its claim waits at the prefill
    wait(lambda: prefill._conns)
    time.sleep(0.2)
    prefill.holds.add("r1", lease_s=60)
    started = time.monotonic()
    decode.start_pull("d1", _remote(prefill, "r1", [5]), [2])
    wait(lambda: "d1" not in decode.pulls.pending())
    assert time.monotonic() - started < 1.5  # not after the other claim's 3 s
    assert "ghost" in decode.pulls.pending()
    _assert_block(d_kv, 2, p_kv, 5)
    wait(lambda: not decode.pulls.pending())
    finished, failed, _ = decode.pulls.take_finished()
    assert finished == {"d1", "ghost"} and failed == {"ghost"}


def test_an_abort_that_comes_before_the_pull_runs_still_cancels_it() -> None:
    pulls = DecodePulls()
    cancelled: list[str] = []
    pulls.start("x", (1, 2))  # start_pull: the pull's task has not run yet (it sets its cancel when it does)
    pulls.abort({"x"})  # vLLM aborts the request in the same step
    pulls.set_cancel("x", lambda: cancelled.append("x"))
    assert cancelled == ["x"]
    pulls.end("x", ok=False, error="aborted")
    assert pulls.take_finished() == ({"x"}, {"x"}, {1, 2})


def test_a_pull_aborted_before_its_task_ran_moves_nothing(agents) -> None:
    prefill, _ = agents(True)
    decode, d_kv = agents(False)
    prefill.holds.add("r4", lease_s=60)
    decode.loop.loop.call_soon_threadsafe(time.sleep, 0.3)  # the decode's loop is busy: the pull waits to run
    decode.start_pull("d4", _remote(prefill, "r4", [6]), [3])
    decode.pulls.abort({"d4"})
    wait(lambda: not decode.pulls.pending())
    assert decode.pulls.take_finished() == ({"d4"}, {"d4"}, {3})
    time.sleep(0.2)
    assert not any(t.any() for t in d_kv.values())


def _released_soon(prefill, req: str, timeout_s: float = 3.0) -> None:
    """``req``'s blocks are freed within ``timeout_s`` (far before its lease or claim timeout)."""
    released: set[str] = set()

    def freed() -> bool:
        released.update(prefill.holds.take_released())
        return req in released

    wait(freed, timeout_s)


def test_a_pull_aborted_before_it_claimed_lets_the_prefill_free_the_blocks(agents) -> None:
    prefill, _ = agents(True)
    decode, d_kv = agents(False)
    prefill.holds.add("r5", lease_s=60)
    decode.loop.loop.call_soon_threadsafe(time.sleep, 0.3)  # aborted before the pull ran: nothing claimed
    decode.start_pull("d5", _remote(prefill, "r5", [6]), [3])
    decode.pulls.abort({"d5"})
    wait(lambda: not decode.pulls.pending())
    assert decode.pulls.take_finished() == ({"d5"}, {"d5"}, {3})
    _released_soon(prefill, "r5")  # not only after its 60 s lease
    assert not any(t.any() for t in d_kv.values())


def test_a_pull_aborted_while_its_claim_waits_lets_the_prefill_free_the_blocks(agents) -> None:
    prefill, _ = agents(True, claim_wait_s=3.0)
    decode, d_kv = agents(False)
    decode.start_pull("d6", _remote(prefill, "r6", [6]), [3])  # vLLM's metadata naming r6 is late at the prefill

    def claim_waiting() -> bool:
        task = decode._peers.get(prefill.side_channel)
        return task is not None and task.done() and any(op == "claim" for op, _ in task.result().replies.values())

    wait(claim_waiting)
    decode.pulls.abort({"d6"})
    wait(lambda: not decode.pulls.pending())
    assert decode.pulls.take_finished() == ({"d6"}, {"d6"}, {3})
    prefill.holds.add("r6", lease_s=60)  # the waiting claim now succeeds for the decode's connection
    _released_soon(prefill, "r6")  # not only after the claim's 35 s (pull_timeout_ms + claim_grace_s)
    assert not any(t.any() for t in d_kv.values())


class _SlowRelay(Relay):
    """Forwards a link's bytes; while ``rate`` (bytes/s) is set, the prefill-to-decode direction is paced."""

    rate: float | None = None

    async def downstream(self, reader, writer) -> None:
        try:
            while data := await reader.read(1024):
                if self.rate:
                    await asyncio.sleep(len(data) / self.rate)
                writer.write(data)
                await writer.drain()
            writer.close()
        except (ConnectionError, OSError):
            writer.transport.abort()


class _LateReplies(Relay):
    """Forwards a side channel; the prefill's replies arrive ``delay`` s after it sent them (a long way)."""

    delay = 0.3

    async def downstream(self, reader, writer) -> None:
        try:
            while data := await reader.read(65536):
                await asyncio.sleep(self.delay)
                writer.write(data)
                await writer.drain()
            writer.close()
        except (ConnectionError, OSError):
            writer.transport.abort()


@contextlib.contextmanager
def _slow_data_path(agents) -> Iterator[tuple[Any, Any, Any, Any]]:
    """A prefill whose KV endpoint the decode reaches through a relay of 4096 B/s (a pull of 6 KiB takes about
    1.5 s): ``(prefill, its kv caches, decode, its kv caches)``."""
    relay_loop = LoopThread("relay")
    relay = _SlowRelay(("127.0.0.1", 0))
    try:
        prefill, p_kv = agents(True, transport="tcp")
        relay.target = prefill._dd.listen_address
        relay_loop.call(relay.__aenter__())
        prefill.options.advertise_data = "{}:{}".format(*relay.address)
        decode, d_kv = agents(False, transport="tcp")
        relay.rate = 4096.0
        yield prefill, p_kv, decode, d_kv
    finally:
        relay.rate = None
        relay_loop.call(relay.__aexit__(None, None, None))
        relay_loop.stop()


def test_a_pull_whose_side_channel_closes_meanwhile_is_reported_failed(agents) -> None:
    """The prefill frees a claim whose side channel closed: a decode that goes on pulling reads freed blocks."""
    with _slow_data_path(agents) as (prefill, _, decode, _):
        prefill.holds.add("r7", lease_s=60)
        decode.start_pull("d7", _remote(prefill, "r7", [6, 8]), [3, 5])
        wait(lambda: prefill.holds.held.get("r7", None) is not None and prefill.holds.held["r7"].owner is not None)

        async def drop_side_channels() -> None:
            for writer in list(prefill._conns):
                writer.transport.abort()

        prefill.loop.call(drop_side_channels())
        assert decode.pulls.pending() == {"d7"}  # still pulling
        _released_soon(prefill, "r7")  # the prefill let go of the blocks: vLLM may reuse them now
        wait(lambda: not decode.pulls.pending())
        assert decode.pulls.take_finished() == ({"d7"}, {"d7"}, {3, 5})  # not a load to use


def test_a_pull_aborted_mid_transfer_is_reported_only_once_its_pull_blocks_stopped(agents) -> None:
    """vLLM aborts a request while its ``pull_blocks`` moves bytes: the request is reported finished (failed)
    only once that pull is no longer in flight, so nothing of it lands in blocks vLLM hands out again."""
    with _slow_data_path(agents) as (prefill, _, decode, _):
        prefill.holds.add("r10", lease_s=60)
        decode.start_pull("d10", _remote(prefill, "r10", [6, 8]), [3, 5])

        async def pulling() -> int:
            return sum(link.kinds["pull"].in_flight for link in decode._dd.stats().links.values())

        wait(lambda: decode.loop.call(pulling()) == 1)
        decode.pulls.abort({"d10"})
        wait(lambda: not decode.pulls.pending())
        assert decode.pulls.take_finished() == ({"d10"}, {"d10"}, {3, 5})
        assert decode.loop.call(pulling()) == 0, "reported finished while its pull_blocks still moves bytes"


def test_a_second_request_for_the_same_prefill_request_does_not_free_it_under_a_pull(agents) -> None:
    """Two decode requests carrying the same ``kv_transfer_params`` (a proxy's retry, parallel sampling) share
    the decode's side channel: the one that ends first (here released unpulled: a prefix-cache hit or an abort
    before its load) must not free the prefill's blocks while the other still pulls them."""
    with _slow_data_path(agents) as (prefill, p_kv, decode, d_kv):
        prefill.holds.add("r8", lease_s=60)
        remote = _remote(prefill, "r8", [6, 8])
        decode.start_pull("d8", remote, [3, 5])
        wait(lambda: "r8" in prefill.holds.held and prefill.holds.held["r8"].owner is not None)
        decode.release_unpulled(remote)  # the other decode request holding the same params
        released: set[str] = set()
        deadline = time.monotonic() + 10
        while decode.pulls.pending():
            assert time.monotonic() < deadline, "the pull did not end"
            released |= prefill.holds.take_released()
            assert "r8" not in released, "the prefill freed the blocks while a pull still read them"
            time.sleep(0.01)
        assert decode.pulls.take_finished() == ({"d8"}, set(), set())
        _assert_block(d_kv, 3, p_kv, 6)
        _assert_block(d_kv, 5, p_kv, 8)
        _released_soon(prefill, "r8")  # once the last user said done


def test_a_request_that_pulled_first_does_not_free_the_blocks_another_still_pulls(agents) -> None:
    """Row 129's other case: of two decode requests carrying the same ``kv_transfer_params`` (parallel
    sampling), the one that pulled first says nothing that frees the prefill's blocks while the second still
    pulls them; they go once the second said done (added by audit, 2026-12-06: only "released unpulled" was
    tested)."""
    with _slow_data_path(agents) as (prefill, p_kv, decode, d_kv):
        prefill.holds.add("r9", lease_s=60)
        remote = _remote(prefill, "r9", [6, 8])
        decode.start_pull("d9a", remote, [3, 5])
        wait(lambda: "r9" in prefill.holds.held and prefill.holds.held["r9"].owner is not None)
        time.sleep(0.5)  # the second request's pull starts while the first's is under way: it ends later
        decode.start_pull("d9b", remote, [10, 12])
        finished: set[str] = set()
        released: set[str] = set()
        deadline = time.monotonic() + 15
        while decode.pulls.pending():
            assert time.monotonic() < deadline, "the pulls did not end"
            done, failed, _ = decode.pulls.take_finished()
            assert not failed, failed
            finished |= done
            released |= prefill.holds.take_released()
            if "d9b" not in finished:
                assert "r9" not in released, "the prefill freed the blocks while a pull still read them"
            time.sleep(0.01)
        finished |= decode.pulls.take_finished()[0]
        assert finished == {"d9a", "d9b"}
        for mine, theirs in ((3, 6), (5, 8), (10, 6), (12, 8)):
            _assert_block(d_kv, mine, p_kv, theirs)
        _released_soon(prefill, "r9")  # once the last user said done


def test_a_peer_that_never_reads_its_replies_stays_bounded_while_the_prefill_catches_up(agents) -> None:
    """Requests sent without reading the replies (a stuck or hostile decode): the prefill stops reading that
    connection once its replies back up, instead of queueing them in memory without bound. The replies queued
    are watched until the prefill stopped reading (its transport paused and the queue still for 0.5 s): one
    sample after a fixed sleep passed a prefill that read on, slowed by a loaded host (below 1 MiB at the
    sample, 17 MB a second later; found by audit)."""
    prefill, _ = agents(True)
    hello = encode_frame({"id": 1, "op": "hello"})
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(0.2)
        sock.connect(prefill.side_channel)
        # the kernel takes the connection and its bytes before the prefill's loop accepts it: on a loaded host the
        # flood below filled the buffers and stopped before the prefill held the connection (CI, 2026-12-07)
        deadline = time.monotonic() + 5
        while not prefill.loop.call(_conns(prefill)):
            assert time.monotonic() < deadline, "the prefill holds no connection of ours"
            time.sleep(0.01)
        sent, deadline = 0, time.monotonic() + 5
        while sent < 2_000_000 and time.monotonic() < deadline:
            try:
                sent += sock.send(hello * 512)
            except TimeoutError:
                break

        async def state() -> tuple[int, bool]:
            return (sum(w.transport.get_write_buffer_size() for w in prefill._conns),
                    any(w.transport.is_reading() for w in prefill._conns))

        assert prefill.loop.call(_conns(prefill)), "the prefill dropped our connection"
        last, still_since, deadline = -1, time.monotonic(), time.monotonic() + 4
        while time.monotonic() < deadline:
            queued, reading = prefill.loop.call(state())
            assert queued < 1 << 20, f"{queued} bytes of replies queued for a peer that reads none"
            if queued != last or reading:
                last, still_since = queued, time.monotonic()
            elif time.monotonic() - still_since > 0.5:
                break  # the prefill stopped reading us: nothing more can queue
            time.sleep(0.01)
        else:
            pytest.fail("the prefill went on reading a peer that reads none of its replies")


def test_a_pull_ends_within_the_hold_the_prefill_granted(agents) -> None:
    """The prefill keeps a claim ``hold_ms`` (its reply says how long: its own ``pull_timeout_ms`` plus
    ``claim_grace_s``); a decode configured with a longer ``pull_timeout_ms`` still stops pulling by then, so
    no pull reads blocks the prefill already gave back to vLLM and reports them loaded. The claim's reply comes
    late (a long way back): the hold is counted from when the claim left, not from its reply."""
    relay_loop = LoopThread("relay")
    relay = _SlowRelay(("127.0.0.1", 0))
    late = _LateReplies(("127.0.0.1", 0))
    try:
        prefill, _ = agents(True, transport="tcp", pull_timeout_ms=300, claim_grace_s=0.2)  # holds a claim 0.5 s
        relay.target, late.target = prefill._dd.listen_address, prefill.side_channel
        relay_loop.call(relay.__aenter__())
        relay_loop.call(late.__aenter__())
        prefill.options.advertise_data = "{}:{}".format(*relay.address)
        decode, d_kv = agents(False, transport="tcp")  # pull_timeout_ms 30 s
        prefill.holds.add("r9", lease_s=60)
        relay.rate = 4096.0  # the pull (6 KiB here) takes about 1.5 s
        remote = _remote(prefill, "r9", [6, 8])
        remote = dataclasses.replace(remote, host=late.address[0], port=late.address[1])
        started = time.monotonic()
        decode.start_pull("d9", remote, [3, 5])
        released_while_pulling = False
        hold_ends = 0.0  # when the prefill lets the claim go, set as it granted it
        deadline = time.monotonic() + 10
        while decode.pulls.pending():
            assert time.monotonic() < deadline, "the pull did not end"
            held = prefill.holds.held.get("r9")
            if not hold_ends and held is not None and held.owner is not None:
                hold_ends = held.deadline
            released_while_pulling |= "r9" in prefill.holds.take_released()
            time.sleep(0.01)
        took = time.monotonic() - started
        over = started + took - hold_ends
        assert over < 0.15, f"the pull ran {over:.2f} s past the hold the prefill granted"  # counted from its reply
        # the pull itself stopped near the hold's end, not at its own 30 s or its 1.5 s of bytes (the later held
        # check alone reported it failed: the test passed with the hold not applied to the pull; audit, 2026-12-07)
        assert took < 1.3, f"the pull ran {took:.2f} s, past its 0.5 s hold"
        finished, failed, _ = decode.pulls.take_finished()
        assert finished == {"d9"}
        assert failed == {"d9"} or not released_while_pulling, "a pull read blocks the prefill had freed"
        assert failed == {"d9"}  # 1.5 s of pulling does not fit in a 0.5 s hold
        after = {name: t.clone() for name, t in d_kv.items()}
        time.sleep(0.3)  # and nothing of it lands afterwards
        assert all(torch.equal(d_kv[name], after[name]) for name in d_kv)
    finally:
        relay.rate = None
        relay_loop.call(relay.__aexit__(None, None, None))
        relay_loop.call(late.__aexit__(None, None, None))
        relay_loop.stop()


async def _conns(agent) -> int:
    """How many side-channel connections ``agent`` serves (read on its loop)."""
    return len(agent._conns)


def test_a_refused_claim_of_a_long_request_id_does_not_fail_the_other_loads_on_the_side_channel(agents) -> None:
    """``kv_transfer_params`` naming an unknown request whose id is long (ids of up to 256 characters parse) are
    refused, and the load in flight on the same side channel goes on (found by a hunt, 2026-12-07: the refusal's
    text named the id and ran past the 256 characters a decode reads, so the decode dropped the side channel and
    the other load failed with it)."""
    with _slow_data_path(agents) as (prefill, p_kv, decode, d_kv):
        prefill.options.claim_wait_s = 0.0  # unknown requests are refused at once
        prefill.holds.add("r1", lease_s=60, blocks=[6, 8])
        decode.start_pull("d1", _remote(prefill, "r1", [6, 8]), [3, 5])  # about 1.5 s through the slow relay
        wait(lambda: prefill.holds.held.get("r1") is not None and prefill.holds.held["r1"].owner is not None)
        decode.start_pull("bogus", _remote(prefill, "x" * 200, [2]), [9])
        wait(lambda: not decode.pulls.pending())
        finished, failed, _ = decode.pulls.take_finished()
        assert finished == {"d1", "bogus"} and failed == {"bogus"}, failed
        _assert_block(d_kv, 3, p_kv, 6)
        _assert_block(d_kv, 5, p_kv, 8)
