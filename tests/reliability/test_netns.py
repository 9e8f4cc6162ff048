"""Two hosts on one kernel, and a NIXL plane that cannot be set up: the link still comes, in time, over TCP.

The network-namespace tests make two namespaces and a veth pair between them
(link-local 169.254/16 addresses and loopback only, nothing routed out of
them; root and ``ip netns`` needed, else skipped) and run a prompt in one and
a decoder in the other as processes (``_netns_peer.py``: forked, then
``setns`` into their namespace):

- TCP links across them and moves verified bytes;
- same-host detection: both ends have one boot id, but abstract unix sockets
  are per network namespace, so the share socket cannot be reached: the link
  falls back to TCP at once and moves verified bytes;
- ``aio.Transport=nixl``: UCX cannot reach a peer at a link-local address,
  so loading its NIXL metadata fails; ``link_clusters`` with its default
  3000 ms timeout still succeeds, both ends agree on TCP for the link, one
  warning on each end names the cluster and the reason, and a pull moves
  verified bytes (before: the exchange waited 10 s for a READY that never
  came, and the link failed with ``LLM_TIMEOUT``).

A NIXL metadata load that hangs (in one process, on loopback) is given up
when its share of the link timeout is spent: the link succeeds over TCP,
transfers run while the load still blocks the NIXL worker, and the load's
late completion turns nothing back to NIXL.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import uvloop

from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMStatusCode, Placement
from aio_datadist.testing import link_to, nixl_agent_of
from peers import DECODER_ID, NIXL_MISSING, PROMPT_ID, fill, linked_pair, same, snapshot

from _netns_peer import NetnsPeer

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("fork_server")]

S = LLMStatusCode
DEFAULT_TIMEOUT_S = 3.0  # link_clusters' default
needs_nixl = pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING)


# -- the namespaces ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Hosts:
    prompt_ns: str
    decoder_ns: str
    prompt_ip: str
    decoder_ip: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


def _kill_all_in(ns: str) -> None:
    """Anything still running in our namespace is one of ours: kill it."""
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), 9)


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    """Two network namespaces joined by a veth pair, deleted afterwards (with anything left in them)."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2)")
    tag = os.urandom(3).hex()
    prompt_ns, decoder_ns = f"aiod-p-{tag}", f"aiod-d-{tag}"
    subnet = random.randint(1, 254)
    made: list[str] = []
    try:
        for ns in (prompt_ns, decoder_ns):
            done = _ip("netns", "add", ns, check=False)
            if done.returncode != 0:
                pytest.skip(f"`ip netns add` failed: {done.stderr.strip()}")
            made.append(ns)
        # Made inside the namespaces, so the pair never exists in ours.
        _ip("-n", prompt_ns, "link", "add", f"aiop{tag}", "type", "veth", "peer", "name", f"aiod{tag}",
            "netns", decoder_ns)
        for ns, dev, address in ((prompt_ns, f"aiop{tag}", f"169.254.{subnet}.1"),
                                 (decoder_ns, f"aiod{tag}", f"169.254.{subnet}.2")):
            _ip("-n", ns, "addr", "add", f"{address}/16", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield Hosts(prompt_ns, decoder_ns, f"169.254.{subnet}.1", f"169.254.{subnet}.2")
    finally:
        for ns in made:
            _kill_all_in(ns)
            _ip("netns", "del", ns, check=False)
        assert not {prompt_ns, decoder_ns} & set(_ip("netns", "list", check=False).stdout.split())


# -- the two processes --------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def across(hosts: Hosts, transport: str):
    """A prompt in one namespace and a decoder linked to it from the other (both on this test's kind
    of event loop): yields both and the decoder's record; both are finalized and reaped on exit."""
    loop = "uvloop" if isinstance(asyncio.get_running_loop(), uvloop.Loop) else "asyncio"
    peers: list[NetnsPeer] = []
    try:
        peers.append(NetnsPeer(hosts.prompt_ns, "prompt", hosts.prompt_ip, transport, loop))
        peers.append(NetnsPeer(hosts.decoder_ns, "decoder", hosts.prompt_ip, transport, loop))
        prompt, decoder = peers
        decoder.send("link", (await prompt.recv())["port"])
        record = await decoder.recv()
        prompt.send("state")
        record["prompt"] = await prompt.recv()
        yield prompt, decoder, record
    finally:
        for peer in peers:
            await peer.stop()


def _linked_and_verified(record: dict[str, Any]) -> None:
    assert (record["status"], record["codes"]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS]), record
    assert record["link_s"] < DEFAULT_TIMEOUT_S, record
    assert record["verified"] and record["bytes"] == 4 * 16 * 8 * 256 * 2, record
    mine, theirs = record["links"][PROMPT_ID], record["prompt"]["links"][DECODER_ID]
    assert not mine["broken"] and not theirs["broken"], record
    assert not mine["local"] and not theirs["local"], record  # the bytes moved over TCP


# -- the tests ----------------------------------------------------------------------------------------


async def test_tcp_links_across_namespaces_and_moves_verified_bytes(hosts):
    async with across(hosts, "tcp") as (_prompt, _decoder, record):
        _linked_and_verified(record)
        assert record["shares"] == []  # aio.Transport=tcp never tries to share memory


async def test_a_same_kernel_peer_in_another_namespace_falls_back_from_sharing_to_tcp(hosts):
    async with across(hosts, "auto") as (_prompt, _decoder, record):
        _linked_and_verified(record)
        # Same boot id, so the share was tried; the abstract socket lives in the other namespace.
        assert len(record["shares"]) == 1 and record["shares"][0].startswith("failed:"), record
        assert record["link_s"] < DEFAULT_TIMEOUT_S / 2, record  # at once, not after a wait


@needs_nixl
async def test_nixl_that_cannot_reach_the_peer_falls_back_to_tcp_within_the_link_timeout(hosts):
    async with across(hosts, "nixl") as (prompt, decoder, record):
        _linked_and_verified(record)
        mine, theirs = record["links"][PROMPT_ID], record["prompt"]["links"][DECODER_ID]
        assert not mine["nixl"] and not theirs["nixl"], record  # both ends agree: TCP
        assert mine["declined"] and theirs["declined"], record
        assert record["posted"] == record["prompt"]["posted"] == 0, record
    for peer, other in ((decoder, PROMPT_ID), (prompt, DECODER_ID)):
        warned = peer.warnings("aio_datadist.nixl")
        assert len(warned) == 1, peer.log
        assert f"cluster {other}" in warned[0] and "TCP" in warned[0] and "NIXL" in warned[0], warned
        assert "metadata" in warned[0], warned  # the reason, in NIXL's words: its metadata did not load


HUNG_DESC = CacheDesc(4, (16, 4, 64), DataType.DT_FLOAT16, Placement.HOST)
HUNG_S = 2.5
HUNG_TIMEOUT_MS = 2000


@needs_nixl
@pytest.mark.loops_take_turns  # a hung NIXL load on its worker thread: one loop is enough (2.7 s each)
async def test_a_nixl_load_that_hangs_is_given_up_within_its_share_and_changes_nothing_later(caplog):
    caplog.set_level(logging.WARNING, logger="aio_datadist.nixl")
    nixl = {"transport": "nixl"}
    async with linked_pair(link=False, prompt_config=nixl, decoder_config=nixl) as pair:
        src = pair.pm.allocate_blocks_cache(HUNG_DESC, BlocksCacheKey(PROMPT_ID))
        want = fill(src, 5)
        dst = pair.dm.allocate_blocks_cache(HUNG_DESC)
        await nixl_agent_of(pair.prompt).registered(src)
        agent = nixl_agent_of(pair.prompt).engine.agent
        real_load = agent.add_remote_agent
        loaded = threading.Event()

        def hanging_load(metadata: bytes) -> str:  # the prompt's NIXL worker blocks in here
            time.sleep(HUNG_S)
            try:
                return real_load(metadata)
            finally:
                loaded.set()

        agent.add_remote_agent = hanging_load
        started = time.monotonic()
        status = await pair.decoder.link_clusters([pair.info], timeout=HUNG_TIMEOUT_MS)
        took = time.monotonic() - started
        assert status == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert took < HUNG_TIMEOUT_MS / 1000, took  # given up within its share, not at the caller's deadline
        assert not loaded.is_set()  # the link did not wait for the load
        blocks = list(range(16))
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, blocks, blocks)
        assert same(snapshot(dst), want)
        assert not loaded.is_set()  # the pull did not wait for the load either
        async with asyncio.timeout(HUNG_S + 5):
            while not loaded.is_set() or nixl_agent_of(pair.prompt).engine.in_flight():
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # the late load's record has been handled
        decoder_peer = link_to(pair.decoder, PROMPT_ID).nixl
        prompt_peer = link_to(pair.prompt, DECODER_ID).nixl
        for peer in (decoder_peer, prompt_peer):
            assert peer.declined and not peer.usable() and not peer.caches and not peer.prepared
        for t in dst.tensors:
            t.zero_()
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, blocks, blocks)
        assert same(snapshot(dst), want)
        assert nixl_agent_of(pair.decoder).engine.posted == nixl_agent_of(pair.prompt).engine.posted == 0
    warned = [r.getMessage() for r in caplog.records if r.name == "aio_datadist.nixl"]
    assert len(warned) == 2, warned  # one per end, naming the other; none when the agents closed
    assert sorted(f"cluster {c}" in w for w in warned for c in (PROMPT_ID, DECODER_ID)).count(True) == 2, warned
    assert any(f"cluster {PROMPT_ID}" in w and "did not finish within" in w for w in warned), warned


@needs_nixl
@pytest.mark.loops_take_turns  # (one loop: NIXL and its agent do not care which)
@pytest.mark.parametrize("hung", ["prompt", "decoder"])  # the decoder's own load: the peer's READY came in time
async def test_a_hung_nixl_load_is_given_up_once_half_of_the_link_timeout_is_spent(hung):
    nixl = {"transport": "nixl"}
    async with linked_pair(link=False, prompt_config=nixl, decoder_config=nixl) as pair:
        agent = nixl_agent_of(getattr(pair, hung)).engine.agent
        real_load = agent.add_remote_agent
        release = threading.Event()

        def hanging_load(metadata: bytes) -> str:  # blocks the prompt's NIXL worker until released
            release.wait(HUNG_S)
            return real_load(metadata)

        agent.add_remote_agent = hanging_load
        try:
            started = time.monotonic()
            status = await pair.decoder.link_clusters([pair.info], timeout=HUNG_TIMEOUT_MS)
            took = time.monotonic() - started
        finally:
            release.set()
        assert status == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        half = HUNG_TIMEOUT_MS / 2000
        assert half - 0.2 < took < half + 0.3, f"given up after {took:.2f} s, not half of {HUNG_TIMEOUT_MS} ms"
        assert link_to(pair.decoder, PROMPT_ID).nixl.declined and link_to(pair.prompt, DECODER_ID).nixl.declined


@needs_nixl
@pytest.mark.loops_take_turns  # (one loop: NIXL and its agent do not care which)
async def test_nixl_set_up_with_cache_lists_still_being_prepared_keeps_nixl_and_moves_verified_bytes(caplog):
    caplog.set_level(logging.INFO, logger="aio_datadist.nixl")
    nixl = {"transport": "nixl"}
    async with linked_pair(link=False, prompt_config=nixl, decoder_config=nixl) as pair:
        src = pair.pm.allocate_blocks_cache(HUNG_DESC, BlocksCacheKey(PROMPT_ID))
        want = fill(src, 6)
        dst = pair.dm.allocate_blocks_cache(HUNG_DESC, BlocksCacheKey(DECODER_ID))
        await nixl_agent_of(pair.prompt).registered(src)
        await nixl_agent_of(pair.decoder).registered(dst)
        agent = nixl_agent_of(pair.prompt).engine.agent
        real_prep = agent.prep_xfer_dlist
        prepared = threading.Event()

        def slow_prep(name: str, *args: Any, **kwargs: Any) -> Any:  # only the peer's lists are slow
            if name != "NIXL_INIT_AGENT":
                time.sleep(HUNG_S)
                prepared.set()
            return real_prep(name, *args, **kwargs)

        agent.prep_xfer_dlist = slow_prep
        status = await pair.decoder.link_clusters([pair.info], timeout=HUNG_TIMEOUT_MS)
        assert status == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert not prepared.is_set()
        decoder_peer = link_to(pair.decoder, PROMPT_ID).nixl
        prompt_peer = link_to(pair.prompt, DECODER_ID).nixl
        assert decoder_peer.usable() and prompt_peer.usable() and decoder_peer.declined is None
        # The prompt has not prepared the decoder's cache yet: its push takes TCP meanwhile.
        await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID), src, [0, 1], [2, 3])
        assert all(torch.equal(d[[2, 3]], w[[0, 1]]) for d, w in zip(dst.tensors, want))
        assert nixl_agent_of(pair.prompt).engine.posted == 0
        async with asyncio.timeout(HUNG_S + 5):
            while dst.cache_id not in decoder_peer.prepared:
                await asyncio.sleep(0.02)
        # Once it has, both directions move by NIXL.
        await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID), src, [4, 5], [6, 7])
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [8, 9], [10, 11])
        assert all(torch.equal(d[[6, 7, 10, 11]], w[[4, 5, 8, 9]]) for d, w in zip(dst.tensors, want))
        assert nixl_agent_of(pair.prompt).engine.posted == 1 and nixl_agent_of(pair.decoder).engine.posted == 1
    assert not [r for r in caplog.records if r.name == "aio_datadist.nixl" and r.levelno >= logging.WARNING]
