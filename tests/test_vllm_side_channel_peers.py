"""The vLLM connector's decode against side-channel peers that are not (or no longer) the prefill its request
names: another engine at the address in ``kv_transfer_params``, a connection that went silent on the way.

Agents on real loopback sockets, as in ``tests/test_vllm_connector_logic.py``; no vLLM needed.
"""

from __future__ import annotations

import asyncio
import enum
import importlib.util
import json
import sys
import time
import types
from typing import Any

import _vllm_agents
import pytest
import torch
from _vllm_agents import BLOCK_TOKENS, wait
from relay import Relay

from aio_datadist.integrations import vllm_agent
from aio_datadist.integrations.vllm_agent import LoopThread, _Peer
from aio_datadist.integrations.vllm_wire import (
    HEADER,
    RemotePrefill,
    encode_frame,
    parse_transfer_params,
    transfer_params,
)

agents = _vllm_agents.agents  # the fixture


def _remote(engine_id: str, side_channel: tuple[str, int], req: str, blocks: list[int]) -> RemotePrefill:
    host, port = side_channel
    return parse_transfer_params(transfer_params(engine_id=engine_id, request_id=req, host=host, port=port,
                                                 block_ids=blocks, num_tokens=len(blocks) * BLOCK_TOKENS))


def test_a_side_channel_that_answers_as_another_engine_is_not_pulled_from(agents) -> None:
    """``kv_transfer_params`` name engine ``engine-p`` but their address leads to engine ``engine-q`` (a prefill
    restarted on that port, a stale or misrouted proxy entry), which holds a request of the same id (a proxy
    that reuses its request ids on a retry): the decode must not claim it there, read its blocks as the
    request's, nor make ``engine-q`` free them under its own decode."""
    named, _ = agents(True)  # engine-p, the one the request names
    other, _ = agents(True)
    other.engine_id = "engine-q"
    decode, d_kv = agents(False)
    other.holds.add("r1", lease_s=60)
    named.holds.add("r1", lease_s=60)
    remote = _remote("engine-p", other.side_channel, "r1", [5, 9])  # engine-p's request, engine-q's address
    decode.start_pull("d1", remote, [2, 4])
    wait(lambda: not decode.pulls.pending(), 2.5)
    assert decode.pulls.take_finished() == ({"d1"}, {"d1"}, {2, 4})  # failed: vLLM recomputes
    assert not any(t.any() for t in d_kv.values())  # nothing of engine-q's landed
    decode.release_unpulled(remote)  # nor does a release free engine-q's request
    time.sleep(0.2)
    assert "r1" in other.holds.held and other.holds.held["r1"].owner is None
    assert not other.holds.take_released()
    # the same side channel still serves requests that name engine-q
    decode.start_pull("d2", _remote("engine-q", other.side_channel, "r1", [5]), [6])
    wait(lambda: not decode.pulls.pending(), 2.5)
    assert decode.pulls.take_finished() == ({"d2"}, set(), set())
    assert any(t[:, 6].any() for t in d_kv.values())
    assert torch.count_nonzero(torch.stack([t[:, [2, 4]] for t in d_kv.values()])) == 0


class _Blackhole(Relay):
    """Forwards side-channel connections; :meth:`drop_existing` makes the ones open then go silent both ways
    without a FIN or RST (a NAT or firewall that forgot the flow, a host gone, a partition), while new
    connections are forwarded as before."""

    def __init__(self, target: tuple[str, int]) -> None:
        super().__init__(target)
        self.dead: set[asyncio.StreamWriter] = set()

    def drop_existing(self) -> None:
        self.dead = set(self.writers)

    async def pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                if writer not in self.dead:  # a dead flow's bytes are lost on the way
                    writer.write(data)
                    await writer.drain()
            if writer not in self.dead:
                writer.close()
        except (ConnectionError, OSError):
            if writer not in self.dead:
                writer.transport.abort()


def test_a_side_channel_gone_silent_is_given_up_and_dialled_again(agents) -> None:
    """The decode's side channel to a prefill goes silent without a FIN or RST (here a relay stops forwarding
    that connection; a new one gets through), while the KV link stays up: the load that finds it silent
    fails within its bound, and the decode gives the connection up and dials again, so the prefill is told to
    free that load's blocks and the next load succeeds. Before, the silent connection stayed in use: every
    later claim to that prefill timed out in turn (until the kernel gave the socket up, minutes later)."""
    relay_loop = LoopThread("relay")
    prefill, p_kv = agents(True)
    relay = _Blackhole(prefill.side_channel)
    try:
        relay_loop.call(relay.__aenter__())
        # 800 ms: the redial after the silent connection (connect, hello, link, claim) has each step within it;
        # at 400 ms one step of it ran out under a full run's load once and the release was never sent
        decode, d_kv = agents(False, link_timeout_ms=800)
        for req in ("r1", "r2", "r3"):
            prefill.holds.add(req, lease_s=60)
        decode.start_pull("d1", _remote("engine-p", relay.address, "r1", [5]), [2])
        wait(lambda: not decode.pulls.pending(), 2.5)
        assert decode.pulls.take_finished() == ({"d1"}, set(), set())
        wait(lambda: prefill.holds.take_released() == {"r1"}, 2.5)

        relay.drop_existing()
        started = time.monotonic()
        decode.start_pull("d2", _remote("engine-p", relay.address, "r2", [9]), [4])
        wait(lambda: not decode.pulls.pending(), 4.0)
        assert decode.pulls.take_finished() == ({"d2"}, {"d2"}, {4})  # its claim went unanswered
        assert time.monotonic() - started < 2.5  # its claim's and a probe's link_timeout_ms (1.6 s) at most
        # told on a new connection to free r2 (5 s: under a full run's load the redial took over 2 s once)
        wait(lambda: prefill.holds.take_released() == {"r2"}, 5.0)

        decode.start_pull("d3", _remote("engine-p", relay.address, "r3", [11]), [6])
        wait(lambda: not decode.pulls.pending(), 2.5)
        assert decode.pulls.take_finished() == ({"d3"}, set(), set())
        for name in p_kv:
            assert torch.equal(d_kv[name][:, 6], p_kv[name][:, 11])
            assert not d_kv[name][:, 4].any()
    finally:
        relay_loop.call(relay.__aexit__(None, None, None))
        relay_loop.stop()


@pytest.mark.parametrize(("link_timeout_ms", "probe_s", "bound_s"), [(300, None, 1.15), (1000, 0.05, 1.5)])
def test_a_silent_side_channel_is_given_up_within_twice_a_short_link_timeout(agents, monkeypatch, link_timeout_ms,
                                                                             probe_s, bound_s) -> None:
    """The bound of giving a silent side channel up when ``link_timeout_ms`` is under ``PROBE_TIMEOUT_S``: the
    ``hello`` sent after the unanswered claim waits ``link_timeout_ms`` at most, so the load fails within about
    twice it (600 ms here; ``link_timeout_ms`` + ``PROBE_TIMEOUT_S`` would be 1.3 s) and the connection is given up.
    The other side of the bound (``probe_s``: ``PROBE_TIMEOUT_S`` made shorter than ``link_timeout_ms``): the
    ``hello`` waits ``PROBE_TIMEOUT_S``, not another ``link_timeout_ms`` (1.05 s here, not 2 s)."""
    if probe_s is not None:
        monkeypatch.setattr(vllm_agent, "PROBE_TIMEOUT_S", probe_s)
    relay_loop = LoopThread("relay")
    prefill, _ = agents(True)
    relay = _Blackhole(prefill.side_channel)
    try:
        relay_loop.call(relay.__aenter__())
        decode, _ = agents(False, link_timeout_ms=link_timeout_ms)
        for req in ("r1", "r2"):
            prefill.holds.add(req, lease_s=60)
        decode.start_pull("d1", _remote("engine-p", relay.address, "r1", [5]), [2])
        wait(lambda: not decode.pulls.pending(), 2.5)
        assert decode.pulls.take_finished() == ({"d1"}, set(), set())
        peer = decode._peers[relay.address].result()
        # d1's done answered and its reply read: a late reply would count as hearing from the channel after the
        # claim below went out (one run in ten under load), and no hello would be sent
        wait(lambda: "r1" not in prefill.holds.held and not peer.replies, 2.5)
        relay.drop_existing()
        started = time.monotonic()
        decode.start_pull("d2", _remote("engine-p", relay.address, "r2", [9]), [4])
        wait(lambda: not decode.pulls.pending(), 2.5)
        elapsed = time.monotonic() - started
        assert decode.pulls.take_finished() == ({"d2"}, {"d2"}, {4})
        wait(lambda: peer.broken is not None, 1.0)  # given up
        assert elapsed < bound_s, f"the silent side channel's load failed after {elapsed:.2f} s"
    finally:
        relay_loop.call(relay.__aexit__(None, None, None))
        relay_loop.stop()


def test_a_claim_that_waits_long_on_a_live_prefill_keeps_the_side_channel(agents) -> None:
    """The other side of giving a silent side channel up: a claim the prefill keeps past the decode's
    ``link_timeout_ms`` (vLLM has not named its request yet, ``claim_wait_s``) fails that load, but the prefill
    answers the ``hello`` sent then, so the connection (and the claims of other pulls on it) stays."""
    prefill, p_kv = agents(True, claim_wait_s=0.6)
    decode, d_kv = agents(False, link_timeout_ms=300)
    decode.start_pull("d1", _remote("engine-p", prefill.side_channel, "later", [3]), [1])
    wait(lambda: not decode.pulls.pending(), 2.5)
    assert decode.pulls.take_finished() == ({"d1"}, {"d1"}, {1})
    peer = decode._peers[prefill.side_channel].result()
    assert peer.broken is None
    prefill.holds.add("r1", lease_s=60)
    decode.start_pull("d2", _remote("engine-p", prefill.side_channel, "r1", [5]), [2])
    wait(lambda: not decode.pulls.pending(), 2.5)
    assert decode.pulls.take_finished() == ({"d2"}, set(), set())
    assert decode._peers[prefill.side_channel].result() is peer and peer.broken is None
    for name in p_kv:
        assert torch.equal(d_kv[name][:, 2], p_kv[name][:, 5])


def test_params_naming_other_blocks_than_the_request_holds_are_not_pulled(agents) -> None:
    """``kv_transfer_params`` are request data: a client that reaches the decode's API can send its own, naming
    a request it had the prefill hold (its own prompt) but other block ids (another user's prompt, in use
    there), as can a stale or corrupt copy. The claim of the request succeeds, so the decode would read those
    blocks as the request's; the claim's reply says which blocks the request holds (a digest) and a decode
    whose params differ pulls nothing, fails the load and says ``done``."""
    prefill, p_kv = agents(True)
    decode, d_kv = agents(False)
    prefill.holds.add("mine", lease_s=60, blocks=[5, 9])  # the client's own request
    forged = _remote("engine-p", prefill.side_channel, "mine", [3, 11])  # blocks of other requests
    decode.start_pull("d1", forged, [2, 4])
    wait(lambda: not decode.pulls.pending(), 2.5)
    assert decode.pulls.take_finished() == ({"d1"}, {"d1"}, {2, 4})
    assert not any(t.any() for t in d_kv.values())
    wait(lambda: prefill.holds.take_released() == {"mine"}, 2.0)  # the failed load let the request go
    # the params the prefill returned pull as before (the tail, after a local prefix-cache hit)
    prefill.holds.add("r2", lease_s=60, blocks=[6, 8])
    decode.start_pull("d2", _remote("engine-p", prefill.side_channel, "r2", [6, 8]), [7])
    wait(lambda: not decode.pulls.pending(), 2.5)
    assert decode.pulls.take_finished() == ({"d2"}, set(), set())
    for name in p_kv:
        assert torch.equal(d_kv[name][:, 7], p_kv[name][:, 8])


def _connector_without_vllm(monkeypatch) -> Any:
    """``aio_datadist.integrations.vllm`` loaded under a name of its own against stand-ins for the few vLLM names
    it imports (no vLLM here): its halves' glue, driven by hand."""
    base = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.base")
    base.KVConnectorBase_V1 = base.KVConnectorHandshakeMetadata = base.KVConnectorMetadata = type("Base", (), {})
    base.KVConnectorRole = enum.Enum("KVConnectorRole", "SCHEDULER WORKER")
    base.KVConnectorTransferResults = dict
    request = types.ModuleType("vllm.v1.request")
    request.RequestStatus = enum.Enum("RequestStatus", "FINISHED_STOPPED FINISHED_LENGTH_CAPPED FINISHED_ABORTED")
    for name in ("vllm", "vllm.distributed", "vllm.distributed.kv_transfer",
                 "vllm.distributed.kv_transfer.kv_connector", "vllm.distributed.kv_transfer.kv_connector.v1",
                 "vllm.v1"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, base.__name__, base)
    monkeypatch.setitem(sys.modules, request.__name__, request)
    path = vllm_agent.__file__[:-len("_agent.py")] + ".py"  # integrations/vllm.py
    spec = importlib.util.spec_from_file_location("_vllm_connector_glue", path)
    glue = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, glue)
    spec.loader.exec_module(glue)
    return glue


def test_the_connector_holds_a_finished_prefill_with_the_digest_of_the_blocks_it_returned(agents,
                                                                                           monkeypatch) -> None:
    """Row 142 through the connector's glue (the test above adds its holds by hand): the scheduler half's
    ``request_finished`` and the worker half's ``start_load_kv`` hold the request with the digest of the block
    ids the returned params name, so params naming other blocks fail the load and the returned ones load."""
    glue = _connector_without_vllm(monkeypatch)
    prefill, p_kv = agents(True)
    decode, d_kv = agents(False)
    connector = object.__new__(glue.AioDatadistConnector)  # both halves at once, without vLLM's __init__
    connector.options, connector.engine_id, connector.agent = prefill.options, "engine-p", prefill
    connector._side_channel, connector._meta = prefill.side_channel, glue.AioDatadistMetadata()
    returned = {}
    for req, blocks in (("mine", [5, 9]), ("r2", [6, 8])):
        finished = types.SimpleNamespace(request_id=req, kv_transfer_params={"do_remote_decode": True},
                                         status=sys.modules["vllm.v1.request"].RequestStatus.FINISHED_STOPPED,
                                         num_computed_tokens=len(blocks) * BLOCK_TOKENS)
        held, returned[req] = connector.request_finished(finished, blocks)
        assert held
    meta = connector.build_connector_meta(None)
    connector._get_connector_metadata = lambda: meta
    connector.start_load_kv(None)
    decode.start_pull("d1", _remote("engine-p", prefill.side_channel, "mine", [3, 11]), [2, 4])  # forged blocks
    wait(lambda: not decode.pulls.pending(), 2.5)
    assert decode.pulls.take_finished() == ({"d1"}, {"d1"}, {2, 4})
    assert not any(t.any() for t in d_kv.values())
    decode.start_pull("d2", parse_transfer_params(returned["r2"]), [7, 1])  # the params the prefill returned
    wait(lambda: not decode.pulls.pending(), 2.5)
    assert decode.pulls.take_finished() == ({"d2"}, set(), set())
    for name in p_kv:
        assert torch.equal(d_kv[name][:, [7, 1]], p_kv[name][:, [6, 8]])


def test_a_done_the_prefill_cannot_honour_does_not_end_the_side_channel(agents) -> None:
    """A decode's ``done`` for a claim whose hold ran out at the prefill just before (a pull that timed out on its
    hold, or whose ``held`` check failed) is answered ``ok: false``. Sent under id 0, that answer read as the
    prefill closing the side channel (the full-table refusal's frame): the decode tore the connection down and
    every other load on it failed (found by the second review of row 328). A done has an id of its own now."""
    prefill, _ = agents(True, shared_secret="done-secret")
    decode, _ = agents(False, shared_secret="done-secret")
    prefill.holds.add("r1", lease_s=60)
    r1 = _remote("engine-p", prefill.side_channel, "r1", [5])
    r2 = _remote("engine-p", prefill.side_channel, "r2", [6])

    async def claim_r1() -> Any:
        peer = await decode._peer_of(r1)
        assert (await peer.request("claim", 5, req="r1"))["ok"]
        return peer

    peer = decode.loop.call(claim_r1(), 10)
    decode.start_pull("d2", r2, [3])  # another load on the side channel: its claim waits for vLLM to name r2
    wait(lambda: any(served.waiting for served in prefill._established.values()), 5)
    with prefill.holds._lock:  # r1's hold runs out just before the decode's done
        prefill.holds._held["r1"].deadline = 0
    prefill.holds.expire()

    async def done_r1() -> None:
        peer.use("r1")
        peer.unuse("r1", True)  # what a claimed pull's end does
        await asyncio.sleep(0.5)  # the prefill's answer is read

    decode.loop.call(done_r1(), 10)
    prefill.holds.add("r2", lease_s=60)
    wait(lambda: "d2" not in decode.pulls.pending(), 10)
    finished, failed, _ = decode.pulls.take_finished()
    assert peer.broken is None, f"side channel torn down: {peer.broken!r}"
    assert "d2" in finished and "d2" not in failed, (finished, failed)


def test_a_late_reply_to_an_earlier_request_does_not_pass_for_the_channel_alive() -> None:
    """A claim times out on a side channel gone silent just after the prefill answered an earlier request, whose
    reply is read only after the claim left: that reply says nothing of the claim, so the decode still asks a
    ``hello`` and, unanswered, gives the channel up (before, any frame read after the claim left passed for a
    live channel: no hello, and the silent channel was found one request later; found by review)."""

    class Writer:  # the decode's end of the side channel: what it sends is kept, nothing reaches a prefill
        def __init__(self) -> None:
            self.ops: list[str] = []
            self.transport = self
            self.aborted = False

        def write(self, data: bytes) -> None:
            self.ops.append(json.loads(data[HEADER.size:])["op"])

        def abort(self) -> None:
            self.aborted = True

        def close(self) -> None:
            pass

        def get_extra_info(self, name: str) -> Any:
            return None

    async def main() -> None:
        reader, writer = asyncio.StreamReader(), Writer()
        peer = _Peer(reader, writer)  # type: ignore[arg-type]
        task = asyncio.ensure_future(peer.read_replies())
        try:
            first = asyncio.ensure_future(peer.request("held", 5.0, req="r1"))
            await asyncio.sleep(0)
            claim = asyncio.ensure_future(peer.request("claim", 0.2, req="r2"))
            await asyncio.sleep(0)
            reader.feed_data(encode_frame({"id": 1, "ok": True}))  # the earlier request's reply, read late
            assert (await first)["ok"]
            with pytest.raises(TimeoutError):
                await claim
            assert writer.ops == ["held", "claim", "hello"], writer.ops
            assert peer.broken is not None and writer.aborted
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
