"""Share records, fuzzed: every byte string is a valid record or a ``ShareError`` (issue 14, point 5).

The in-process half drives :func:`aio_datadist.transport.local.parse_record`
with generated and mutated records and checks the property that matters: a
record that passes declares only tensors inside its region, with a geometry
that multiplies out. The live half sends a real :class:`LocalShare` the same
mutations from a separate process over a real SEQPACKET socket, with real
memfds (sealed, unsealed, resized), and checks that the share either maps a
region the fd really holds or drops the share, with no exception in the
loop and every fd closed exactly once.
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import random
import socket
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_datadist.transport import ledger, local
from aio_datadist.transport.local import LocalShare, ShareError, parse_record

from _harness import open_fds
from _share_attacker import generated
from _tally import count

PAGE = mmap.PAGESIZE
SEED = 1414
CASES = 4000
MESSAGES = 25
ATTACKER = os.path.join(os.path.dirname(__file__), "_share_attacker.py")


def check_accepted(rec: local.ShareRecord, nfds: int, flags: int) -> None:
    assert flags == 0
    if rec.kind in (local._DEL, local._READY, local._READ, local._MAPPED, local._UNMAPPED):
        assert nfds == 0
        return
    if rec.kind == local._ROOM:
        assert nfds == 0 and 0 < rec.size <= local.MAX_REGIONS
        return
    if rec.kind == local._LEDGER:
        assert nfds == 1 and rec.size == ledger.LEDGER_BYTES
        return
    assert rec.kind == local._ADD and nfds == 1 and rec.cache_id >= 1
    assert 0 < rec.size <= local.MAX_REGION_BYTES and rec.size % PAGE == 0
    assert rec.rows > 0 and rec.row_bytes > 0 and rec.rows * rec.row_bytes == rec.tensor_bytes
    assert 0 < len(rec.offsets) <= local.MAX_TENSORS
    assert all(0 <= o and o + rec.tensor_bytes <= rec.size for o in rec.offsets)
    assert rec.slot == ledger.NO_SLOT or 0 <= rec.slot < ledger.SLOTS


def test_every_generated_share_record_is_valid_or_refused():
    rng = random.Random(SEED)
    accepted = 0
    for _ in range(CASES):
        data, nfds, flags = generated(rng)
        try:
            rec = parse_record(data, nfds, flags)
        except ShareError:
            continue
        check_accepted(rec, nfds, flags)
        accepted += 1
    assert 0 < accepted < CASES  # both sides of the check were exercised
    count("share records fuzzed (in-process)", CASES)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=200), nfds=st.integers(0, 3), flags=st.sampled_from([0, socket.MSG_CTRUNC]))
def test_any_bytes_are_a_valid_share_record_or_refused(data, nfds, flags):
    try:
        rec = parse_record(data, nfds, flags)
    except ShareError:
        return
    check_accepted(rec, nfds, flags)


@pytest.mark.asyncio
async def test_a_live_share_maps_only_what_the_fd_holds_or_drops_the_peer():
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    before = open_fds()
    rng = random.Random(SEED)
    rounds, dropped = 30, 0
    mapped = []

    def checked(share: LocalShare):
        apply = share._apply

        def run(rec: local.ShareRecord, fds: list[int]) -> None:
            apply(rec, fds)
            region = share.regions.get(rec.cache_id) if rec.kind == local._ADD else None
            if region is not None:  # an assertion here escapes the loop callback and fails the test
                assert all(o + region.tensor_bytes <= region.size for o in region.offsets)
                # The fd really holds the region: touching its last byte would raise SIGBUS otherwise.
                assert len(ctypes.string_at(region.base + region.size - 1, 1)) == 1
                mapped.append(rec.cache_id)
        return run

    try:
        for _ in range(rounds):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            lost = loop.create_future()
            share = LocalShare(ours, on_lost=lambda f=lost: f.done() or f.set_result(None))
            share._apply = checked(share)
            proc = subprocess.Popen([sys.executable, ATTACKER, "fuzz", str(theirs.fileno()), str(rng.randrange(2**32)),
                                     str(MESSAGES)], pass_fds=[theirs.fileno()])
            theirs.close()
            try:
                while proc.poll() is None:
                    await asyncio.sleep(0.01)
                await asyncio.wait([lost], timeout=1.0)
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            dropped += share.closed
            share.close()
        assert errors == []
        assert dropped > 0 and mapped
        assert open_fds() == before  # every fd received was closed, once
        count("share records fuzzed (live socket)", rounds * MESSAGES)
    finally:
        loop.set_exception_handler(None)
