"""A peer's memfd with holes inside and as many pages allocated past its end (row 253).

``st_blocks`` counts the pages a file holds past its end too (``fallocate`` with ``FALLOC_FL_KEEP_SIZE``), so
a region of holes passed row 148's "every page in memory" check, and our reads of its holes allocated each
page here. Such a region is now refused (``SEEK_HOLE``), and our own regions still pass.
"""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import mmap
import os
import socket
import struct

import pytest

from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMRole, LLMStatusCode, Placement
from aio_datadist.devices import host
from aio_datadist.transport import local
from aio_datadist.devices.host import HostRegion, check_sealed
from aio_datadist.testing import runtime_of, usable_link
from aio_datadist.transport.ledger import LEDGER_BYTES, Ledger
from peers import cluster_info, port_of

from _harness import endpoint

PAGE = mmap.PAGESIZE
SIZE = 64 * PAGE
FALLOC_FL_KEEP_SIZE = 1
PROMPT, DECODER = 1, 2
_libc = ctypes.CDLL(None, use_errno=True)


def _pages_past_the_end(fd: int, nbytes: int) -> None:
    """Allocate ``nbytes`` past the end of ``fd``, its size unchanged: ``st_blocks`` counts them."""
    size = os.fstat(fd).st_size
    if nbytes and _libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, ctypes.c_long(size), ctypes.c_long(nbytes)) != 0:
        pytest.skip(f"fallocate past the end: {os.strerror(ctypes.get_errno())}")


def _sealed_region(written: range, fallocated: range = range(0)) -> int:
    """A sealed memfd of SIZE bytes with only the pages ``written`` written and ``fallocated`` allocated, and
    as many pages past its end as it has holes: every one of its pages counted by ``st_blocks``."""
    fd = os.memfd_create("holes", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, SIZE)
    for page in written:
        os.pwrite(fd, b"x", page * PAGE)
    if fallocated:
        os.posix_fallocate(fd, fallocated.start * PAGE, len(fallocated) * PAGE)
    _pages_past_the_end(fd, SIZE - len(set(written) | set(fallocated)) * PAGE)
    host._seal(fd)
    return fd


@pytest.mark.parametrize("written, fallocated", [(range(0), range(0)), (range(0, 32), range(0)),
                                                 (range(1, 64), range(0)), (range(0), range(16, 48))],
                         ids=["all holes", "holes at the end", "one hole first", "half fallocated"])
def test_a_region_with_holes_is_refused_whatever_it_holds_past_its_end(written, fallocated):
    fd = _sealed_region(written, fallocated)
    try:
        assert os.fstat(fd).st_blocks * 512 >= SIZE  # what row 148's check read: "every page in memory"
        with pytest.raises(ValueError, match="has a hole"):
            check_sealed(fd, SIZE)
    finally:
        os.close(fd)


def test_a_region_whose_last_page_alone_is_a_hole_is_refused():
    """Every page written but the last: refused, naming that page (audit, 2026-12-07: the holes above all began
    at byte 0 or half way, and a check that let the last page go passed them)."""
    fd = _sealed_region(range(0, 63))
    try:
        assert os.fstat(fd).st_blocks * 512 >= SIZE
        with pytest.raises(ValueError, match=f"has a hole at byte {SIZE - PAGE} of its {SIZE}"):
            check_sealed(fd, SIZE)
    finally:
        os.close(fd)


def test_a_region_fallocated_but_not_written_is_refused():
    """``SEEK_HOLE`` calls pages fallocated but never written holes, and so does the check: a sender writes or
    populates its regions (ours are populated as mapped), so none of ours looks so."""
    fd = _sealed_region(range(0), range(0, 64))
    try:
        assert os.fstat(fd).st_blocks * 512 >= SIZE
        with pytest.raises(ValueError, match="has a hole at byte 0"):
            check_sealed(fd, SIZE)
    finally:
        os.close(fd)


@pytest.mark.parametrize("seal", ["none", "write", "future write"])
def test_a_filled_region_is_refused_unless_sealed_against_writes(seal):
    """A region with every page written is still refused unless it is sealed against writes (``F_SEAL_WRITE``
    or ``F_SEAL_FUTURE_WRITE``): unsealed, its sender could punch holes in it after our check. The tests above
    seal every region, and passed with that requirement dropped (audit, 2026-12-07)."""
    fd = os.memfd_create("filled", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, SIZE)
        os.pwrite(fd, b"\1" * SIZE, 0)
        write = {"none": 0, "write": fcntl.F_SEAL_WRITE, "future write": host.F_SEAL_FUTURE_WRITE}[seal]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | write)
        if seal == "none":
            with pytest.raises(ValueError, match="not sealed against writes"):
                check_sealed(fd, SIZE)
        else:
            check_sealed(fd, SIZE)
    finally:
        os.close(fd)


def test_a_peers_ledger_and_device_export_with_holes_are_refused():
    """Row 148's other two regions, each mapped by a check of its own: a peer's ledger (``PeerLedger``) and a
    device export on the host backend (``HostBackend.ipc_import``), sealed but holes, are refused before they are
    mapped (the tests above check only ``check_sealed``; either region passed with its call of it gone)."""
    from aio_datadist.devices.host_backend import HostBackend
    from aio_datadist.transport.ledger import PeerLedger

    ledger_fd = os.memfd_create("ledger", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    export_fd = _sealed_region(range(0))
    try:
        os.ftruncate(ledger_fd, LEDGER_BYTES)  # never written: not one page in memory
        host._seal(ledger_fd)
        with pytest.raises(ValueError, match="in memory"):
            PeerLedger(ledger_fd)
        with pytest.raises(ValueError, match="has a hole"):
            HostBackend.ipc_import(HostBackend.__new__(HostBackend), HostBackend.kind, b"", export_fd, SIZE)
    finally:
        os.close(ledger_fd)
        os.close(export_fd)


def test_our_own_regions_pass():
    """Our caches' regions and ledger are populated as they are mapped: no hole, any size."""
    ledger = Ledger()
    try:
        check_sealed(ledger.fd, LEDGER_BYTES)
        for nbytes in (PAGE, SIZE, 1 << 20):
            region = HostRegion(nbytes)
            check_sealed(region.fd, region.nbytes)
    finally:
        ledger.close()


@pytest.mark.asyncio
async def test_a_peer_cache_of_holes_with_pages_past_its_end_is_not_shared(monkeypatch):
    """The peer's cache is never written nor populated, and its memfd has as many pages past its end: the
    share is dropped at its record, and the peer's push goes over TCP."""
    def seal_with_pages_past_the_end(fd: int) -> None:
        _pages_past_the_end(fd, os.fstat(fd).st_size)
        real_seal(fd)

    desc = CacheDesc(1, (16, PAGE), DataType.DT_UINT8, Placement.HOST)
    real_seal = host._seal
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="auto") as prompt, \
            endpoint(LLMRole.DECODER, DECODER, transport="auto") as decoder:
        with monkeypatch.context() as patch:
            patch.setattr(host, "_POPULATE", 0)
            patch.setattr(host, "_seal", seal_with_pages_past_the_end)
            src = prompt.kv_cache_manager.allocate_blocks_cache(desc)
        assert os.lseek(src.region.fd, 0, os.SEEK_HOLE) == 0
        dst = decoder.kv_cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(DECODER, 0))
        dst.tensors[0].fill_(7)
        assert await decoder.link_clusters([cluster_info(PROMPT, port_of(prompt))], timeout=5000) == (
            LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
        await prompt.kv_cache_manager.push_blocks(BlocksCacheKey(DECODER, 0), src, [0, 1], [0, 1], timeout=5000)
        assert dst.tensors[0][:2].count_nonzero() == 0 and dst.tensors[0][2:].eq(7).all()
        assert usable_link(decoder, PROMPT).local is None  # dropped at the record


# -- what the check costs the loop (row 266) ---------------------------------------------------------------------

ENTRY = struct.Struct("!BqQIQQQ")
READABLE = struct.Struct("!IQBQ")


def _populated(size: int) -> int:
    fd = os.memfd_create("peer", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.pwrite(fd, bytes(size), 0)
    host._seal(fd)
    return fd


def _add(cache_id: int, size: int) -> bytes:
    """An ADD record of one tensor of one row covering a region of ``size`` bytes, asking by control."""
    return ENTRY.pack(1, cache_id, size, 1, 1, size, size) + struct.pack("!Q", 0) + READABLE.pack(
        local.NO_SLOT, 0, 1, 0)


@pytest.fixture
def walks(monkeypatch) -> list[int]:
    """The sizes of the regions whose pages a check walked."""
    walked: list[int] = []
    real = host._held

    def counted(fd: int, size: int) -> int:
        walked.append(size)
        return real(fd, size)

    monkeypatch.setattr(host, "_held", counted)
    return walked


@pytest.mark.asyncio(loop_factories=["asyncio"])  # no loop of its own: the share's synchronous reads
async def test_a_region_sent_again_is_not_walked_again(walks):
    """A peer re-sending the record of one populated region (the walk costs about 13 ms per GiB) under one cache
    id or another: each record walked the file again, on the loop (a 1 GiB region, 100 records read at once by
    a lookup: about a second held). A file the share maps passed already and can get no hole."""
    fd = _populated(SIZE)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    share = local.LocalShare(ours, lambda: None)
    try:
        asyncio.get_running_loop().remove_reader(ours.fileno())  # the records wait, read by the lookup below
        for cache_id in [7] * 20 + [8, 9, 7]:
            socket.send_fds(theirs, [_add(cache_id, SIZE)], [fd])
        assert share.region(999) is None  # reads what is queued
        assert sorted(share.regions) == [7, 8, 9]
        assert walks == [SIZE]
        other = _populated(SIZE)
        socket.send_fds(theirs, [_add(10, SIZE)], [other])
        os.close(other)
        assert share.region(10) is not None and walks == [SIZE, SIZE]  # another file is walked
        for cache_id in (7, 8, 9):  # withdrawn: the share maps the first file no more, and walks it again
            theirs.send(ENTRY.pack(2, cache_id, 0, 0, 0, 0, 0))
        socket.send_fds(theirs, [_add(11, SIZE)], [fd])
        assert share.region(11) is not None and walks == [SIZE, SIZE, SIZE]
    finally:
        share.close()
        theirs.close()
        os.close(fd)


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_one_turn_walks_a_bounded_number_of_bytes(walks, monkeypatch):
    """Records of different big regions: a loop turn stops once its checks walked ``WALK_PER_TURN`` bytes and
    reads the rest next turn (before, 16 records of 1 GiB regions: a quarter of a second held)."""
    monkeypatch.setattr(local, "WALK_PER_TURN", 2 * SIZE)
    fds = [_populated(SIZE) for _ in range(6)]
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    share = local.LocalShare(ours, lambda: None)
    try:
        share._loop.remove_reader(ours.fileno())
        for cache_id, fd in enumerate(fds, 1):
            socket.send_fds(theirs, [_add(cache_id, SIZE)], [fd])
        share._readable(local.RECORDS_PER_TURN, False, local.WALK_PER_TURN)  # one turn of the share's reader
        assert len(walks) == 2 and len(share.regions) == 2
        share._readable(local.RECORDS_PER_TURN, False, local.WALK_PER_TURN)
        assert len(walks) == 4
        assert share.region(6) is not None and len(walks) == 6  # a synchronous read is not bounded by it
    finally:
        share.close()
        theirs.close()
        for fd in fds:
            os.close(fd)


# -- and of a device export on the host backend (ADD_DEVICE records) ----------------------------------------------

DEVICE = struct.Struct("!B16s")
HOST_KIND = 1  # the host backend's code in the record's trailer


def _add_device(cache_id: int, size: int) -> bytes:
    """An ADD_DEVICE record of one tensor of one row covering a host-backend export of ``size`` bytes."""
    return ENTRY.pack(4, cache_id, size, 1, 1, size, size) + struct.pack("!Q", 0) + DEVICE.pack(HOST_KIND, bytes(16))


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_device_export_sent_again_is_not_walked_again(walks):
    """As a region's record: each re-sent record of one populated export walked its file again (16 records of
    a 1 GiB export: 0.11 s held; a lookup reading 278 queued: 1.5 s), and added nothing to the turn's bound."""
    fd = _populated(SIZE)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    async with endpoint(LLMRole.DECODER, DECODER, device_type="host") as decoder:
        share = local.LocalShare(ours, lambda: None, runtime_of(decoder).devices)
        try:
            share._loop.remove_reader(ours.fileno())  # the records wait, read by the lookup below
            for cache_id in [7] * 20 + [8, 9, 7]:
                socket.send_fds(theirs, [_add_device(cache_id, SIZE)], [fd])
            assert share.device_region(999) is None  # reads what is queued
            assert sorted(share.device_regions) == [7, 8, 9]
            assert walks == [SIZE]
            for cache_id in (7, 8, 9):  # withdrawn: the file is no longer mapped here, and is walked again
                theirs.send(ENTRY.pack(2, cache_id, 0, 0, 0, 0, 0))
            socket.send_fds(theirs, [_add_device(10, SIZE)], [fd])
            assert share.device_region(10) is not None and walks == [SIZE, SIZE]
            socket.send_fds(theirs, [_add(11, SIZE)], [fd])  # as a region: counted apart, walked (row 304)
            assert share.region(11) is not None and walks == [SIZE, SIZE, SIZE]
        finally:
            share.close()
            theirs.close()
            os.close(fd)


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_one_turn_walks_a_bounded_number_of_device_export_bytes(walks, monkeypatch):
    monkeypatch.setattr(local, "WALK_PER_TURN", 2 * SIZE)
    fds = [_populated(SIZE) for _ in range(6)]
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    async with endpoint(LLMRole.DECODER, DECODER, device_type="host") as decoder:
        share = local.LocalShare(ours, lambda: None, runtime_of(decoder).devices)
        try:
            share._loop.remove_reader(ours.fileno())
            for cache_id, fd in enumerate(fds, 1):
                socket.send_fds(theirs, [_add_device(cache_id, SIZE)], [fd])
            share._readable(local.RECORDS_PER_TURN, False, local.WALK_PER_TURN)  # one turn of the share's reader
            assert len(walks) == 2 and len(share.device_regions) == 2
            share._readable(local.RECORDS_PER_TURN, False, local.WALK_PER_TURN)
            assert len(walks) == 4
            assert share.device_region(6) is not None and len(walks) == 6  # a synchronous read is not bounded
        finally:
            share.close()
            theirs.close()
            for fd in fds:
                os.close(fd)
