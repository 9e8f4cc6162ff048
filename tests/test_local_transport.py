"""Same-host transport: memfd regions passed over a unix socket, one native copy per transfer."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aio_datadist import wire
from aio_datadist.testing import usable_link
from aio_datadist.transport.local import PeerRegion, ShareError, parse_record
from peers import (
    DECODER_ID,
    PROMPT_ID,
    CacheSpec,
    EndpointSpec,
    endpoint,
    fill,
    linked_pair,
    port_of,
    require_local,
    snapshot,
    same,
    spawned,
)

pytestmark = pytest.mark.usefixtures("fork_server")  # peers are forked from it

S = LLMStatusCode
BLOCKS = CacheDesc(8, (32, 16, 256), DataType.DT_FLOAT16, Placement.HOST)  # 8 KiB blocks
LOCAL = {"transport": "local"}


@pytest.mark.asyncio
async def test_caches_are_shared_once_per_link_with_their_memfd():
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        await pair.link()
        link = usable_link(pair.decoder, PROMPT_ID)
        assert link.local is not None
        region = link.local.region(src.cache_id)
        assert region is not None and region.rows == 32 and region.row_bytes == 16 * 256 * 2
        later = pair.pm.allocate_cache(CacheDesc(2, (4, 64), DataType.DT_FLOAT16, Placement.HOST))
        assert link.local.region(later.cache_id) is not None  # caches made after linking are shared too
        pair.pm.deallocate_cache(later)
        await asyncio.sleep(0.05)  # the withdrawal travels on the unix socket
        assert later.cache_id not in link.local.regions  # and withdrawn when freed


@pytest.mark.asyncio
async def test_received_memfds_are_close_on_exec(monkeypatch):
    # An fd received from a peer is held while its record is checked; a fork and exec on another thread
    # meanwhile must not hand the peer's memory to the new program.
    import fcntl

    from aio_datadist.transport import local

    flags = []
    check = local.check_sealed

    def checking(fd: int, size: int, **kwargs: bool) -> None:
        flags.append(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC)
        check(fd, size, **kwargs)

    monkeypatch.setattr(local, "check_sealed", checking)
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        await pair.link()
        link = usable_link(pair.decoder, PROMPT_ID)
        assert link.local is not None and link.local.regions
    assert flags and all(flags)


@pytest.mark.asyncio
async def test_pull_and_push_are_byte_exact_through_shared_memory():
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        values = fill(src, 7)
        dst = pair.dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID, 0))
        await pair.link()
        src_blocks, dst_blocks = [3, 4, 5, 30, 0], [9, 10, 11, 1, 31]
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, src_blocks, dst_blocks)
        for d, v in zip(dst.tensors, values):
            assert torch.equal(d[dst_blocks], v[src_blocks])
        for t in dst.tensors:
            t.zero_()
        await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID, 0), src, src_blocks, dst_blocks)
        for d, v in zip(dst.tensors, values):
            assert torch.equal(d[dst_blocks], v[src_blocks])
        untouched = [b for b in range(32) if b not in dst_blocks]
        assert all(bool((d[untouched] == 0).all()) for d in dst.tensors)


@pytest.mark.asyncio
async def test_the_owner_still_checks_every_request():
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        fill(src, 7)
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        await pair.link()
        before = snapshot(dst)
        with pytest.raises(LLMException) as exc:
            await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, [32], [0])  # one past the end
        assert exc.value.status_code == S.LLM_PARAM_INVALID and "src_blocks" in str(exc.value)
        with pytest.raises(LLMException) as exc:
            await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 5), dst, [0], [0])
        assert exc.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
        assert same(before, snapshot(dst))


@pytest.mark.asyncio
async def test_keys_are_consumed_as_over_tcp():
    rows = CacheDesc(4, (3, 512), DataType.DT_FLOAT16, Placement.HOST)
    async with linked_pair(prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        src = pair.pm.allocate_cache(rows, [CacheKey(PROMPT_ID, 10)])
        values = fill(src, 3)
        dst = pair.dm.allocate_cache(rows)
        await pair.dm.pull_cache(CacheKey(PROMPT_ID, 10), dst, batch_index=2)
        assert all(torch.equal(d[2], v[0]) for d, v in zip(dst.tensors, values))
        with pytest.raises(LLMException) as exc:
            await pair.dm.pull_cache(CacheKey(PROMPT_ID, 10), dst)
        assert exc.value.status_code == S.LLM_KV_CACHE_NOT_EXIST


@pytest.mark.asyncio
async def test_registered_framework_tensors_fall_back_to_tcp():
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        owned = [torch.randn(BLOCKS.shape).half() for _ in range(BLOCKS.num_tensors)]
        src = pair.pm.register_blocks_cache(BLOCKS, owned, BlocksCacheKey(PROMPT_ID, 0))
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        await pair.link()
        link = usable_link(pair.decoder, PROMPT_ID)
        assert link.local is not None and link.local.region(src.cache_id) is None  # not shareable
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, [1, 2], [5, 6])
        assert all(torch.equal(d[[5, 6]], o[[1, 2]]) for d, o in zip(dst.tensors, owned))


@pytest.mark.asyncio
async def test_tcp_transport_never_shares():
    async with linked_pair(prompt_config={"transport": "tcp"}, decoder_config=LOCAL) as pair:
        assert usable_link(pair.decoder, PROMPT_ID).local is None
        assert usable_link(pair.prompt, DECODER_ID).local is None


def test_a_peer_region_outside_its_mapping_is_refused():
    import os
    import struct

    page = 4096

    def record(size: int, rows: int, row_bytes: int, offsets: list[int]) -> bytes:
        return (struct.pack("!BqQIQQQ", 1, 1, size, len(offsets), rows, row_bytes, rows * row_bytes)
                + struct.pack(f"!{len(offsets)}Q", *offsets))

    with pytest.raises(ShareError):
        parse_record(record(page, 2, page, [0]), 1, 0)  # two rows of a page in one page
    with pytest.raises(ShareError):
        parse_record(record(page, 1, page, [page]), 1, 0)  # a tensor past the end
    fd = os.memfd_create("t", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, page)
        with pytest.raises(ShareError):
            PeerRegion(parse_record(record(page, 1, page, [0]), 1, 0), fd)  # not sealed: it could shrink
    finally:
        os.close(fd)


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_between_processes_on_one_host():
    spec = EndpointSpec(LLMRole.PROMPT, PROMPT_ID, config=(("transport", "local"),),
                        caches=(CacheSpec("blocks", BLOCKS, seed=11, blocks=True, model_id=0),))
    async with endpoint(LLMRole.DECODER, DECODER_ID, transport="local") as dd:
        dst = dd.kv_cache_manager.allocate_blocks_cache(BLOCKS)
        async with spawned(spec) as (prompt,):
            assert (await dd.link_clusters([prompt.info]))[0] == S.LLM_SUCCESS
            link = usable_link(dd, PROMPT_ID)
            assert link.local is not None
            await dd.kv_cache_manager.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, list(range(32)),
                                                  list(range(31, -1, -1)))
            expected = prompt.expected("blocks")
            assert all(torch.equal(d, e.flip(0)) for d, e in zip(dst.tensors, expected))
            assert len(link.local.regions) == 1


@pytest.mark.asyncio
async def test_a_flood_of_same_host_pushes_is_served_a_bounded_number_at_once(monkeypatch):
    """Row 149: same-host pushes (``PUSH_LOCAL``) use no data channel, so nothing bounded how many the owner
    planned and queued on its copy threads at once (each a job list, which a large request makes large). 300
    pushes sent at once (copies kept off the loop's thread, so that they queue) had the owner serve all 300 at
    once; now it runs at most ``MAX_LOCAL_PUSHES_SERVED`` and tells the rest to stream, which take data channels
    (bounded per channel); every push lands its bytes. (An honest pusher keeps no more than that in flight itself:
    this one's bound is lifted, as a flooding peer's would be.)"""
    from aio_datadist.links import MAX_LOCAL_PUSHES_SERVED, MAX_SERVED_PER_CHANNEL
    from aio_datadist.transport import same_host

    from aio_datadist import owner
    from aio_datadist.transport import plane

    monkeypatch.setattr(same_host, "INLINE_COPY_MAX", 0)
    planned, copied = [], []  # same-host pushes the owner planned / copied: one told to stream is never planned
    real_plan, copier = owner.serve_plan, plane("same-host")
    monkeypatch.setattr(owner, "serve_plan", lambda rt, lk, msg, req: (
        planned.append(msg) if msg is wire.Msg.PUSH_LOCAL else None, real_plan(rt, lk, msg, req))[1])
    monkeypatch.setattr(copier, "serve_alone", lambda *a, _real=copier.serve_alone: (
        copied.append(1), _real(*a))[1])
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        values = fill(src, 7)
        dst = pair.dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID, 0))
        await pair.link()
        # A pusher that does not keep its own bound (local.MAX_LOCAL_PUSHES in flight a link), as a peer's flood
        usable_link(pair.prompt, DECODER_ID).local.pushes = asyncio.Semaphore(10**6)
        link = usable_link(pair.decoder, PROMPT_ID)
        most = copying = 0
        done = asyncio.Event()

        async def sample() -> None:
            nonlocal most, copying
            while not done.is_set():
                most, copying = max(most, len(link.serving)), max(copying, len(link.local_pushes))
                await asyncio.sleep(0)

        sampler = asyncio.create_task(sample())
        try:
            await asyncio.wait_for(asyncio.gather(*(
                pair.pm.push_blocks(BlocksCacheKey(DECODER_ID, 0), src, [i % 32], [i % 32]) for i in range(300))), 60)
        finally:
            done.set()
            await sampler
        bound = MAX_LOCAL_PUSHES_SERVED + MAX_SERVED_PER_CHANNEL * len(link.channels)
        assert 0 < most <= bound, f"the owner served {most} pushes at once (at most {bound})"
        # the same-host bound itself, apart from what the channels carry (an off-by-one passed the line above)
        assert copying <= MAX_LOCAL_PUSHES_SERVED, f"the owner copied {copying} same-host pushes at once"
        assert copying >= MAX_LOCAL_PUSHES_SERVED // 2, copying  # the flood pressed against the bound
        assert not link.local_pushes and not link.serving
        assert len(planned) == len(copied) < 300, (len(planned), len(copied))  # USE_STREAM before any planning
        assert all(torch.equal(d, v) for d, v in zip(dst.tensors, values, strict=True))


@contextlib.asynccontextmanager
async def _spawned_owner(desc: CacheDesc) -> AsyncIterator[tuple[Any, Any, Any, Any]]:
    """A PROMPT here, its blocks cache of ``desc`` filled, linked over the same host to a spawned DECODER owning a
    blocks cache ``dst`` of its own: ``(prompt, the owner process, the source cache, dst as it was)``."""
    spec = EndpointSpec(LLMRole.DECODER, DECODER_ID, listen=False, lifetime=60.0,
                        caches=(CacheSpec("dst", desc, 3, blocks=True, model_id=0),), config=(("transport", "local"),))
    async with endpoint(LLMRole.PROMPT, PROMPT_ID, listen=True, **LOCAL) as dd, spawned(spec) as (owner,):
        src = dd.kv_cache_manager.allocate_blocks_cache(desc)
        fill(src, 8)
        assert (await owner.call("link", PROMPT_ID, port_of(dd)[1]))[0] == S.LLM_SUCCESS
        assert dd.stats().links[DECODER_ID].transport == "local"
        yield dd, owner, src, await owner.call("dump", "dst")


@pytest.mark.asyncio
@pytest.mark.loops_take_turns
@pytest.mark.parametrize("cut", ["timeout", "cancel"])
async def test_a_same_host_push_given_up_is_not_copied_when_the_owner_reads_it_late(cut):
    """The owner copies a same-host push itself; a pusher that gives up waits for its word only
    ``ABORT_ACK_S`` (1 s). An owner that stood still longer (SIGSTOP here; a long GC pause, a blocking
    call) reads the request and the pusher's ``ABORT`` behind it only after the pusher returned: the request
    is dropped, never copied. Before, it was copied when the owner went on (the pusher's bytes landed in
    the owner's cache after the push had raised)."""
    small = CacheDesc(4, (8, 4, 16), DataType.DT_FLOAT16, Placement.HOST)  # small: copied inline
    async with _spawned_owner(small) as (dd, owner, src, before):
        owner.stop()
        try:
            push = asyncio.ensure_future(dd.kv_cache_manager.push_blocks(
                BlocksCacheKey(DECODER_ID, 0), src, [0, 1], [2, 3], timeout=300 if cut == "timeout" else 20000))
            if cut == "cancel":
                await asyncio.sleep(0.1)
                push.cancel()
            with pytest.raises((LLMException, asyncio.CancelledError)):
                await push
        finally:
            owner.resume()  # it reads the request now, after the push returned
        await asyncio.sleep(0.5)
        assert await owner.call("dump", "dst") == before, "the given-up push landed after it returned"


@pytest.mark.asyncio
@pytest.mark.loops_take_turns
@pytest.mark.parametrize("how", ["aborted", "link failed"])
async def test_a_same_host_push_cut_while_the_owner_stands_still_is_never_copied(how):
    """Each of the owner's two defences alone (found by audit: either one covered for the other above).
    ``aborted``: the owner stands still for less than ``ABORT_ACK_S`` and reads the request and the ``ABORT``
    behind it in one chunk while the connection is still open (no close to see): the ``ABORT`` alone drops it.
    ``link failed``: the pusher's link fails (no ``ABORT`` follows; the connection just closes): the owner,
    reading the request late, sees the connection closed before it copies and fails the link."""
    small = CacheDesc(4, (8, 4, 16), DataType.DT_FLOAT16, Placement.HOST)
    async with _spawned_owner(small) as (dd, owner, src, before):
        owner.stop()
        try:
            push = asyncio.ensure_future(dd.kv_cache_manager.push_blocks(
                BlocksCacheKey(DECODER_ID, 0), src, [0, 1], [2, 3], timeout=100 if how == "aborted" else 20000))
            if how == "aborted":
                await asyncio.sleep(0.4)  # timed out, ABORT sent, waiting for the owner's word (1 s at most)
                assert not push.done()
            else:
                await asyncio.sleep(0.1)
                assert not push.done()
                usable_link(dd, DECODER_ID).fail(LLMException("cut", status_code=S.LLM_LINK_FAILED))
                with pytest.raises(LLMException):
                    await push
        finally:
            owner.resume()  # reads PUSH_LOCAL (and the ABORT) late
        with pytest.raises(LLMException):
            await push
        await asyncio.sleep(0.3)
        assert await owner.call("dump", "dst") == before, f"the push landed ({how})"


@pytest.mark.asyncio
async def test_a_given_up_same_host_push_read_in_a_chunk_before_its_abort_is_never_copied():
    """As above, with more control bytes queued while the owner stood still than one read takes (a loop reads
    at most 256 KiB of a connection at once, uvloop 64 KiB): a small push's request ends one chunk, a big
    push's request runs on into the next, and the ``ABORT``s of both come after. The small one's ``ABORT`` is
    not in its chunk, and the connection, though the pusher closed it, still has bytes to read (found by audit:
    it failed in about half the runs before the fix)."""
    rows = 24000  # a request of ~400 KB: longer than any one read
    tiny = CacheDesc(1, (rows, 8), DataType.DT_FLOAT16, Placement.HOST)
    async with _spawned_owner(tiny) as (dd, owner, src, before):
        every = list(range(0, rows, 2)) + list(range(1, rows, 2))  # no runs to pack
        key = BlocksCacheKey(DECODER_ID, 0)
        owner.stop()
        try:
            small = asyncio.ensure_future(dd.kv_cache_manager.push_blocks(key, src, [0, 1], [2, 3], timeout=300))
            await asyncio.sleep(0.05)  # its request first
            big = asyncio.ensure_future(dd.kv_cache_manager.push_blocks(key, src, every, every, timeout=300))
            for push in (small, big):
                with pytest.raises(LLMException):
                    await push
        finally:
            owner.resume()  # reads the small request, then (a chunk later) the big one and both ABORTs
        await asyncio.sleep(0.5)
        assert await owner.call("dump", "dst") == before, "a given-up push landed after it returned"


def _push_local_frame(req_id: int) -> bytes:
    """A ``PUSH_LOCAL`` of the peer's (its fields never read here: the link's dispatch is recorded instead)."""
    return wire.encode(wire.Msg.PUSH_LOCAL, req_id, channel=0, target_kind=0, cluster_id=0, cache_id=0, key_req_id=0,
                       prefix_id=0, model_id=0, batch_index=0, layer_first=0, layer_last=0, tensor_num_per_layer=2,
                       tensor_count=4, data_type=0, offset=0, nbytes=8, flags=0, timeout_ms=1000, rows=(),
                       src_cache_id=0, src_first=0, src_nbytes=8, src_offset=0, src_rows=b"")


@pytest.mark.asyncio
async def test_a_push_request_read_with_bytes_and_the_peers_close_queued_behind_it_is_never_copied(monkeypatch):
    """Row 158 at a chunk's edge, deterministic: a ``PUSH_LOCAL`` ends the chunk read while more bytes of the
    connection and the peer's close (it failed the link) are queued behind it. The close peek says nothing while
    bytes are queued; the hang-up (``POLLRDHUP``) does: the link fails and the request is never served (found by
    audit: it was served, and a given-up push landed after it returned)."""
    async with linked_pair(prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        link = usable_link(pair.decoder, PROMPT_ID)
        served: list[int] = []
        monkeypatch.setattr(link, "_dispatch", lambda event: served.append(getattr(event, "req_id", -1)))
        theirs = usable_link(pair.prompt, DECODER_ID).writer.get_extra_info("socket")
        with socket.socket(fileno=os.dup(theirs.fileno())) as peer:  # the pusher's end of the connection
            peer.sendall(wire.encode(wire.Msg.PING, 0))  # queued at our end, unread: this pass reads nothing
            peer.shutdown(socket.SHUT_WR)
        link._control_data(_push_local_frame(1000))  # the chunk our loop read before those
        assert served == [] and link.down, "served though the peer had closed the connection behind it"


async def _recorded(pusher: Any, msg: wire.Msg, push: Any) -> tuple[Any, dict]:
    """The record (and the fields changed as it was sent) of the first ``msg`` the honest ``push`` sends
    through ``pusher``, to send again by hand."""
    captured = []
    send_record = pusher.send_record

    def capture(sent: wire.Msg, req_id: int, record: Any, **changes: Any) -> Any:
        if sent is msg:
            captured.append((record, changes))
        return send_record(sent, req_id, record, **changes)

    pusher.send_record = capture
    try:
        await push
    finally:
        pusher.send_record = send_record
    assert captured, f"the push sent no {msg.name}"
    return captured[0]


def _said_for(owner: Any, rid: int) -> list[tuple[wire.Msg, Any, str]]:
    """What ``owner`` sends about request ``rid`` from now on: (message, status, text)."""
    said: list[tuple[wire.Msg, Any, str]] = []
    send = owner.send

    def watched(msg: wire.Msg, req_id: int, **fields: Any) -> Any:
        if req_id == rid:
            said.append((msg, fields.get("status"), fields.get("text", "")))
        return send(msg, req_id, **fields)

    owner.send = watched
    return said


@pytest.mark.asyncio
@pytest.mark.loops_take_turns
@pytest.mark.parametrize("chunk", ["one-chunk", "abort-alone"])
async def test_a_push_resent_under_the_id_of_one_still_settling_is_refused_and_the_copy_stays_tracked(chunk):
    """A same-host pusher aborts a large ``PUSH_LOCAL`` and sends it again under the same id in the same chunk.
    The owner's first copy is cancelled but still settling (in ``local_pushes``, which an unlink waits for);
    the second is refused as an id in use, and the first stays tracked until it is over. Before, the second was
    accepted into the first's place, the first's end then dropped it from ``local_pushes``, and the second ran
    where neither an unlink's ``settle_served`` nor ``MAX_LOCAL_PUSHES_SERVED`` saw it (found by audit)."""
    big = CacheDesc(4, (8, 2048, 1024), DataType.DT_FLOAT16, Placement.HOST)  # a 128 MiB push of every block
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        src = pair.pm.allocate_blocks_cache(big, BlocksCacheKey(PROMPT_ID, 0))
        pair.dm.allocate_blocks_cache(big, BlocksCacheKey(DECODER_ID, 0))
        fill(src, 3)
        await pair.link()
        pusher = usable_link(pair.prompt, DECODER_ID)
        assert pusher.local is not None
        blocks = list(range(8))
        record, _ = await _recorded(pusher, wire.Msg.PUSH_LOCAL, pair.pm.push_blocks(  # honest, recorded
            BlocksCacheKey(DECODER_ID, 0), src, blocks, blocks))
        owner = usable_link(pair.decoder, PROMPT_ID)
        rid = pusher.new_req_id()
        said = _said_for(owner, rid)
        push = wire.encode_record(wire.Msg.PUSH_LOCAL, rid, record, timeout_ms=60_000)
        abort = wire.encode(wire.Msg.ABORT, rid, channel=0, generation=wire.NO_GENERATION)
        pusher.writer.write(push)  # copy 1 starts
        async with asyncio.timeout(2):
            while rid not in owner.local_pushes:
                await asyncio.sleep(0.001)
        if chunk == "abort-alone":  # copy 1 cancelled: tracked until it settled, not only until it was cancelled
            settled = owner.local_pushes[rid]
            pusher.writer.write(abort)
            async with asyncio.timeout(10):
                while not settled.done():
                    assert rid in owner.local_pushes, "copy 1 untracked before it settled"
                    await asyncio.sleep(0)
            return
        pusher.writer.write(abort + push)  # copy 1 cancelled; the same request again under its id
        untracked = 0
        async with asyncio.timeout(10):
            while rid in owner.serving or rid in owner.local_pushes:
                untracked += rid in owner.serving and rid not in owner.local_pushes
                await asyncio.sleep(0)
        assert untracked == 0, f"a copy of request {rid} ran untracked by local_pushes for {untracked} loop passes"
        assert any(msg is wire.Msg.RESP and status == S.LLM_PARAM_INVALID and "in use" in text
                   for msg, status, text in said), said


@pytest.mark.asyncio
async def test_a_stream_push_resent_under_the_id_of_one_still_settling_is_refused():
    """Row 200's other half: a stream ``PUSH_REQ`` given up (``ABORT``) and sent again under its id in the same chunk,
    while the first is still settling (in ``served_pushes``), is refused as an id in use."""
    small = CacheDesc(2, (4, 1024), DataType.DT_FLOAT16, Placement.HOST)
    tcp = {"transport": "tcp"}
    async with linked_pair(link=False, prompt_config=tcp, decoder_config=tcp) as pair:
        src = pair.pm.allocate_blocks_cache(small, BlocksCacheKey(PROMPT_ID, 0))
        pair.dm.allocate_blocks_cache(small, BlocksCacheKey(DECODER_ID, 0))
        await pair.link()
        pusher = usable_link(pair.prompt, DECODER_ID)
        record, changes = await _recorded(pusher, wire.Msg.PUSH_REQ, pair.pm.push_blocks(  # honest, recorded
            BlocksCacheKey(DECODER_ID, 0), src, [0], [0]))
        owner = usable_link(pair.decoder, PROMPT_ID)
        rid = pusher.new_req_id()
        said = _said_for(owner, rid)
        push = wire.encode_record(wire.Msg.PUSH_REQ, rid, record, **{**changes, "timeout_ms": 2000})
        abort = wire.encode(wire.Msg.ABORT, rid, channel=0, generation=wire.NO_GENERATION)
        pusher.writer.write(push)  # served: its job waits for bytes nobody sends
        async with asyncio.timeout(2):
            while rid not in owner.served_pushes:
                await asyncio.sleep(0.001)
        pusher.writer.write(abort + push)  # given up; the same request again under its id
        async with asyncio.timeout(5):
            while rid in owner.serving or rid in owner.served_pushes:
                await asyncio.sleep(0.001)
        assert any(msg is wire.Msg.RESP and status == S.LLM_PARAM_INVALID and "in use" in text
                   for msg, status, text in said), said


@pytest.mark.asyncio
async def test_a_pull_whose_owner_deallocates_the_cache_right_after_answering_is_no_link_failure():
    """A hand-off's owner may free the cache as soon as it answered a pull naming it: the share's withdrawal is then
    read before the pull copies. It failed ``LLM_LINK_FAILED`` ("shared cache N is not mapped") on a healthy link;
    now ``LLM_KV_CACHE_NOT_EXIST``, as device IPC's (row 195; found by audit), and nothing lands."""
    from aio_datadist import CacheKeyByIdAndIndex

    desc = CacheDesc(2, (4, 1024), DataType.DT_FLOAT16, Placement.HOST)
    async with linked_pair(prompt_config={"transport": "local"}, decoder_config={"transport": "local"}) as pair:
        src = pair.pm.allocate_cache(desc)
        fill(src, 5)
        dst = pair.dm.allocate_cache(desc)
        await asyncio.sleep(0.05)
        owners = usable_link(pair.prompt, DECODER_ID)
        real_send = owners.send

        def send(msg, req_id, **fields):
            real_send(msg, req_id, **fields)
            if msg is wire.Msg.RESP and fields.get("cache_id", -1) == src.cache_id:
                pair.pm.deallocate_cache(src)  # the owner's caller frees it right after it was served

        owners.send = send
        before = snapshot(dst)
        try:
            with pytest.raises(LLMException) as info:
                await pair.dm.pull_cache(CacheKeyByIdAndIndex(PROMPT_ID, src.cache_id, 1), dst, batch_index=2,
                                         timeout=5000)
        finally:
            owners.send = real_send
        assert info.value.status_code == S.LLM_KV_CACHE_NOT_EXIST and "withdrew" in str(info.value), info.value
        assert same(snapshot(dst), before)
        link = usable_link(pair.decoder, PROMPT_ID)
        assert link.local is not None and not link.down
        again = pair.pm.allocate_cache(desc)
        values = fill(again, 6)
        await pair.dm.pull_cache(CacheKeyByIdAndIndex(PROMPT_ID, again.cache_id, 1), dst, batch_index=2)
        assert all(bool((d[2] == v[1]).all()) for d, v in zip(dst.tensors, values))  # the link is fine
        share = link.local  # a share that is gone as the pull reaches its copy stays LLM_LINK_FAILED
        real_region = share.region

        def region(cache_id):
            share.close()  # the share ends (its socket lost) between the owner's answer and the copy
            return real_region(cache_id)

        share.region = region
        with pytest.raises(LLMException) as info:
            await pair.dm.pull_cache(CacheKeyByIdAndIndex(PROMPT_ID, again.cache_id, 1), dst, batch_index=1,
                                     timeout=5000)
        assert info.value.status_code == S.LLM_LINK_FAILED and share.closed, info.value


@pytest.mark.asyncio
async def test_a_same_host_push_confirmed_with_done_in_place_of_its_resp_fails_with_llm_link_failed():
    """Row 139: the owner answers a ``PUSH_LOCAL`` with ``RESP``; a successful ``DONE`` in its place is a lie the
    pusher must not read as the push's success: the push fails ``LLM_LINK_FAILED``."""
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        fill(src, 7)
        pair.dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID, 0))
        await pair.link()
        owner = usable_link(pair.decoder, PROMPT_ID)
        send = owner.send

        def done_for_resp(msg: wire.Msg, req_id: int, **fields: Any) -> Any:
            if msg is wire.Msg.RESP and fields.get("status") == S.LLM_SUCCESS:
                return send(wire.Msg.DONE, req_id, status=S.LLM_SUCCESS, text="")
            return send(msg, req_id, **fields)

        owner.send = done_for_resp
        with pytest.raises(LLMException) as exc:
            await asyncio.wait_for(pair.pm.push_blocks(BlocksCacheKey(DECODER_ID, 0), src, [0], [1]), 5)
        assert exc.value.status_code == S.LLM_LINK_FAILED, exc.value


@pytest.mark.asyncio
async def test_a_flood_of_small_same_host_pushes_does_not_hold_the_owners_loop(monkeypatch):
    """A linked same-host peer floods its control connection with ``PUSH_LOCAL`` requests, each of
    ``INLINE_COPY_MAX`` (2 MiB), each from and into other blocks. The owner copied each on its loop's thread as
    it served a chunk (its copy threads idle; ``MAX_LOCAL_PUSHES_SERVED`` counts only the copies on the threads),
    so a chunk read at once (64 KiB on uvloop, up to 256 KiB on asyncio) was hundreds of 2 MiB copies in one
    callback, 0.3 s of the loop. Now at most one such push is copied inline a pass of the loop (counted by a
    callback that runs once a pass), the rest on the copy threads, and every push lands."""
    import array

    from aio_datadist import _core
    from aio_datadist.transport import same_host

    loop = asyncio.get_running_loop()
    passes, inline = [0], collections.Counter()
    copy_now = _core.copy_now

    def counted(*args: Any) -> Any:
        inline[passes[0]] += 1
        return copy_now(*args)

    def count_pass() -> None:
        passes[0] += 1
        if counting:
            loop.call_soon(count_pass)

    monkeypatch.setattr(_core, "copy_now", counted)
    desc = CacheDesc(4, (128, 512, 512), DataType.DT_FLOAT16, Placement.HOST)  # 512 KiB blocks: 4 tensors x 1 = 2 MiB
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        src = pair.pm.allocate_blocks_cache(desc, BlocksCacheKey(PROMPT_ID, 0))
        pair.dm.allocate_blocks_cache(desc, BlocksCacheKey(DECODER_ID, 0))
        fill(src, 3)
        await pair.link()
        pusher = usable_link(pair.prompt, DECODER_ID)
        record, _ = await _recorded(pusher, wire.Msg.PUSH_LOCAL, pair.pm.push_blocks(  # honest, recorded
            BlocksCacheKey(DECODER_ID, 0), src, [1], [1]))
        assert 4 * 512 * 512 * 2 == same_host.INLINE_COPY_MAX
        answered: list[int] = []
        frames = []
        for i in range(3000):  # about 450 KiB of requests
            rid = pusher.new_req_id()
            pusher.expect(rid).add_done_callback(lambda f: answered.append(f.result().status))
            frames.append(wire.encode_record(wire.Msg.PUSH_LOCAL, rid, record, timeout_ms=60_000,
                                             rows=(i * 7 % 128,), src_rows=array.array("Q", [i % 128]).tobytes()))
        inline.clear()
        counting = True
        count_pass()
        pusher.writer.write(b"".join(frames))
        deadline = loop.time() + 30
        while len(answered) < len(frames) and loop.time() < deadline:
            await asyncio.sleep(0.005)
        counting = False
        assert len(answered) == len(frames) and set(answered) == {S.LLM_SUCCESS}
        assert inline and max(inline.values()) == 1, f"{max(inline.values())} pushes of 2 MiB copied inline in one pass"


@pytest.mark.asyncio
async def test_a_push_names_where_in_its_source_rows_the_bytes_start_and_the_owner_bounds_it():
    """``PUSH_LOCAL.src_offset`` (wire version 11): the owner copies ``src_nbytes`` from that offset of each of
    the pusher's rows, and refuses (``LLM_PARAM_INVALID``, nothing copied) an offset that would take the copy past
    the row: a linked peer lying there would have the owner copy the owner's own memory past the peer's region
    into a cache the peer can then pull."""
    import array

    desc = CacheDesc(2, (4, 1024), DataType.DT_UINT8, Placement.HOST)  # 1 KiB rows
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        src = pair.pm.allocate_blocks_cache(desc, BlocksCacheKey(PROMPT_ID, 0))
        dst = pair.dm.allocate_blocks_cache(desc, BlocksCacheKey(DECODER_ID, 0))
        values = fill(src, 5)
        await pair.link()
        pusher = usable_link(pair.prompt, DECODER_ID)
        require_local(pair.prompt)
        record, _ = await _recorded(pusher, wire.Msg.PUSH_LOCAL, pair.pm.push_blocks(  # honest, recorded
            BlocksCacheKey(DECODER_ID, 0), src, [1], [0]))
        assert record.src_offset == 0 and record.src_nbytes == 1024
        before = [t.clone() for t in dst.tensors]

        async def send(**changes: Any) -> Any:
            rid = pusher.new_req_id()
            answer = pusher.expect(rid)
            pusher.writer.write(wire.encode_record(wire.Msg.PUSH_LOCAL, rid, record, **changes))
            return await asyncio.wait_for(answer, 5)

        half = dict(offset=0, nbytes=512, src_nbytes=512, rows=(2,), src_rows=array.array("Q", [3]).tobytes(),
                    flags=record.flags & ~wire.ReqFlag.EXACT, block_shape=0)
        for lie in (513, 1024, 2**32, 2**64 - 1):
            answer = await send(**half, src_offset=lie)
            assert answer.status == S.LLM_PARAM_INVALID and "does not fit" in answer.text, (lie, answer)
        await asyncio.sleep(0.1)
        assert all(torch.equal(t, b) for t, b in zip(dst.tensors, before, strict=True)), "a lie was copied"
        answer = await send(**half, src_offset=512)  # the second half of row 3 into the first half of row 2
        assert answer.status == S.LLM_SUCCESS, answer
        for got, was, row in zip(dst.tensors, before, values, strict=True):
            assert torch.equal(got[2, :512], row[3, 512:]) and torch.equal(got[2, 512:], was[2, 512:])
