"""Device caches on NIXL links: registered as VRAM where the agent's backend can, staged otherwise.

No GPU here: the decision (:func:`vram_off`), the VRAM registration call
sequence and the ``OFFER_VRAM`` exchange run against a stand-in NIXL agent
that records its calls; the host backend's device caches (``aio.DeviceType=
host``) over a real NIXL link take the staging plane and say why. The
ordering of device caches on the NIXL plane (the fence before a peer's READ
is answered and before our WRITE is posted) runs on CPU with the host
backend's caches registered as what they are, host memory (``DRAM``), in
place of VRAM: everything but the memory type is the VRAM path. A real VRAM
pull between two processes is ``tests/gpu/test_gpu_nixl.py``.
"""

from __future__ import annotations

import array
import asyncio
import logging
import types

import numpy as np
import pytest
import torch
from peers import DECODER_ID, NIXL_MISSING, PROMPT_ID, cluster_info, fill, linked_pair, snapshot

from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMException, LLMStatusCode, Placement
from aio_datadist.testing import link_to, nixl_agent_of, runtime_of
from aio_datadist.transport import nixl, nixl_agent, nixl_plane
from aio_datadist.wire import NixlRecord, ProtocolError

needs_nixl = pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING)
HOST_NIXL = {"device_type": "host", "transport": "nixl"}
BLOCKS = CacheDesc(4, (6, 3, 512), DataType.DT_FLOAT16, Placement.DEVICE)
UCX = {"UCX": ["DRAM_SEG", "VRAM_SEG"]}


def eq(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# -- the decision and the calls, against a stand-in agent ------------------------------------------------


def test_only_cuda_device_caches_with_a_vram_backend_are_registered_as_vram():
    assert nixl_agent.vram_off(None, UCX) is None  # no device backend: nothing to decide
    assert nixl_agent.vram_off("cuda", UCX) is None
    assert nixl_agent.vram_off("cuda", {"UCX": ["DRAM", "VRAM"]}) is None
    host = nixl_agent.vram_off("host", UCX)
    assert host is not None and "host memory" in host and "VRAM" in host
    assert "npu" in (nixl_agent.vram_off("npu", UCX) or "")
    none = nixl_agent.vram_off("cuda", {"UCX": ["DRAM_SEG"], "POSIX": ["FILE_SEG"]})
    assert none is not None and "UCX: DRAM_SEG" in none and "POSIX: FILE_SEG" in none
    assert "no backend" in (nixl_agent.vram_off("cuda", {}) or "")


class _Recorder:
    """A stand-in NIXL agent: records what it is asked, returns tokens."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def register_memory(self, regs, mem):
        self.calls.append(("register_memory", list(regs), mem))
        return "regs"

    def prep_xfer_dlist(self, name, descs, mem):
        self.calls.append(("prep_xfer_dlist", name, np.array(descs), mem))
        return types.SimpleNamespace(release=lambda: None)

    def deregister_memory(self, regs):
        self.calls.append(("deregister_memory", regs))

    def get_agent_metadata(self):
        return b"meta"

    def add_remote_agent(self, metadata):
        self.calls.append(("add_remote_agent", metadata))
        return b"peer"

    def remove_remote_agent(self, name):
        self.calls.append(("remove_remote_agent", name))


def _cache(on_device: bool, device: torch.device, bases=(0x10000, 0x10000 + 6 * 1536)):
    lay = types.SimpleNamespace(bases=list(bases), rows=6, row_bytes=1536, tensor_bytes=6 * 1536, num_tensors=2)
    return types.SimpleNamespace(on_device=on_device, device=device, region=None, layout=lay, cache_id=7)


def test_a_cuda_device_cache_is_registered_as_vram_on_its_gpu():
    mem, device, work = nixl_agent.registration(_cache(True, torch.device("cuda", 3)), None)
    assert (mem, device) == ("VRAM", 3)
    agent = _Recorder()
    regs_out, dlist, metadata = work(agent)
    assert regs_out == "regs" and metadata == b"meta" and dlist is not None
    (reg, regs, reg_mem), (prep, name, descs, prep_mem) = agent.calls
    assert reg == "register_memory" and reg_mem == "VRAM"
    assert regs == [(0x10000, 2 * 6 * 1536, 3, "")]  # the two tensors are neighbours: one extent
    assert prep == "prep_xfer_dlist" and name == "NIXL_INIT_AGENT" and prep_mem == "VRAM"
    assert descs.shape == (12, 3) and set(descs[:, 2]) == {3} and set(descs[:, 1]) == {1536}
    assert descs[7, 0] == 0x10000 + 6 * 1536 + 1536  # tensor 1, row 1


def test_host_caches_are_dram_and_device_caches_nixl_cannot_take_are_not_registered():
    mem, device, work = nixl_agent.registration(_cache(False, torch.device("cpu")), "whatever")
    agent = _Recorder()
    work(agent)
    assert (mem, device) == ("DRAM", 0) and agent.calls[0][2] == "DRAM" and set(agent.calls[1][2][:, 2]) == {0}
    assert nixl_agent.registration(_cache(True, torch.device("cpu")), "the device caches are host memory") is None


def test_a_failed_vram_list_deregisters_what_it_registered():
    agent = _Recorder()

    def refuse(*args):
        raise RuntimeError("NIXL_ERR_NOT_SUPPORTED")

    agent.prep_xfer_dlist = refuse
    _, _, work = nixl_agent.registration(_cache(True, torch.device("cuda", 0)), None)
    with pytest.raises(RuntimeError):
        work(agent)
    assert [c[0] for c in agent.calls] == ["register_memory", "deregister_memory"]


class _StandInAgent:
    """What a NixlPeer uses of its NixlAgent; engine work runs at once on a recording stand-in."""

    def __init__(self) -> None:
        self.nixl = _Recorder()
        self.engine = types.SimpleNamespace(release_when_idle=lambda uses, fn: fn(self.nixl))
        self.peers: set = set()
        self.local: dict = {}
        self.name = b"ours"
        self.metadata = b"our-meta"
        self.exposed = True
        self.ledger = None  # no reads without asking here

    def granted(self, cache_id):
        return None

    def serve_begin(self, cache_id):
        pass

    def serve_end(self, cache_id):
        pass

    def start(self, work, what, keepalive=None, discard=None):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(work(self.nixl))
        return fut

    def offered(self, cache):
        return cache.cache_id in self.local


@pytest.mark.asyncio
async def test_a_vram_offer_carries_the_gpu_and_is_prepared_as_vram_on_it():
    agent = _StandInAgent()
    sent: list[tuple] = []
    peer = nixl.NixlPeer(agent, lambda *record: sent.append(record), 9, bytes(8))
    peer.on_message(NixlRecord(kind=nixl.HELLO, cache_id=0, count=0, row_bytes=0, rows=(), blob=b"peer\0their-meta"))
    await asyncio.sleep(0)
    assert sent[-1][0] == nixl.READY
    bases = (0x20000, 0x30000)
    peer.on_message(NixlRecord(kind=nixl.OFFER_VRAM, cache_id=5, count=6, row_bytes=1536, rows=bases,
                               blob=nixl.VRAM_DEVICE.pack(2) + b"their-meta"))
    await asyncio.sleep(0)
    assert ("add_remote_agent", b"their-meta") in agent.nixl.calls
    _, name, descs, mem = agent.nixl.calls[-1]
    assert (name, mem) == ("peer", "VRAM") and set(descs[:, 2]) == {2} and descs.shape == (12, 3)
    assert sent[-1][:2] == (nixl.PREPARED, 5) and 5 in peer.caches
    with pytest.raises(ProtocolError):  # no room for the GPU id
        peer.on_message(NixlRecord(kind=nixl.OFFER_VRAM, cache_id=6, count=6, row_bytes=1536, rows=bases,
                                   blob=b"\0\0"))
    # Our VRAM cache is offered with its GPU id ahead of our metadata.
    cache = _cache(True, torch.device("cuda", 1))
    entry = nixl_agent.LocalCache(cache, "regs", "dlist", "VRAM", 1)
    peer.offer(entry)
    kind, cache_id, rows, row_bytes, offered_bases, blob = sent[-1]
    assert (kind, cache_id, rows, row_bytes) == (nixl.OFFER_VRAM, 7, 6, 1536)
    assert offered_bases == tuple(cache.layout.bases) and blob == nixl.VRAM_DEVICE.pack(1) + b"our-meta"
    # The peer's READY twice in one read, before the first's set-up ended: the second is a protocol error too
    # (row 284; found by audit: the row's test sent it to a link long ready).
    ready = NixlRecord(kind=nixl.READY, cache_id=0, count=0, row_bytes=0, rows=(), blob=b"")
    peer.on_message(ready)
    with pytest.raises(ProtocolError):
        peer.on_message(ready)
    peer.close()
    assert agent.nixl.calls[-1] == ("remove_remote_agent", "peer")


# -- real endpoints over a real NIXL link ------------------------------------------------------------------


async def _served(dd, other: int, kind: str) -> None:
    for _ in range(200):  # the owner counts a pull once the requester's DONE reached it
        if dd.stats().links[other].kinds[kind].transfers:
            return
        await asyncio.sleep(0.01)


@needs_nixl
@pytest.mark.asyncio
async def test_host_backend_device_caches_take_the_staging_plane_over_nixl_and_the_link_says_why(caplog):
    caplog.set_level(logging.INFO, logger="aio_datadist.nixl")
    async with linked_pair(prompt_config=HOST_NIXL, decoder_config=HOST_NIXL) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        values = fill(src, 3)
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        assert nixl_agent_of(pair.decoder).vram_off is not None
        for _ in range(2):
            await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, [5, 0], [1, 4])
        for d, v in zip(dst.tensors, values, strict=True):
            assert eq(d[1], v[5]) and eq(d[4], v[0])
        assert nixl_agent_of(pair.decoder).engine.posted == 0 == nixl_agent_of(pair.prompt).engine.posted
        await _served(pair.prompt, DECODER_ID, "served_pull")
        for dd, other, kind in ((pair.decoder, PROMPT_ID, "pull"), (pair.prompt, DECODER_ID, "served_pull")):
            stats = dd.stats().links[other]
            assert stats.transport == "nixl" and stats.kinds[kind].transport == "tcp"
            assert "host memory" in stats.nixl_vram_off and "VRAM" in stats.nixl_vram_off
        said = [r for r in caplog.records if "take the staging plane, not NIXL" in r.getMessage()]
        assert len(said) == 2, [r.getMessage() for r in said]  # once per link and end, not per transfer


@pytest.fixture
def host_as_dram(monkeypatch):
    """The host backend's device caches registered with NIXL as what they are, host memory: the NIXL plane
    then carries device caches on CPU, fences included (the VRAM path but for the memory type)."""
    real = nixl_agent.registration

    def as_dram(cache, off):
        if not cache.on_device:
            return real(cache, off)
        return real(types.SimpleNamespace(on_device=False, region=None, layout=cache.layout), None)

    monkeypatch.setattr(nixl_agent, "vram_off", lambda kind, mem_types: None)
    monkeypatch.setattr(nixl_agent, "registration", as_dram)


def _write_behind_gate(dd, cache, values, row: int):
    """Enqueue on ``dd``'s current stream, behind a closed gate, copies writing ``values``' row ``row`` into
    ``cache``'s row ``row``: the rows are final on the device once the gate opens."""
    stream = runtime_of(dd).devices.current_stream()
    gate = stream.gate()
    staged = [v.clone() for v in values]  # kept alive by the caller until the stream is past the gate
    for t, s in zip(cache.tensors, staged, strict=True):
        d8, s8 = t[row].view(torch.uint8), s[row].contiguous().view(torch.uint8)
        stream.enqueue_copies(array.array("Q", [d8.data_ptr()]), array.array("Q", [s8.data_ptr()]),
                              array.array("Q", [d8.numel()]))
    return gate, staged


async def _prepared(owner, peer_id: int, cache) -> None:
    peer = link_to(owner, peer_id).nixl
    async with asyncio.timeout(5):
        while cache.cache_id not in peer.prepared:
            await asyncio.sleep(0.005)


@needs_nixl
@pytest.mark.asyncio
@pytest.mark.usefixtures("host_as_dram")
async def test_a_nixl_read_of_a_device_cache_is_answered_once_the_owners_stream_made_the_rows_final():
    async with linked_pair(prompt_config=HOST_NIXL, decoder_config=HOST_NIXL) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        old = fill(src, 1)
        final = [v + 1 for v in old]
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        await _prepared(pair.prompt, DECODER_ID, src)
        posted = nixl_agent_of(pair.decoder).engine.posted
        gate, staged = _write_behind_gate(pair.prompt, src, final, 2)
        asyncio.get_running_loop().call_later(0.3, gate.open)
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, [2], [4])
        assert all(eq(d[4], f[2]) for d, f in zip(dst.tensors, final, strict=True))  # not the rows before
        assert nixl_agent_of(pair.decoder).engine.posted == posted + 1
        stats = pair.decoder.stats().links[PROMPT_ID]
        assert stats.kinds["pull"].transport == "nixl" and stats.nixl_vram_off is None
        del staged


@needs_nixl
@pytest.mark.asyncio
@pytest.mark.usefixtures("host_as_dram")
async def test_a_nixl_read_into_a_device_cache_waits_for_the_pullers_stream():
    """The requester of a READ fences too: a copy its own stream had enqueued into the destination row lands
    before NIXL's bytes, not over them (a pull that skipped its fence passed the tests above: audit, 2026-12-07)."""
    async with linked_pair(prompt_config=HOST_NIXL, decoder_config=HOST_NIXL) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        values = fill(src, 5)
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        await _prepared(pair.prompt, DECODER_ID, src)
        gate, staged = _write_behind_gate(pair.decoder, dst, [torch.full_like(t, 9) for t in dst.tensors], 4)
        opened: list[bool] = []
        asyncio.get_running_loop().call_later(0.3, lambda: (gate.open(), opened.append(True)))
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, [2], [4])
        assert opened, "the pull returned before its stream's earlier copy into the row ran (it lands over the pull)"
        assert all(eq(d[4], v[2]) for d, v in zip(dst.tensors, values, strict=True))
        assert pair.decoder.stats().links[PROMPT_ID].kinds["pull"].transport == "nixl"
        del staged


@needs_nixl
@pytest.mark.asyncio
@pytest.mark.usefixtures("host_as_dram")
async def test_a_nixl_write_from_a_device_cache_waits_for_the_pushers_stream_and_has_landed_on_return():
    """Both ends fence: the pusher's stream makes its rows final, and the owner answers only once its own stream's
    earlier copy into the row ran, so NIXL's bytes land over it (the owner's fence: it passed with the owner
    fencing READs only; audit, 2026-12-07)."""
    async with linked_pair(prompt_config=HOST_NIXL, decoder_config=HOST_NIXL) as pair:
        dst = pair.dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID, 0))
        src = pair.pm.allocate_blocks_cache(BLOCKS)
        final = [v + 2 for v in fill(src, 4)]
        await _prepared(pair.decoder, PROMPT_ID, dst)
        owner_gate, owner_staged = _write_behind_gate(pair.decoder, dst, [torch.full_like(t, 9) for t in dst.tensors],
                                                      5)
        before = snapshot(dst)
        gate, staged = _write_behind_gate(pair.prompt, src, final, 1)
        opened: list[bool] = []
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, gate.open)
        loop.call_later(0.5, lambda: (owner_gate.open(), opened.append(True)))
        await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID, 0), src, [1], [5])
        assert opened, "the owner answered the WRITE before its stream's earlier copy into the row ran"
        for d, f, b in zip(dst.tensors, final, before, strict=True):  # every byte there on return
            assert eq(d[5], f[1]) and eq(d[:5], b[:5])
        assert pair.prompt.stats().links[DECODER_ID].kinds["push"].transport == "nixl"
        del staged, owner_staged


@needs_nixl
@pytest.mark.asyncio
@pytest.mark.usefixtures("host_as_dram")
@pytest.mark.parametrize("kind", ["pull", "push"])
async def test_a_withdrawal_read_while_we_fence_our_device_cache_reads_a_cache_that_went(monkeypatch, kind):
    """The owner answered naming its cache, and its WITHDRAW (it released the cache) is read while we fence our
    device cache before the READ or WRITE: the transfer fails ``LLM_KV_CACHE_NOT_EXIST`` (row 336), nothing is
    posted, and the link goes on. The first form of row 336 looked only before the fence: ``LLM_LINK_FAILED``
    (found by its review)."""
    async with linked_pair(prompt_config=HOST_NIXL, decoder_config=HOST_NIXL) as pair:
        if kind == "pull":
            owner, owner_id, mover, mover_id = pair.prompt, PROMPT_ID, pair.decoder, DECODER_ID
            there = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
            here = pair.dm.allocate_blocks_cache(BLOCKS)
        else:
            owner, owner_id, mover, mover_id = pair.decoder, DECODER_ID, pair.prompt, PROMPT_ID
            there = pair.dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID, 0))
            here = pair.pm.allocate_blocks_cache(BLOCKS)
        fill(there, 1)
        fill(here, 2)
        await _prepared(owner, mover_id, there)
        peer = link_to(mover, owner_id).nixl
        posted = nixl_agent_of(mover).engine.posted
        real = nixl_plane.fence

        async def withdrawn_meanwhile(rt, timeout_ms, what):
            peer.caches.pop(there.cache_id, None)  # as the owner's WITHDRAW, read while we fence, does
            await real(rt, timeout_ms, what)

        monkeypatch.setattr(nixl_plane, "fence", withdrawn_meanwhile)
        with pytest.raises(LLMException) as info:
            if kind == "pull":
                await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), here, [2], [4])
            else:
                await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID, 0), here, [2], [4])
        assert info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, info.value
        assert nixl_agent_of(mover).engine.posted == posted and link_to(mover, owner_id).broken is None


@needs_nixl
@pytest.mark.asyncio
@pytest.mark.usefixtures("host_as_dram")
@pytest.mark.parametrize("who", ["we", "peer"])
async def test_an_unlink_while_we_fence_our_device_cache_reads_unlinked(monkeypatch, who):
    """The link is unlinked, by us or by the owner, while we fence our device cache before the READ: the pull
    fails ``LLM_NOT_YET_LINK``, as what an unlink cuts does (row 337), with nothing posted. Before, the carry found
    the link's NIXL peer gone and failed ``LLM_LINK_FAILED`` ("not prepared for NIXL"; found by the review of
    row 337)."""
    async with linked_pair(prompt_config=HOST_NIXL, decoder_config=HOST_NIXL) as pair:
        there = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        here = pair.dm.allocate_blocks_cache(BLOCKS)
        await _prepared(pair.prompt, DECODER_ID, there)
        posted = nixl_agent_of(pair.decoder).engine.posted
        real = nixl_plane.fence

        async def unlinked_meanwhile(rt, timeout_ms, what):
            if who == "we":
                status = await pair.decoder.unlink_clusters([pair.info])
            else:
                status = await pair.prompt.unlink_clusters([cluster_info(DECODER_ID, ("127.0.0.1", 1))])
            assert status == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
            await real(rt, timeout_ms, what)

        monkeypatch.setattr(nixl_plane, "fence", unlinked_meanwhile)
        with pytest.raises(LLMException) as info:
            await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), here, [2], [4])
        assert info.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK, info.value
        assert nixl_agent_of(pair.decoder).engine.posted == posted
