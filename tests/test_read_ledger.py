"""The read ledger: a same-host pull of a blocks cache by its blocks key reads the owner's cache without asking
while the owner's ledger lists it, and asks whenever in doubt (``transport/ledger.py``).

Each test watches the owner's link for the requests it gets, so "read without asking" and "asked" are
facts, not guesses; the bytes are checked either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from aio_datadist import BlocksCacheKey, CacheDesc, CacheKey, DataType, LLMException, LLMStatusCode, Placement
from aio_datadist.stats import Outcome
from aio_datadist.testing import usable_link
from aio_datadist.transport.local import LocalShare
from aio_datadist.wire import Msg
from peers import DECODER_ID, PROMPT_ID, fill, linked_pair, same, snapshot

pytestmark = pytest.mark.usefixtures("fork_server")

S = LLMStatusCode
BLOCKS = CacheDesc(4, (16, 8, 256), DataType.DT_FLOAT16, Placement.HOST)  # 4 KiB blocks
BIG = CacheDesc(2, (64, 1 << 20), DataType.DT_UINT8, Placement.HOST)  # 2 x 64 blocks of 1 MiB
LOCAL = {"transport": "local"}
KEY = BlocksCacheKey(PROMPT_ID, 0)
ATTACKER = os.path.join(os.path.dirname(__file__), "reliability", "_share_attacker.py")


def asked(dd) -> list[Msg]:
    """The transfer requests ``dd`` gets from the decoder from now on (its link's handler, watched)."""
    link = usable_link(dd, DECODER_ID)
    seen: list[Msg] = []
    serve = link.on_request
    assert serve is not None

    def watched(lk, msg, req_id, fields):
        if msg in (Msg.PULL_REQ, Msg.PUSH_REQ, Msg.PUSH_LOCAL):
            seen.append(msg)
        serve(lk, msg, req_id, fields)

    link.on_request = watched
    return seen


@contextlib.asynccontextmanager
async def listed(seed: int):
    """A same-host pair whose prompt holds a blocks cache under ``KEY`` filled with ``seed``'s pattern, and a
    decoder blocks cache to pull into; yields the pair, the values, the destination and the owner's requests."""
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        values = fill(pair.pm.allocate_blocks_cache(BLOCKS, KEY), seed)
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        await pair.link()
        yield pair, values, dst, asked(pair.prompt)


async def eventually(check, limit_s: float = 2.0) -> None:
    for _ in range(int(limit_s / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    assert check()


@pytest.mark.asyncio
async def test_a_blocks_pull_reads_without_asking_and_the_owner_counts_it():
    async with listed(4) as (pair, values, dst, seen):
        await pair.dm.pull_blocks(KEY, dst, [3, 0, 15], [1, 2, 3])
        assert seen == []
        for d, v in zip(dst.tensors, values):
            assert torch.equal(d[[1, 2, 3]], v[[3, 0, 15]])
        mine = pair.decoder.stats().links[PROMPT_ID].kinds["pull"]
        assert mine.transfers == 1 and mine.transport == "local"

        def served():
            return pair.prompt.stats().links[DECODER_ID].kinds["served_pull"]
        await eventually(lambda: served().transfers == 1)  # the READ record follows the return
        assert served().bytes == 3 * 4 * BLOCKS.size // 16 and served().transport == "local"


@pytest.mark.asyncio
async def test_a_pull_right_after_deallocate_asks_and_is_refused():
    """The owner clears the cache's word before ``deallocate_cache`` returns: a pull that starts after it
    asks, though the withdrawal of the cache has not reached the decoder yet."""
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS, KEY)
        fill(src, 5)
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        await pair.link()
        share = usable_link(pair.decoder, PROMPT_ID).local
        assert share is not None and share.listed_region(0) is not None
        seen = asked(pair.prompt)
        before = snapshot(dst)
        pair.pm.deallocate_cache(src)
        assert 0 in share.listed  # the decoder has not read the withdrawal yet: only the ledger says so
        assert share.listed_region(0) is None
        with pytest.raises(LLMException) as exc:
            await pair.dm.pull_blocks(KEY, dst, [0], [0])
        assert exc.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
        assert seen == [Msg.PULL_REQ]
        assert same(before, snapshot(dst))


@pytest.mark.asyncio
async def test_a_read_under_way_when_the_cache_is_freed_asks_instead_of_copying(monkeypatch):
    """A pull that found the cache listed turns the loop before it copies: a ``deallocate_cache`` in that turn
    clears the word, and the pull reads the ledger again, asks and is refused, copying nothing (without that
    second look every named test passed: found by audit, 2026-12-07)."""
    from aio_datadist.transport import same_host

    real_read, real_copy = same_host._read, same_host.copy_settled
    inside, freed, late = 0, False, []

    async def read(*args, **kwargs):
        nonlocal inside
        inside += 1
        try:
            return await real_read(*args, **kwargs)
        finally:
            inside -= 1

    async def copy(*args, **kwargs):
        late.append(freed)
        return await real_copy(*args, **kwargs)

    monkeypatch.setattr(same_host, "_read", read)
    monkeypatch.setattr(same_host, "copy_settled", copy)
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        await pair.link()
        share = usable_link(pair.decoder, PROMPT_ID).local
        assert share is not None
        hit = 0
        for turns in range(8):  # the free lands after 0, 1, ... loop turns of the pull
            src = pair.pm.allocate_blocks_cache(BLOCKS, KEY)
            fill(src, turns)
            await eventually(lambda: share.listed_region(0) is not None)
            freed, late[:] = False, []
            pull = asyncio.ensure_future(pair.dm.pull_blocks(KEY, dst, [1], [1]))
            for _ in range(turns):
                await asyncio.sleep(0)
            hit += inside > 0  # parked in its turn before the copy
            pair.pm.deallocate_cache(src)
            freed = True
            with contextlib.suppress(LLMException):
                await pull
            assert True not in late, f"a copy out of the freed cache after {turns} turns"
        assert hit > 0


@pytest.mark.asyncio
async def test_a_key_bound_to_another_cache_reads_that_cache():
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        old = pair.pm.allocate_blocks_cache(BLOCKS, KEY)
        fill(old, 6)
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        await pair.link()
        pair.pm.deallocate_cache(old)
        new = pair.pm.allocate_blocks_cache(BLOCKS, KEY)
        values = fill(new, 7)
        await pair.dm.pull_blocks(KEY, dst, [2], [2])  # asked (the old word is clear) or read from the new one
        await pair.dm.pull_blocks(KEY, dst, [9], [9])  # the new cache's record has arrived by now: read
        for d, v in zip(dst.tensors, values):
            assert torch.equal(d[[2, 9]], v[[2, 9]])
        share = usable_link(pair.decoder, PROMPT_ID).local
        assert share is not None
        region = share.listed_region(0)
        assert region is not None and region.cache_id == new.cache_id


@pytest.mark.asyncio
async def test_a_regions_tensor_addresses_are_read_only_and_kept_for_the_next_pull_of_the_span():
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS, KEY)
        values = fill(src, 8)
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        await pair.link()
        await pair.dm.pull_blocks(KEY, dst, [3], [3])
        share = usable_link(pair.decoder, PROMPT_ID).local
        region = share.listed_region(0) if share is not None else None
        assert region is not None
        bases = region.tensor_bases(0, 4)
        assert list(bases) == [region.base + o for o in region.offsets]
        assert region.tensor_bases(0, 4) is bases  # kept: the next pull of these layers builds nothing
        with pytest.raises(TypeError):
            bases[0] = 0  # a caller cannot send later copies elsewhere
        assert list(region.tensor_bases(1, 2)) == list(bases[1:3])
        assert region.tensor_bases(0, 4) is not bases  # one span kept at a time: a pusher cannot grow it
        await pair.dm.pull_blocks(KEY, dst, [5], [6], src_layer_range=range(1, 2), dst_layer_range=range(1, 2))
        for d, v in zip(dst.tensors, values):
            assert torch.equal(d[3], v[3])
        for d, v in zip(dst.tensors[2:], values[2:]):
            assert torch.equal(d[6], v[5])


@pytest.mark.asyncio
async def test_what_does_not_fit_or_consumes_a_key_is_asked_and_refused_by_the_owner():
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS, KEY)
        fill(src, 8)
        rows = CacheDesc(2, (4, 512), DataType.DT_FLOAT16, Placement.HOST)
        keyed = pair.pm.allocate_cache(rows, [CacheKey(PROMPT_ID, 10)])
        values = fill(keyed, 9)
        dst = pair.dm.allocate_blocks_cache(BLOCKS)
        other_type = pair.dm.allocate_blocks_cache(CacheDesc(4, (16, 8, 128), DataType.DT_FLOAT, Placement.HOST))
        rows_dst = pair.dm.allocate_cache(rows)
        await pair.link()
        seen = asked(pair.prompt)
        before = snapshot(dst)
        with pytest.raises(LLMException) as exc:
            await pair.dm.pull_blocks(KEY, dst, [16], [0])  # one past the end
        assert exc.value.status_code == S.LLM_PARAM_INVALID and "src_blocks" in str(exc.value)
        with pytest.raises(LLMException) as exc:
            await pair.dm.pull_blocks(KEY, other_type, [0], [0])  # same bytes, another data type
        assert exc.value.status_code == S.LLM_PARAM_INVALID and "data types differ" in str(exc.value)
        with pytest.raises(LLMException) as exc:
            await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 3), dst, [0], [0])  # no such key
        assert exc.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
        assert seen == [Msg.PULL_REQ] * 3 and same(before, snapshot(dst))
        await pair.dm.pull_cache(CacheKey(PROMPT_ID, 10), rows_dst, batch_index=1)  # a key it consumes
        assert seen == [Msg.PULL_REQ] * 4
        assert all(torch.equal(d[1], v[0]) for d, v in zip(rows_dst.tensors, values))


@pytest.mark.asyncio
async def test_a_burst_of_reads_keeps_the_share_and_the_owner_counts_every_one():
    """Reads are reported in sums over 10 ms: 2,000 reads, one after another and 500 at once, neither fill the
    share socket (which would end the share) nor go uncounted; a cache freed right after its pull returned is
    counted too."""
    async with listed(11) as (pair, values, dst, seen):
        link = usable_link(pair.decoder, PROMPT_ID)
        for i in range(1500):
            await pair.dm.pull_blocks(KEY, dst, [i % 16], [15 - i % 16])
        await asyncio.gather(*(pair.dm.pull_blocks(KEY, dst, [i % 16], [15 - i % 16]) for i in range(500)))
        for d, v in zip(dst.tensors, values):
            assert torch.equal(d, v.flip(0))
        last = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 1))
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 1), dst, [0], [0])
        pair.pm.deallocate_cache(last)  # before the READ of that pull left

        def served():
            return pair.prompt.stats().links[DECODER_ID].kinds["served_pull"]
        await eventually(lambda: served().transfers == 2001)
        assert served().bytes == 2001 * 4 * BLOCKS.size // 16
        assert seen == [] and link.local is not None and pair.decoder.stats().links[PROMPT_ID].transport == "local"


class ServedPulls:
    """An observer of the owner's endpoint: the served pulls it counted, links up or down."""

    def __init__(self) -> None:
        self.count = 0

    def transfer(self, cluster_id, kind, transport, nbytes, seconds, outcome, status) -> None:
        if kind == "served_pull" and outcome is Outcome.OK:
            self.count += 1

    def transfers(self, cluster_id, kind, transport, count, nbytes, seconds) -> None:
        if kind == "served_pull":
            self.count += count

    def link(self, cluster_id, remote_cluster_id, up) -> None:
        pass


@pytest.mark.asyncio
@pytest.mark.parametrize("end", ["unlink", "forced_unlink", "requester_finalizes", "owner_finalizes"])
async def test_reads_right_before_the_link_ends_are_counted_by_the_owner(end):
    """Reads are reported in sums over 10 ms: those made just before the link goes leave before the word that
    ends it (the requester's UNLINK, or its answer to the owner's; a forced unlink with nothing in flight sends
    no UNLINK: they leave as the share closes), and the owner counts what its share queue holds before closing
    it."""
    async with listed(12) as (pair, values, dst, seen):
        served = ServedPulls()
        pair.prompt._endpoint.observers.append(served)
        for i in range(5):
            await pair.dm.pull_blocks(KEY, dst, [i], [i])
        assert seen == []
        await (pair.unlink(force=True) if end == "forced_unlink" else pair.end(end))
        await eventually(lambda: served.count == 5, limit_s=1.0)


@pytest.mark.asyncio
@pytest.mark.parametrize("end", ["unlink", "requester_finalizes", "owner_finalizes"])
async def test_reads_still_queued_on_the_owners_share_as_the_link_ends_are_counted(end):
    """The owner's share reader has not run before the word that ends the link: closing the share acts on the
    READ records queued on it (``LocalShare.finish``)."""
    async with listed(12) as (pair, values, dst, seen):
        served = ServedPulls()
        pair.prompt._endpoint.observers.append(served)
        share = usable_link(pair.prompt, DECODER_ID).local
        share._loop.remove_reader(share.sock.fileno())  # the READ records stay queued until the share closes
        for i in range(5):
            await pair.dm.pull_blocks(KEY, dst, [i], [i])
        await pair.end(end)
        await eventually(lambda: served.count == 5, limit_s=1.0)


@pytest.mark.asyncio
async def test_a_loop_of_small_reads_lets_other_tasks_run_and_timeouts_fire():
    """A read turns the loop once before it copies, though its copy runs on the loop's thread."""
    async with listed(12) as (pair, _values, dst, _seen):
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        other = asyncio.ensure_future(ticker())
        try:
            for i in range(50):
                await pair.dm.pull_blocks(KEY, dst, [i % 16], [i % 16])
            assert ticks >= 50
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.02):
                    for i in range(100_000):
                        await pair.dm.pull_blocks(KEY, dst, [i % 16], [i % 16])
        finally:
            other.cancel()


@pytest.mark.asyncio
async def test_the_owner_refuses_other_block_shapes_with_its_own_words():
    """Same bytes, another block shape: the owner's refusal names its shape (here the 1-D blocks' ``()``)."""
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        pair.pm.allocate_blocks_cache(CacheDesc(2, (16,), DataType.DT_FLOAT16, Placement.HOST), KEY)
        dst = pair.dm.allocate_blocks_cache(CacheDesc(2, (16, 1), DataType.DT_FLOAT16, Placement.HOST))
        await pair.link()
        seen = asked(pair.prompt)
        with pytest.raises(LLMException) as exc:
            await pair.dm.pull_blocks(KEY, dst, [0], [0])
        assert exc.value.status_code == S.LLM_PARAM_INVALID and "holds blocks of shape ()" in str(exc.value)
        assert seen == [Msg.PULL_REQ]


@pytest.mark.asyncio
@pytest.mark.loops_take_turns
@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_a_cut_read_stops_its_copy_before_returning(how):
    """A 128 MiB read goes to the copy threads; cut, it returns only once the copy stopped: nothing lands
    afterwards. Then the next read is whole. A cut that came only after the whole copy (a loop held up on a
    busy machine) proves nothing, so the read is cut again, up to five times, until one is cut mid-copy."""
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        src = pair.pm.allocate_blocks_cache(BIG, KEY)
        for t in src.tensors:
            t.fill_(0x5C)
        dst = pair.dm.allocate_blocks_cache(BIG)
        await pair.link()
        seen = asked(pair.prompt)
        everything = list(range(64))
        for _ in range(5):
            for t in dst.tensors:
                t.zero_()
            if how == "timeout":
                with pytest.raises(LLMException) as exc:
                    await pair.dm.pull_blocks(KEY, dst, everything, everything, timeout=2)
                assert exc.value.status_code == S.LLM_TIMEOUT
            else:
                task = asyncio.ensure_future(pair.dm.pull_blocks(KEY, dst, everything, everything))
                await asyncio.sleep(0.003)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            after = snapshot(dst)
            if not all(bool((t == 0x5C).all()) for t in after):
                break
        else:
            pytest.fail("the copy finished before the cut five times over")
        await asyncio.sleep(0.3)
        assert same(after, snapshot(dst)), "bytes landed after the call returned"
        await pair.dm.pull_blocks(KEY, dst, everything, everything)
        assert all(bool((t == 0x5C).all()) for t in dst.tensors)
        assert seen == []


def test_a_peer_ledger_decides_only_which_of_its_own_regions_is_read():
    """A separate process plays the owner: it sends a real sealed ledger and a cache listed in it, then
    lists, clears and re-lists the word with another id. The share follows the word, and the region it
    would read is the one the fd holds, checked against its size."""
    loop = asyncio.new_event_loop()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen([sys.executable, ATTACKER, "ledger", str(theirs.fileno())], pass_fds=[theirs.fileno()],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    theirs.close()
    lost: list[bool] = []

    async def run() -> None:
        share = LocalShare(ours, on_lost=lambda: lost.append(True))
        try:
            def step(command: str) -> str:
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(command + "\n")
                proc.stdin.flush()
                return json.loads(proc.stdout.readline())["state"]

            assert step("list") == "listed"
            await eventually(lambda: 9 in share.regions)
            region = share.listed_region(3)
            assert region is not None and region.cache_id == 9 and region.size == region.rows * region.row_bytes
            assert step("clear") == "cleared" and share.listed_region(3) is None
            assert step("other") == "another id" and share.listed_region(3) is None
            assert step("list") == "listed" and share.listed_region(3) is region
            assert not lost and not share.closed
        finally:
            share.close()

    try:
        loop.run_until_complete(run())
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
        loop.close()


@pytest.mark.asyncio
@pytest.mark.loops_take_turns
@pytest.mark.parametrize("observed", [False, True])
async def test_a_flood_of_read_reports_does_not_stall_the_owners_loop(observed):
    """A linked same-host peer sends READ records saying as many reads as a record may (MAX_READS), far more
    than the share socket's worth: the owner's loop keeps turning (every other link's heartbeats wait behind
    it), counts every read, and an observer (as metrics adds) still hears of each."""
    from aio_datadist.transport.local import _ENTRY, _READ, MAX_READS

    async with listed(21) as (pair, _values, _dst, _seen):
        theirs = usable_link(pair.decoder, PROMPT_ID).local  # the peer's end of the share socket
        assert theirs is not None
        owners = usable_link(pair.prompt, DECODER_ID)
        assert owners.local is not None
        cache_id = next(iter(owners.local.sent))
        from aio_datadist.metrics import _Observer

        metrics = _Observer("owner")  # what instrument() adds: it hears of each pull
        if observed:
            owners.counters.observers.append(metrics)
        gaps: list[float] = []

        async def ticker() -> None:
            last = time.perf_counter()
            for _ in range(2000):
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.ensure_future(ticker())
        try:
            await asyncio.sleep(0.05)
            for _ in range(30):
                theirs.sock.send(_ENTRY.pack(_READ, cache_id, 1 << 20, MAX_READS, 1, 0, 0))
            await asyncio.sleep(1.5)
        finally:
            tick.cancel()
            if observed:
                owners.counters.observers.pop()
        assert max(gaps) < 0.25, f"the owner's loop stalled {max(gaps):.2f} s on READ records"
        assert pair.prompt.stats().links[DECODER_ID].kinds["served_pull"].transfers == 30 * MAX_READS
        heard = sum(done.count for done in metrics.done.values())
        assert heard == (30 * MAX_READS if observed else 0) and owners.local is not None
        if observed:
            assert sum(done.bytes for done in metrics.done.values()) == 30 * (1 << 20)
        else:  # a record says at most MAX_READS: one that says more drops the share and is not counted
            theirs.sock.send(_ENTRY.pack(_READ, cache_id, 1 << 20, MAX_READS + 1, 1, 0, 0))
            for _ in range(400):
                if owners.local is None:
                    break
                await asyncio.sleep(0.005)
            assert owners.local is None, "a READ record of MAX_READS + 1 reads was taken"
            assert pair.prompt.stats().links[DECODER_ID].kinds["served_pull"].transfers == 30 * MAX_READS


@pytest.mark.asyncio
async def test_the_owner_acts_on_at_most_records_per_turn_read_records_each_turn():
    """Row 97's bounds themselves: records queued at once are acted on 16 a turn of the loop
    (``RECORDS_PER_TURN``), and each moves the counters and each observer once, whatever its count (an unbounded
    turn, and an observer told of each read, passed the flood tests: found by audit, 2026-12-07)."""
    from aio_datadist.transport.local import _ENTRY, _READ

    class Calls:
        def __init__(self) -> None:
            self.one, self.many = 0, []

        def transfer(self, *args) -> None:
            self.one += 1

        def transfers(self, cluster_id, kind, transport, count, nbytes, seconds) -> None:
            self.many.append(count)

        def link(self, *args) -> None:
            pass

    async with listed(22) as (pair, _values, _dst, _seen):
        theirs = usable_link(pair.decoder, PROMPT_ID).local
        owners = usable_link(pair.prompt, DECODER_ID)
        assert theirs is not None and owners.local is not None
        cache_id = next(iter(owners.local.sent))
        calls = Calls()
        owners.counters.observers.append(calls)

        def served() -> int:
            return pair.prompt.stats().links[DECODER_ID].kinds["served_pull"].transfers

        first, records = served(), 48
        for _ in range(records):  # all queued before the owner's loop turns again, 2 reads each
            theirs.sock.send(_ENTRY.pack(_READ, cache_id, 4096, 2, 1, 0, 0))
        counts = [served()]
        try:
            for _ in range(1000):  # one loop turn each: the share's reader runs at most once
                await asyncio.sleep(0)
                counts.append(served())
                if counts[-1] - first >= 2 * records:
                    break
        finally:
            owners.counters.observers.remove(calls)
        steps = [b - a for a, b in itertools.pairwise(counts)]
        assert counts[-1] - first == 2 * records and max(steps) <= 2 * 16, steps
        assert calls.one == 0 and calls.many == [2] * records, (calls.one, len(calls.many))


FLOODER = """
import socket, sys, time
from aio_datadist.transport.local import _ENTRY, _READ, MAX_READS
sock = socket.socket(fileno=int(sys.argv[1]))
record = _ENTRY.pack(_READ, int(sys.argv[2]), 1 << 20, MAX_READS, 1, 0, 0)
end = time.monotonic() + float(sys.argv[3])
sys.stdout.write("go\\n")
sys.stdout.flush()
while time.monotonic() < end:
    try:
        sock.send(record)
    except BlockingIOError:
        time.sleep(0.0002)
sock.detach()
"""


@pytest.mark.asyncio
@pytest.mark.loops_take_turns  # the ledger's catch-up, not the loop's I/O: one loop is enough
async def test_a_flood_of_read_reports_does_not_hold_a_synchronous_catch_up():
    """Another process keeps the share socket full of READ records for 3 s: the owner's own catch_up() (each
    read of the peer's caches without asking runs it, as region() and listed_region() read the queue too)
    returns in bounded time instead of reading for as long as the peer keeps sending."""
    async with listed(21) as (pair, _values, _dst, _seen):
        theirs = usable_link(pair.decoder, PROMPT_ID).local
        owners = usable_link(pair.prompt, DECODER_ID)
        assert theirs is not None and owners.local is not None
        cache_id = next(iter(owners.local.sent))

        from aio_datadist.metrics import _Observer

        owners.counters.observers.append(_Observer("owner"))  # what instrument() adds: it hears of each read
        fd = os.dup(theirs.sock.fileno())
        proc = subprocess.Popen([sys.executable, "-c", FLOODER, str(fd), str(cache_id), "3"], pass_fds=[fd],
                                stdout=subprocess.PIPE)
        os.close(fd)
        try:
            assert proc.stdout is not None and proc.stdout.readline() == b"go\n"
            time.sleep(0.2)  # the socket fills: nothing reads it meanwhile (the loop does not turn)
            t0 = time.perf_counter()
            owners.local.catch_up()
            took = time.perf_counter() - t0
        finally:
            proc.wait(10)
            assert proc.stdout is not None
            proc.stdout.close()
            owners.counters.observers.pop()
        assert took < 0.5, f"catch_up() held the loop {took:.2f} s while the peer flooded"
