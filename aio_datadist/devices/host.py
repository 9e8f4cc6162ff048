"""Page-aligned, shareable host memory for caches.

Host caches live in an anonymous memory file (``memfd``) mapped into the
process, so their memory is page-aligned (block copies into unaligned memory
measured about 3x slower here) and can later be handed to a same-host peer
by passing its file descriptor.

The memfd is sealed right after it is sized and mapped: against shrinking
and growing (a peer holding the fd cannot truncate it and make our own
accesses fault with SIGBUS), against every future write or writable mapping
(``F_SEAL_FUTURE_WRITE``: only the mapping made here stays writable, so any
fd a peer receives is read-only whatever it does with it), and against
changing the seals. The region keeps only a read-only open of the file
(:attr:`HostRegion.fd`), which is what peers receive.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import mmap
import os
import stat
import threading
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch

from aio_datadist.devices.headroom import memory_headroom
from aio_datadist.devices.unmapping import Unmapper

__all__ = ["HostRegion", "PAGE_SIZE", "ReadOnlyMapping", "SEALS_REQUIRED", "check_sealed", "file_of", "map_read_only",
           "round_up", "map_writable", "seal_names", "sealed_memfd", "tensor_at", "unmap", "unmap_read_only",
           "drop_read_only", "unmapped_in_background", "take_peer_mapping", "give_back_peer_mapping",
           "when_room", "peer_room"]

PAGE_SIZE = mmap.PAGESIZE
#: What an allocation leaves of the memory it may populate (``devices/headroom.py``), beside its page tables.
POPULATE_SLACK = 16 << 20
#: How long a room read stays good (spent by the allocations meanwhile), and the longest a refusal waits for the
#: frees queued on the unmapping thread (about 0.2 ms per MiB).
ROOM_TTL_S = 0.05
UNMAP_WAIT_S = 2.0
#: When the room was read (``time.monotonic``), the room then less what was allocated since, and what bounds it.
_room: list = [float("-inf"), 0, ""]
_populating: list[int] = []  # what allocations that are populating now reserved (not in the usage yet)
_room_lock = threading.Lock()
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
Mapped = TypeVar("Mapped")
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1; not named by Python 3.11
#: The most bytes of peers' memory this process maps at once, all peers and links together: a quarter of the
#: 128 TiB a process can map. One peer may send 4096 regions of 1 TiB (``transport/local.py``), and sparse
#: memfds of that size cost it nothing; mapped, they left us no address space for our own allocations.
MAX_PEER_MAPPED_BYTES = 1 << 45


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


#: The most peers' regions this process maps at once, all peers and links together: a quarter of
#: ``vm.max_map_count``. One peer may map 4096 (``transport/local.py``); 16 of them left us no mapping for our own.
MAX_PEER_MAPPINGS = _max_map_count() // 4
_peer_mapped = 0
_peer_mappings = 0
_peer_mapped_lock = threading.RLock()  # a region's __del__ may run on any thread, even inside map_read_only
_room_hooks: list[Callable[[], None]] = []  # when_room
#: What a receiver demands of a shared memfd: its size can no longer change.
SEALS_REQUIRED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_SEALS = SEALS_REQUIRED | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
_SEAL_NAMES = ((fcntl.F_SEAL_SEAL, "seal"), (fcntl.F_SEAL_SHRINK, "shrink"), (fcntl.F_SEAL_GROW, "grow"),
               (fcntl.F_SEAL_WRITE, "write"), (F_SEAL_FUTURE_WRITE, "future-write"))


def seal_names(seals: int) -> str:
    """``seals`` as words, for messages."""
    return ",".join(name for bit, name in _SEAL_NAMES if seals & bit) or "none"


def round_up(n: int, align: int = PAGE_SIZE) -> int:
    return (n + align - 1) // align * align


def _reserve_room(nbytes: int, into: list[int]) -> None:
    """Reserve room to populate ``nbytes`` (what :func:`_release_room` gives back once they are populated, or not),
    or refuse (``MemoryError``) past what the process may populate (``devices/headroom.py``): the OOM killer would
    kill the process instead of refusing. The room read is kept ``ROOM_TTL_S`` and spent by the allocations
    meanwhile, unless a request is a good part of it; a fresh read leaves out what other allocations are still
    populating (not in the usage yet, or only in part: counted whole, the check errs toward refusing while two
    allocations overlap); a refusal first waits for the big frees already handed to the unmapping thread (a cache
    freed just before still counts until it ran). The reservation is appended to ``into`` under the lock, so that
    an interrupt cannot leave it counted with no one to give it back."""
    need = nbytes + nbytes // 256 + POPULATE_SLACK  # its page tables, and some slack
    with _room_lock:
        now = time.monotonic()
        if now - _room[0] > ROOM_TTL_S or need * 8 > _room[1]:
            _read_room(now)
        if need > _room[1] and _unmapper.wait_idle(UNMAP_WAIT_S):
            _read_room(time.monotonic())
        room, bound = _room[1], _room[2]
        if need > room:
            raise MemoryError(f"{nbytes} bytes requested, {room} bytes {bound}")
        _room[1] = room - need
        into.append(need)  # first: an interrupt between the two leaves nothing counted that is not given back
        _populating.append(need)


def _read_room(now: float) -> None:
    room, bound = memory_headroom()
    _room[:] = [now, room - sum(_populating), bound]


def _release_room(reserved: list[int]) -> None:
    """Give back what :func:`_reserve_room` reserved into ``reserved`` (no lock: ``list.remove`` is one step,
    which an interrupt cannot split)."""
    while reserved:
        with contextlib.suppress(ValueError):  # a fork child's list starts empty
            _populating.remove(reserved.pop())


class HostRegion:
    """One memfd-backed mapping, carved into page-aligned tensors."""

    __slots__ = ("nbytes", "_fd", "_map", "_base", "__weakref__")

    def __init__(self, nbytes: int, name: str = "aio_datadist") -> None:
        self.nbytes = max(round_up(nbytes), PAGE_SIZE)
        self._fd = -1
        reserved: list[int] = []

        def populate(fd: int) -> int:
            address = map_writable(fd, self.nbytes)
            _release_room(reserved)  # in the usage now: before the seals
            return address

        # Populated now (map_writable): a cache's first transfer should not pay page faults. Not mmap.mmap: it
        # keeps a writable fd of the file open for as long as the mapping lives, that is for as long as any of
        # the cache's tensors does, long after the cache is freed. The mapping goes with the last tensor.
        try:
            _reserve_room(self.nbytes, reserved)
            address, self._fd = sealed_memfd(self.nbytes, name, populate, lambda addr: unmap(addr, self.nbytes))
        finally:
            _release_room(reserved)  # not populated after all
        self._map = (ctypes.c_uint8 * self.nbytes).from_address(address)
        unmap_it = functools.partial(unmap, address, self.nbytes)
        mapped = weakref.finalize(self._map, _unmapper.free, self.nbytes, unmap_it)
        mapped.atexit = False  # tensors may outlive atexit
        self._base = torch.frombuffer(self._map, dtype=torch.uint8)
        _unmapper.start()  # here, not in the finalizer: that may run inside any allocation, a collection's

    @property
    def fd(self) -> int:
        """The sealed memfd, opened read-only: what a same-host peer receives."""
        return self._fd

    @property
    def address(self) -> int:
        return self._base.data_ptr()

    @property
    def base(self) -> torch.Tensor:
        """The whole region as one uint8 tensor: holding it (or any view) keeps the memory mapped."""
        return self._base

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A view of ``shape``/``dtype`` starting ``offset`` bytes into the region."""
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        return self._base[offset:offset + nbytes].view(dtype).view(shape)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            # The region holds its mapping (``_map``), so the mapping still holds the file: closing costs nothing.
            os.close(fd)
            self._fd = -1


_unmapper = Unmapper()


def _after_fork_in_child() -> None:
    global _peer_mapped_lock, _room_lock, _populating
    _peer_mapped_lock = threading.RLock()  # the parent's may be held by a thread that is not here
    _room_lock = threading.Lock()
    _room[:] = [float("-inf"), 0, ""]
    _populating = []  # the parent's threads that were populating are not here
    _unmapper.after_fork_in_child()  # which may unmap peers' regions: under that lock


os.register_at_fork(before=_unmapper.before_fork, after_in_parent=_unmapper.after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


def unmapped_in_background(timeout_s: float = 5.0) -> bool:
    """Whether the big host regions whose last tensor went are unmapped by now (waiting ``timeout_s`` at most)."""
    return _unmapper.wait_idle(timeout_s)


def sealed_memfd(nbytes: int, name: str, map_it: Callable[[int], Mapped],
                 unmap_it: Callable[[Mapped], object] | None = None) -> tuple[Mapped, int]:
    """A memfd of ``nbytes`` (a multiple of the page size) mapped writable here by ``map_it(fd)``, then sealed:
    what ``map_it`` returned, and a read-only fd of the file (what peers receive). Should sealing fail, the
    mapping is undone by ``unmap_it`` (or left to the collector)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    ro = -1
    try:
        os.ftruncate(fd, nbytes)
        mapped = map_it(fd)
        try:
            _seal(fd)
            ro = _read_only(fd)
        except BaseException:
            if unmap_it is not None:
                unmap_it(mapped)
            raise
    finally:
        if ro != fd:
            os.close(fd)
    return mapped, ro


def map_writable(fd: int, size: int) -> int:
    """Map ``size`` bytes of our own memfd ``fd`` shared, readable and writable, populated; the address. Unlike
    ``mmap.mmap`` it keeps no fd of its own open. Undo with :func:`unmap`."""
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _POPULATE, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"cannot map a memfd: {os.strerror(err)}")
    return int(addr)


def _seal(fd: int) -> None:
    """Freeze the size and forbid new writers; the mapping already made stays writable."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except OSError:
        # A kernel before 5.1 knows no F_SEAL_FUTURE_WRITE: peers then rely on the read-only fd.
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS_REQUIRED | fcntl.F_SEAL_SEAL)


def _read_only(fd: int) -> int:
    """A read-only open of the memfd ``fd`` (the writable one is closed once mapped), or ``fd``
    itself where /proc is missing (the seals still forbid new writers). Out of fds it raises: keeping the
    writable fd would hand peers a read-write fd of the cache."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise
        return fd


def tensor_at(address: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Wrap caller-owned host memory at ``address`` as a tensor (no copy)."""
    count = 1
    for dim in shape:
        count *= dim
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    raw = (ctypes.c_uint8 * nbytes).from_address(address)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape)


def check_sealed(fd: int, size: int, *, whole: bool = False) -> None:
    """``fd`` must be a memfd of exactly ``size`` bytes in ordinary shared memory (shmem), sealed against shrink,
    grow and writes, every page of it in memory (or swap); ValueError else.

    The last two because a hole costs its sender nothing and us a page: a read of a hole through our mapping
    allocates the page (in our process, our memory cgroup) for as long as the sender keeps the file, so a peer
    whose region was all holes, pushing from ever other rows, grew our memory by each push's volume. A file
    sealed against writes can get no hole later (the kernel refuses to punch one). ``st_blocks`` alone does not
    tell: it also counts pages allocated past the end (``fallocate`` with ``FALLOC_FL_KEEP_SIZE``), so a region
    of holes with as many pages past its end passed it; the pages before the end are counted (:func:`_held`).

    That walk costs about 13 ms per GiB here: ``whole`` skips it for a file the caller knows passed it (a file
    it still maps, which can get no hole).
    """
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise ValueError("fd is not a memory file")
    fs = fs_magic(fd)
    if fs != TMPFS_MAGIC:
        # A hugetlbfs memfd (MFD_HUGETLB) takes the seals too, but its sender can still punch holes in it
        # (fallocate); once the host's huge pages are spent, our read of a hole faults with SIGBUS.
        what = "hugetlbfs (MFD_HUGETLB)" if fs == HUGETLBFS_MAGIC else f"a file system of magic {fs:#x}"
        raise ValueError(f"fd is a memfd on {what}, not in ordinary shared memory")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise ValueError(f"fd is not a sealable memfd ({exc.strerror})") from None
    if seals & SEALS_REQUIRED != SEALS_REQUIRED:
        raise ValueError(f"fd is not sealed against shrink and grow (seals: {seal_names(seals)})")
    if not seals & (fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE):
        raise ValueError(f"fd is not sealed against writes, so it can get holes (seals: {seal_names(seals)}); "
                         "same-host sharing needs Linux 5.1 or later at both ends")
    # The size only now: sealed, it can no longer change. Read before the seals, it could be changed in between
    # by the sender, which still holds the fd (a shrink, then the seals), and we would map past the file's end.
    st = os.fstat(fd)
    if st.st_size != size:
        raise ValueError(f"fd holds {st.st_size} bytes, the record declares {size}")
    if st.st_blocks * 512 < size:  # st_blocks: 512-byte units of the file's pages in memory (or swap)
        raise ValueError(f"fd has {st.st_blocks * 512} of its {size} bytes in memory: reading its holes would "
                         "allocate them here")
    if whole:
        return
    held = _held(fd, size)
    if held < size:
        raise ValueError(f"fd has a hole at byte {held} of its {size}: reading its holes would allocate them here")


def file_of(fd: int) -> tuple[int, int]:
    """Which file ``fd`` is (device, inode): unique among the files alive."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _held(fd: int, size: int) -> int:
    """``size`` if the shmem file ``fd`` holds every page of its first ``size`` bytes (written, in memory or
    swap), else where its first hole is. A page fallocated but never written counts as a hole (``SEEK_HOLE``
    says so): a sender's regions are written or populated as they are mapped (ours are, ``MAP_POPULATE``)."""
    try:
        hole = os.lseek(fd, 0, os.SEEK_HOLE)
    except OSError as exc:
        raise ValueError(f"fd cannot be searched for holes ({exc.strerror})") from None
    return min(hole, size)


#: ``statfs.f_type`` of shmem (every memfd without ``MFD_HUGETLB``) and of hugetlbfs.
TMPFS_MAGIC = 0x01021994
HUGETLBFS_MAGIC = 0x958458F6


def fs_magic(fd: int) -> int:
    """The ``f_type`` of the file system ``fd`` lives on (``fstatfs``; Python has none); OSError if it fails."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
    if _libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fstatfs: {os.strerror(err)}")
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


class ReadOnlyMapping:
    """``size`` bytes of a (checked) memfd mapped ``PROT_READ`` here; unmapped at :meth:`close` or collection.

    Copies in flight keep it alive through their keepalives, and so does every
    tensor :meth:`view` made, so :meth:`close` only forgets the address; the
    mapping goes with the last reference.
    """

    __slots__ = ("address", "nbytes", "_addr", "__weakref__")

    def __init__(self, fd: int, size: int) -> None:
        self._addr = 0
        self.nbytes = size
        self._addr = self.address = map_read_only(fd, size)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        if not self._addr or offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError("view outside the mapping")
        raw = (ctypes.c_uint8 * nbytes).from_address(self._addr + offset)
        setattr(raw, "mapping", self)  # noqa: B010 -- the view keeps the mapping: its tensor holds ``raw``
        return torch.frombuffer(raw, dtype=torch.uint8)

    def close(self) -> None:
        self.address = 0

    def __del__(self) -> None:
        if getattr(self, "_addr", 0):
            addr, self._addr = self._addr, 0
            drop_read_only(addr, self.nbytes)


def take_peer_mapping(size: int) -> None:
    """Count one mapping of ``size`` bytes of a peer's memory against the process-wide budget; ``OSError``
    (``ENOMEM``) when peers' mappings would then take more than ``MAX_PEER_MAPPED_BYTES`` or
    ``MAX_PEER_MAPPINGS``, with nothing taken. What maps a peer's memory other than :func:`map_read_only` (a
    CUDA import, ``devices/cuda_vmm.py``) takes it here and gives it back with :func:`give_back_peer_mapping`
    once its mapping is gone (or was never made)."""
    global _peer_mapped, _peer_mappings
    with _peer_mapped_lock:
        if _peer_mapped + size > MAX_PEER_MAPPED_BYTES or _peer_mappings >= MAX_PEER_MAPPINGS:
            raise OSError(errno.ENOMEM, f"cannot map a peer region of {size} bytes: peers' regions mapped here "
                          f"would take more than {MAX_PEER_MAPPED_BYTES} bytes or {MAX_PEER_MAPPINGS} mappings")
        _peer_mapped += size
        _peer_mappings += 1


def give_back_peer_mapping(size: int, *, room: bool = True) -> None:
    """Give back what :func:`take_peer_mapping` took for a mapping of ``size`` bytes, and tell the hooks of
    :func:`when_room` (``room``: a mapping that was made is gone, not one that failed)."""
    global _peer_mapped, _peer_mappings
    with _peer_mapped_lock:
        _peer_mapped -= size
        _peer_mappings -= 1
    if room:
        for hook in _room_hooks:
            hook()


def when_room(hook: Callable[[], None]) -> None:
    """Call ``hook()`` each time a peer's mapping gives its budget back (on whichever thread unmapped it: the
    hook must be quick and thread-safe, and must not raise)."""
    _room_hooks.append(hook)


def peer_room() -> tuple[int, int]:
    """How many more peers' mappings, and of how many bytes in all, this process may make now."""
    return max(0, MAX_PEER_MAPPINGS - _peer_mappings), max(0, MAX_PEER_MAPPED_BYTES - _peer_mapped)


def map_read_only(fd: int, size: int) -> int:
    """Map ``size`` bytes of a peer's ``fd`` shared and read-only; the address (``OSError`` if refused, also
    when peers' mappings would take more than ``MAX_PEER_MAPPED_BYTES`` or ``MAX_PEER_MAPPINGS``). Undo with
    :func:`unmap_read_only`."""
    _unmapper.start()
    with _peer_mapped_lock:
        take_peer_mapping(size)
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            give_back_peer_mapping(size, room=False)
            raise OSError(err, f"cannot map a peer region: {os.strerror(err)}")
        return int(addr)


def unmap_read_only(addr: int, size: int) -> None:
    """Undo :func:`map_read_only`; the budget is given back once the mapping is gone."""
    unmap_peer(addr, size)
    give_back_peer_mapping(size)


def unmap_peer(addr: int, size: int) -> None:
    """The unmap of :func:`unmap_read_only` alone (it takes no lock: a fork may wait for it)."""
    _libc.munmap(addr, size)  # not under the lock: 55 ms for 1 GiB of read pages


def drop_read_only(addr: int, size: int) -> None:
    """Undo :func:`map_read_only` where the mapping's last reference goes (a ``__del__``): a small one at once, a big
    one on the unmapping thread, so that it costs the thread that drops it nothing."""
    # its pages are the peer's, but tearing the mapping down still costs: 55 ms for 1 GiB of read pages
    _unmapper.free(size, functools.partial(unmap_peer, addr, size), functools.partial(give_back_peer_mapping, size))


def unmap(addr: int, size: int) -> None:
    """Undo :func:`map_writable`."""
    _libc.munmap(addr, size)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value
