"""Same-host transport: peers read each other's cache memory instead of streaming it.

Allocated caches live in sealed memfd regions (``devices/host.py``). When
both ends of a link run on one kernel (same boot id), the client connects to
the server's abstract unix socket and both prove the link's secret there
(see :class:`LocalListener`). From then on each end sends the other one
record per shareable cache, with a read-only memfd attached (SCM_RIGHTS):
cache id, region size and geometry. The receiving end checks the record
against the fd (its size, its seals) before it maps the region, read-only.
The first record of each end is its read ledger (``LEDGER``,
``transport/ledger.py``): a cache's record names its slot there, and a pull
that read a listed cache without asking is reported back (``READ``).

The receiver answers every cache record: ``MAPPED``, or ``UNMAPPED`` when
this process may map no more of its peers' regions (``devices.host``'s
budget, shared by all its peers, spent). An owner serves a cache in place
only once the peer answered ``MAPPED`` for it; one refused is served over
the data channels and the share stays (before, such a region dropped the
whole share of an honest owner). Once the budget has room again, the
receiver says how much (``ROOM``, at most once per ``ROOM_EVERY_S``) and the
owner offers that many of its refused caches again.

Every copy reads the peer's memory and writes our own: a pull is the
requester copying from the owner's region into its cache, a push is the
owner copying from the pusher's region into its cache. No peer ever holds a
writable view of our memory. Registered framework tensors are not
memfd-backed: requests touching them take the TCP data channels.

Device caches the library allocated on a backend that exports them
(``devices/ipc.py``) go the same way with a record of their own
(``ADD_DEVICE``: the geometry, the backend kind and the device's identity,
and the export's fd): the receiver maps the export read-only through its own
device backend and answers ``MAPPED``, and only caches the peer answered
for are served by device IPC (``transport/device_ipc.py``). When it cannot
map them (no backend, another kind of device, no P2P between the GPUs, a
driver or VM that refuses), it says why once per link at INFO and the
link's device caches keep taking the staging plane; an export that does not
hold what its record declares drops the share, as a bad memfd does.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import dataclasses
import errno
import functools
import hashlib
import hmac
import logging
import mmap
import os
import socket
import struct
import time
import weakref
from collections import deque
from collections.abc import Callable, Container, Iterable
from typing import TYPE_CHECKING, Any

from aio_datadist import _core
from aio_datadist.devices.host import SEALS_REQUIRED as SEALS_REQUIRED  # what share tests check fds against
from aio_datadist.devices.host import check_sealed, drop_read_only, file_of, map_read_only, peer_room, when_room
from aio_datadist.devices.ipc import IDENTITY_BYTES, ExportInvalid, IpcUnavailable
from aio_datadist.devices.peer_cache import PeerDeviceCache
from aio_datadist.fd_budget import ACCEPT_GONE, ACCEPT_RETRY_S, close_listening
from aio_datadist.refusal_log import RefusalLog
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.transport.fit import Geometry, geometry_of
from aio_datadist.transport.ledger import LEDGER_BYTES, NO_SLOT, SLOTS, Ledger, PeerLedger

if TYPE_CHECKING:
    from aio_datadist.cache import KvCache
    from aio_datadist.devices.backend import DeviceBackend

__all__ = ["LocalListener", "LocalShare", "PeerRegion", "ShareError", "ShareRecord", "boot_id", "connect_share",
           "parse_record", "share_proof"]

log = logging.getLogger("aio_datadist.local")
#: Shares dropped for a record that could not be taken (a linked peer's doing, at will): paced.
_BAD_RECORDS = RefusalLog(log, "more dropped")

# The share connection's authentication: server nonce, then the client's nonce and proof, then the server's proof.
_MAGIC = b"AIDS"
SHARE_VERSION = 4  # 2: the read ledger (LEDGER and READ records, ADD's readable trailer); 3: ADD answered
# (MAPPED or UNMAPPED), only what the peer mapped is served in place; 4: ROOM
_CHALLENGE = struct.Struct("!4sB32s")
_CLAIM = struct.Struct("!4s32s32s")
_ACCEPT = struct.Struct("!4s32s")
#: Share connections still proving themselves, per listener; a newcomer beyond it evicts the oldest.
MAX_PENDING_SHARES = 16
#: A share connection must prove itself within this many seconds.
SHARE_AUTH_S = 2.0

# kind, cache id, region bytes, tensors, rows, row bytes, tensor bytes, then one u64 offset per tensor.
# READ (pulls that read the cache without asking) puts their count in the tensors field, their bytes in the region
# field and their microseconds in rows; LEDGER carries the ledger's fd and size.
_ENTRY = struct.Struct("!BqQIQQQ")
_ADD, _DEL, _READY, _ADD_DEVICE, _MAPPED, _LEDGER, _READ, _UNMAPPED, _ROOM = 1, 2, 3, 4, 5, 6, 7, 8, 9
# After an ADD record's offsets: the cache's ledger slot (NO_SLOT: ask for it), its blocks key's model id, its
# data type and the digest of its block shape (transport/ledger.py).
_READABLE = struct.Struct("!IQBQ")
# After an ADD_DEVICE record's offsets: the exporting backend's kind, the identity of its device.
_DEVICE = struct.Struct(f"!B{IDENTITY_BYTES}s")
DEVICE_KINDS = {1: "host", 2: "cuda"}
_DEVICE_CODES = {kind: code for code, kind in DEVICE_KINDS.items()}
MAX_TENSORS = 4096
MAX_MESSAGE = _ENTRY.size + 8 * MAX_TENSORS + max(_DEVICE.size, _READABLE.size)
#: Regions one peer may have mapped here at once (each mapping counts against vm.max_map_count); the peer's device
#: caches we could not map (their ``ADD_DEVICE`` refused, not withdrawn yet) count too.
MAX_REGIONS = 4096
#: Distinct reasons one share keeps and logs for device caches taking the staging plane (``say_ipc_off``): an
#: honest link has one or two; past it a reason is still the link's (``ipc_off``) but neither kept nor logged.
MAX_IPC_REASONS = 8
#: Records the share socket may hold back for a peer that reads later (our offers, withdrawals, answers); past
#: it the peer reads nothing of what it is sent while its caches change under it: the share is dropped.
MAX_UNSENT = 4 * MAX_REGIONS
#: Same-host pushes (``PUSH_LOCAL``) whose copy one end runs for its peer at once; past it, it tells the pusher to
#: stream. A pusher keeps no more in flight on a link (``LocalShare.pushes``), so an honest one never meets it.
MAX_LOCAL_PUSHES = 64
#: The largest region a peer may ask us to map (1 TiB).
MAX_REGION_BYTES = 1 << 40
#: The longest a pull that read without asking may say it took (a ``READ`` record), for our counters.
READ_MICROS_MAX = 3_600_000_000
#: The most reads one ``READ`` record may report; reads beyond it while the socket is full go uncounted.
MAX_READS = 1 << 8
#: How long reads are summed before they are reported (``READ``): a report per pull would wake the peer per
#: pull, and on 2 cores that wake-up cost the 2 MiB pull about 90 us (``benchmarks.ab_trees``).
REPORT_AFTER_S = 0.01
#: Records one turn of the loop acts on when the share socket is readable; the rest wait for the next turn, so a
#: peer's flood of records never holds the loop (a synchronous read takes up to ``SYNC_RECORDS_MAX``).
RECORDS_PER_TURN = 16
#: Bytes of peers' regions whose pages one turn checks at most before it stops (the check walks each page: about
#: 13 ms per GiB here): a peer sending records of big regions, again and again, still never holds the loop.
WALK_PER_TURN = 256 << 20
#: The longest a requester waits, before it asks, for its answers to the owner's records (``MAPPED``) to leave a
#: share socket the owner has not emptied yet: the owner serves in place only what it heard was mapped, and reads
#: the socket every turn of its loop, so they leave at once unless that loop is held.
ANSWERS_WAIT_S = 1.0
#: The most often a share says it has room again for the peer's caches it refused (``ROOM``), and an owner
#: acts on one: each offer again costs the receiver a check of the region (a walk of its pages, if it fits).
ROOM_EVERY_S = 1.0
#: The most caches an owner offers again for one ``ROOM``: a withdrawal and an offer (with its fd) each, in one
#: turn of its loop (4095 caches of 64 tensors held it 98 ms; found by review).
ROOM_BATCH = 256
#: The most records a synchronous read of the queue (catch_up, region, ...) acts on: more than an honest peer's
#: full share socket holds (278 small records with the default buffers), so only a peer that keeps flooding meets
#: it, and it can no longer hold the caller for as long as it keeps sending.
SYNC_RECORDS_MAX = 512


# The shares that refused regions of their peer for the budget of peers' mappings, told when the budget has room
# again (``devices.host.when_room``, on whichever thread unmapped a peer's region; even inside a region's ``__del__``
# on a thread that was adding to it): no lock, each step one atomic dict operation.
_refusing: dict[int, weakref.ref[LocalShare]] = {}
_refusing_pid = os.getpid()  # whose shares they are: a forked child's hook (before its own fork hook ran) skips them


_room_given = 0  # how many times _room_again ran: a share that registers after reading the budget checks it


def _room_again() -> None:
    global _room_given
    if os.getpid() != _refusing_pid:
        return
    _room_given += 1
    while True:
        try:
            _, ref = _refusing.popitem()
        except KeyError:
            return
        share = ref()
        if share is not None:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nothing to tell
                share._loop.call_soon_threadsafe(share._say_room)


def _after_fork_in_child() -> None:
    global _refusing_pid
    _refusing.clear()  # the parent's shares and loops
    _refusing_pid = os.getpid()


when_room(_room_again)
os.register_at_fork(after_in_child=_after_fork_in_child)


def boot_id() -> bytes:
    """16 bytes naming this kernel boot; equal on both ends means same host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))[:16].ljust(16, b"\0")
    except OSError:
        return bytes(16)


def share_proof(secret: bytes | None, token: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    """What either end of a same-host share connection proves: an HMAC over both fresh nonces and the
    link token, under the shared secret (or, without one, under the link token itself, so the token
    never crosses the share socket)."""
    return hmac.new(secret if secret is not None else token, label + token + first + second,
                    hashlib.sha256).digest()


class ShareError(ValueError):
    """A share record or fd that does not hold what it declares; the share is dropped."""


@dataclasses.dataclass(frozen=True)
class ShareRecord:
    """One validated share message: ``kind`` is ADD or ADD_DEVICE (with geometry), DEL, READY, MAPPED, UNMAPPED, LEDGER
    (``size``: the ledger's) or READ (``tensor_bytes`` reads of ``size`` bytes in all, in ``rows`` microseconds)."""

    kind: int
    cache_id: int
    size: int = 0
    rows: int = 0
    row_bytes: int = 0
    tensor_bytes: int = 0
    offsets: tuple[int, ...] = ()
    device_kind: str = ""  # ADD_DEVICE: the exporting backend
    identity: bytes = b""  # ADD_DEVICE: the device the export lives on
    slot: int = NO_SLOT  # ADD: the cache's word in the owner's ledger, and what reading it needs
    model_id: int = 0
    data_type: int = 0
    block_shape: int = 0


def _out_of_fds() -> bool:
    """Whether this process cannot open another fd now (its fd table is at ``RLIMIT_NOFILE``): the kernel then
    drops the fds of a record it delivers (``MSG_CTRUNC``), no fault of the sender's."""
    try:
        os.close(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
    except OSError as exc:
        return exc.errno in (errno.EMFILE, errno.ENFILE)
    return False


def parse_record(data: bytes, nfds: int, flags: int) -> ShareRecord:
    """Check one received share message against its declared geometry; :class:`ShareError` if it
    is truncated, oversized, carries the wrong number of fds, or declares extents outside its region.
    """
    if flags & socket.MSG_CTRUNC and _out_of_fds():
        raise ShareError("its fds could not be received: this process has no file descriptor left (EMFILE, "
                         "RLIMIT_NOFILE); the peer's record was not at fault")
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        raise ShareError("message or its fds were truncated")
    if len(data) < _ENTRY.size:
        raise ShareError(f"record of {len(data)} bytes is shorter than {_ENTRY.size}")
    kind, cache_id, size, tensors, rows, row_bytes, tensor_bytes = _ENTRY.unpack_from(data, 0)
    if kind in (_DEL, _READY, _MAPPED, _READ, _UNMAPPED, _ROOM):
        if nfds or len(data) != _ENTRY.size:
            raise ShareError("a DEL, READY, MAPPED, UNMAPPED, ROOM or READ record carries nothing more")
        if kind == _ROOM:
            if not 0 < size <= MAX_REGIONS:
                raise ShareError(f"a ROOM record offers room for {size} caches")
            return ShareRecord(kind, 0, size=size)
        if kind != _READ:
            return ShareRecord(kind, cache_id)
        if not 0 < tensors <= MAX_READS:
            raise ShareError(f"a READ record reports {tensors} reads")
        return ShareRecord(kind, cache_id, size=size, rows=rows, tensor_bytes=tensors)
    if kind == _LEDGER:
        if nfds != 1 or len(data) != _ENTRY.size or size != LEDGER_BYTES:
            raise ShareError(f"a LEDGER record carries one fd and declares {LEDGER_BYTES} bytes")
        return ShareRecord(kind, 0, size)
    if kind not in (_ADD, _ADD_DEVICE):
        raise ShareError(f"unknown record kind {kind}")
    if nfds != 1:
        raise ShareError(f"an ADD record carries one fd, not {nfds}")
    trailer = _DEVICE.size if kind == _ADD_DEVICE else _READABLE.size
    if not 0 < tensors <= MAX_TENSORS or len(data) != _ENTRY.size + 8 * tensors + trailer:
        raise ShareError(f"record length {len(data)} does not hold {tensors} tensor offsets")
    if cache_id < 1:
        raise ShareError(f"cache id {cache_id}")
    if not 0 < size <= MAX_REGION_BYTES or size % mmap.PAGESIZE:
        raise ShareError(f"region size {size}")
    if rows <= 0 or row_bytes <= 0 or rows * row_bytes != tensor_bytes or tensor_bytes > size:
        raise ShareError(f"geometry {rows} rows x {row_bytes} bytes != {tensor_bytes} tensor bytes")
    offsets = struct.unpack_from(f"!{tensors}Q", data, _ENTRY.size)
    if any(o + tensor_bytes > size for o in offsets):
        raise ShareError("a tensor lies outside the region")
    if kind == _ADD_DEVICE:
        code, identity = _DEVICE.unpack_from(data, _ENTRY.size + 8 * tensors)
        if code not in DEVICE_KINDS:
            raise ShareError(f"unknown device kind {code}")
        return ShareRecord(kind, cache_id, size, rows, row_bytes, tensor_bytes, offsets, DEVICE_KINDS[code], identity)
    slot, model_id, data_type, block_shape = _READABLE.unpack_from(data, _ENTRY.size + 8 * tensors)
    if slot != NO_SLOT and slot >= SLOTS:
        raise ShareError(f"ledger slot {slot} is outside the ledger's {SLOTS}")
    return ShareRecord(kind, cache_id, size, rows, row_bytes, tensor_bytes, offsets, slot=slot, model_id=model_id,
                       data_type=data_type, block_shape=block_shape)


def _recv_record(sock: socket.socket) -> tuple[bytes, list[int], int]:
    """One record and its fd, if any: ``(data, fds, msg_flags)``. Received close-on-exec (a fork and exec on
    another thread while we hold it must not hand the peer's memory on), which ``socket.recv_fds`` cannot do:
    Python 3.11's ignores its flags."""
    fds = array.array("i")
    data, ancdata, flags, _addr = sock.recvmsg(MAX_MESSAGE, socket.CMSG_LEN(fds.itemsize), socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    return data, list(fds), flags


def check_fd(fd: int, size: int, *, whole: bool = False) -> None:
    """The fd must be a memfd sealed against resizing whose size is exactly ``size`` (``whole``: the file is one
    we map, which passed the check of its pages, see ``check_sealed``)."""
    try:
        check_sealed(fd, size, whole=whole)
    except ValueError as exc:
        raise ShareError(str(exc)) from None


class PeerRegion:
    """A peer's cache mapped read-only into this process, with the geometry it declared.

    The mapping is made with ``PROT_READ`` (a read-only fd allows no more) and
    unmapped when the last reference goes: a copy in flight keeps its region
    alive until the core reports it done.
    """

    __slots__ = ("cache_id", "rows", "row_bytes", "tensor_bytes", "offsets", "base", "size", "slot", "model_id",
                 "geometry", "file", "_addr", "_bases")

    def __init__(self, record: ShareRecord, fd: int, file: tuple[int, int], *, whole: bool = False) -> None:
        self._addr = 0
        self._bases: tuple[int, int, memoryview] | None = None  # tensor_bases' last answer, while mapped
        self.file = file  #: the file mapped (``file_of``)
        check_fd(fd, record.size, whole=whole)
        self.cache_id = record.cache_id
        self.rows = record.rows
        self.row_bytes = record.row_bytes
        self.tensor_bytes = record.tensor_bytes
        self.offsets = list(record.offsets)
        self.size = record.size
        #: Where the owner's ledger says whether we may read this (blocks) cache without asking, and what the
        #: owner would check a request against (NO_SLOT and None: ask).
        self.slot = record.slot
        self.model_id = record.model_id
        self.geometry = None if record.slot == NO_SLOT else Geometry(
            record.cache_id, True, record.data_type, len(record.offsets), record.rows, record.row_bytes,
            record.block_shape)
        self._addr = self.base = map_read_only(fd, record.size)

    def tensor_bases(self, first: int, count: int) -> memoryview:
        """The addresses of tensors ``[first, first + count)`` in our mapping, read-only (the last span asked for
        is kept while the region is open: a run of pulls of the same layers builds it once)."""
        kept = self._bases
        if kept is not None and kept[0] == first and kept[1] == count:
            return kept[2]
        if first < 0 or first + count > len(self.offsets):
            raise LLMException("peer region has fewer tensors than requested",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        bases = memoryview(array.array("Q", [self.base + o for o in self.offsets[first:first + count]])).toreadonly()
        if self.base:
            self._bases = (first, count, bases)
        return bases

    def close(self) -> None:
        """Forget the region; the mapping goes with the last reference."""
        self.base = 0
        self._bases = None

    def __del__(self) -> None:
        if getattr(self, "_addr", 0):
            addr, self._addr = self._addr, 0
            drop_read_only(addr, self.size)


class LocalShare:
    """One link's unix socket: our shareable caches out, the peer's in.

    ``ledger`` is ours (:meth:`start` sends it); ``on_read(count, nbytes, seconds)`` hears of the pulls of our
    caches the peer served itself from the ledger (its ``READ`` records), for our counters.
    """

    def __init__(self, sock: socket.socket, on_lost: Callable[[], None], devices: DeviceBackend | None = None,
                 name: str = "same-host share", ledger: Ledger | None = None,
                 on_read: Callable[[int, int, float], None] | None = None) -> None:
        self.sock = sock
        self.sock.setblocking(False)
        self.regions: dict[int, PeerRegion] = {}
        self._files: dict[tuple[int, int], int] = {}  # the files of ``regions``, each with how many map it
        self._walked = 0  # bytes the checks of this turn's records walked
        self.sent: dict[int, KvCache] = {}  # our host caches offered (and not withdrawn), by id
        self.on_lost = on_lost
        self.ledger = ledger
        self.on_read = on_read
        #: The peer's ledger, and its blocks caches listed there, by blocks key (model id).
        self.peer_ledger: PeerLedger | None = None
        self.listed: dict[int, PeerRegion] = {}
        #: Reads of the peer's caches not reported yet: cache id -> [count, bytes, seconds] (see tell_read).
        self._reads: dict[int, list] = {}
        self._reporting: asyncio.TimerHandle | None = None  # the report scheduled, until it is sent
        #: Records the socket did not take yet (a peer slower to read than we offer or withdraw), in the order
        #: they were made, which the peer's count of our caches (at most MAX_REGIONS) and a cache withdrawn
        #: and offered again depend on: (record, what holds the fd it carries or None, (kind, cache id) of an
        #: ADD). An ADD still here when its cache is withdrawn is dropped (the peer never had it); its holder
        #: keeps the fd open meanwhile.
        self._out: deque[list[Any]] = deque()  # [record, holder, added]; record None: an ADD withdrawn unsent
        self._queued: dict[tuple[int, int], list[Any]] = {}  # the ADDs of _out: their caches are not shared yet
        self._withdrawn = 0  # entries of _out withdrawn before they left (dropped as they reach the front)
        #: Our answers (``MAPPED``, ``UNMAPPED``) the socket did not take yet: they leave ahead of ``_out`` (the
        #: peer counts only our offers and withdrawals in order), so a requester's answer is not held behind a
        #: batch of its own offers; ``_answered`` wakes who waits for them to leave (``answers_left``).
        self._answers: deque[bytes] = deque()
        self._answered: asyncio.Future[None] | None = None
        self.devices = devices
        self.name = name
        #: The peer's device caches we mapped, and ours the peer said it mapped (``MAPPED``).
        self.device_regions: dict[int, PeerDeviceCache] = {}
        #: The files of ``device_regions`` by cache id, and each file with how many map it (``_files`` for them,
        #: kept apart: what another backend imported was not walked, so it spares no host region its walk).
        self._device_file: dict[int, tuple[int, int]] = {}
        self._device_files: dict[tuple[int, int], int] = {}
        self.sent_device: set[int] = set()
        #: Our caches (host and device) the peer said it mapped (``MAPPED``): only these are served in place; and
        #: those it said it could not (``UNMAPPED``), oldest first, which our pushes then stream at once.
        self.peer_mapped: set[int] = set()
        self.peer_refused: dict[int, None] = {}
        self._room_said_at = float("-inf")  # when we last said ROOM
        self._room_say: asyncio.TimerHandle | None = None  # our ROOM held back till then
        self._room_acted_at = float("-inf")  # when we last acted on the peer's ROOM
        self._room_act: asyncio.TimerHandle | None = None  # acting on it held back till then
        self._room_asked = 0  # the peer's ROOM not acted on yet: how many caches it has room for
        #: The peer's host caches we could not map (this process's budget of peers' mappings spent: answered
        #: ``UNMAPPED``, the owner serves them over the data channels), until it withdraws them; they count
        #: against ``MAX_REGIONS`` as mapped ones do.
        self.refused: set[int] = set()
        self._said_refused = False  # our first UNMAPPED was logged
        self._said_unmapped = False  # the peer's first UNMAPPED was logged
        self._ledger_refused = False  # the peer's ledger could not be mapped (budget spent): its slots are ignored
        #: The peer's device caches we could not map (why: ``ipc_off``), until it withdraws them; they count
        #: against ``MAX_REGIONS`` as mapped ones do, so a peer's flood of them ends the share.
        self.device_refused: set[int] = set()
        #: Why device caches on this link take the staging plane (the last reason said), or None.
        self.ipc_off: str | None = None
        self._said: set[str] = set()  # the reasons logged, at most MAX_IPC_REASONS
        self._loop = asyncio.get_running_loop()
        self.ready = self._loop.create_future()
        self._loop.add_reader(sock.fileno(), self._readable, RECORDS_PER_TURN, False, WALK_PER_TURN)
        self.closed = False
        self._finishing = False  # finish() runs: the link is going, the share's end is no loss to announce
        #: Our copies out of the peer's regions in flight (``same_host.run_copy_job``), each with what halts it;
        #: and, once the link is being unlinked (``halt_copies``), what they and any later one fail with.
        self.copies: dict[object, Callable[[LLMException], None]] = {}
        self.halted: LLMException | None = None
        #: Our pushes in flight on this link (``PUSH_LOCAL`` asked, not answered), at most ``MAX_LOCAL_PUSHES``.
        self.pushes = asyncio.Semaphore(MAX_LOCAL_PUSHES)

    def start(self, caches: Iterable[KvCache]) -> None:
        """Send our ledger, then offer ``caches``."""
        if self.ledger is not None and not self._send(_ENTRY.pack(_LEDGER, 0, LEDGER_BYTES, 0, 0, 0, 0), self.ledger):
            return
        for cache in caches:
            self.offer(cache)

    def announce_ready(self) -> None:
        """Tell the peer every cache we had has been offered."""
        self._send(_ENTRY.pack(_READY, 0, 0, 0, 0, 0, 0))

    def _answer(self, kind: int, cache_id: int, size: int = 0) -> None:
        """Answer the peer's record of its cache ``cache_id`` (``MAPPED``, ``UNMAPPED``; or say ``ROOM`` for
        ``size`` of its caches): now, or ahead of our records the socket did not take yet, once it takes them."""
        record = _ENTRY.pack(kind, cache_id, size, 0, 0, 0, 0)
        if self.closed:
            return
        if not self._answers and (self._took(record) or self.closed):
            return
        if len(self._out) + len(self._answers) - self._withdrawn >= MAX_UNSENT:
            log.info("same-host share lost: the peer fell %d records behind", MAX_UNSENT)
            self._lost()
            return
        self._answers.append(record)

    @property
    def answering(self) -> bool:
        """Whether answers of ours wait for the socket to take them."""
        return bool(self._answers)

    async def answers_left(self, limit_s: float = ANSWERS_WAIT_S) -> None:
        """Wait (at most ``limit_s``, and ``ANSWERS_WAIT_S``) until the socket took our answers to the peer's
        records."""
        limit_s = min(limit_s, ANSWERS_WAIT_S)
        if not self._answers or self.closed or limit_s <= 0:
            return
        if self._answered is None or self._answered.done():
            self._answered = self._loop.create_future()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(limit_s):  # (not wait_for: row 281)
                await asyncio.shield(self._answered)

    def _send(self, record: bytes, holder: Any = None, added: tuple[int, int] | None = None) -> bool:
        """Send ``record`` (with ``holder.fd``) now, or after the records the socket did not take yet, once it
        takes them; False once the share is lost. A full socket is a peer that reads later, not a lost share:
        a few hundred records sent at once (a batch of caches freed, a link to an owner of many) fill it."""
        if self.closed:
            return False
        if not self._out:
            if self._took(record, holder):
                return True
            if self.closed:
                return False
        if len(self._out) + len(self._answers) - self._withdrawn >= MAX_UNSENT:
            log.info("same-host share lost: the peer fell %d records behind", MAX_UNSENT)
            self._lost()
            return False
        entry = [record, holder, added]
        self._out.append(entry)
        if added is not None:
            self._queued[added] = entry
        return True

    def _put(self, record: bytes, holder: Any) -> None:
        if holder is None:
            self.sock.send(record)
        else:
            socket.send_fds(self.sock, [record], [holder.fd])

    def _took(self, record: bytes, holder: Any = None) -> bool:
        """Whether the socket took ``record`` now; if not, we write again once it takes more (a full socket) or
        the share is lost."""
        try:
            self._put(record, holder)
            return True
        except BlockingIOError:
            self._loop.add_writer(self.sock.fileno(), self._writable)
        except OSError as exc:
            log.info("same-host share lost: %s", exc)
            self._lost()
        return False

    def _flush(self) -> bool:
        """Send what the socket did not take before (our answers first); whether all of it went."""
        while self._answers and not self.closed:
            if not self._took(self._answers[0]):
                return False
            self._answers.popleft()
        if self._answered is not None and not self._answered.done():
            self._answered.set_result(None)
        while self._out and not self.closed:
            record, holder, added = self._out[0]
            if record is None:
                self._out.popleft()
                self._withdrawn -= 1
                continue
            if not self._took(record, holder):
                return False
            self._out.popleft()
            if added is not None:
                self._queued.pop(added, None)
        return not self.closed

    def _unsent(self, added: tuple[int, int]) -> bool:
        """Drop the ADD ``added`` if the socket has not taken it yet (its cache is withdrawn); whether it did."""
        entry = self._queued.pop(added, None)
        if entry is None:
            return False
        # Marked, not searched for: freeing a batch in reverse, behind a peer that reads nothing, searched the
        # queue once per cache (3722 queued: the owner's loop held 0.27 s; found by a hunt's suspicion).
        entry[:] = (None, None, None)  # never sent; its fd's holder let go now
        self._withdrawn += 1
        if self._withdrawn > len(self._out) // 2:
            self._out = deque(kept for kept in self._out if kept[0] is not None)
            self._withdrawn = 0
        return True

    def offer(self, cache: KvCache) -> None:
        """Send ``cache`` with its read-only memfd, if it has one (a device cache: its export)."""
        if cache.on_device:
            self._offer_device(cache)
            return
        region = cache.region
        if self.closed or region is None or cache.cache_id in self.sent:
            return
        lay = cache.layout
        if lay.num_tensors > MAX_TENSORS or self._full():
            return  # served over TCP
        offsets = [b - region.address for b in lay.bases]
        listed = None if self.ledger is None else self.ledger.entry(cache.cache_id)
        slot, model_id = (NO_SLOT, 0) if listed is None else listed
        geo = geometry_of(cache)
        body = (_ENTRY.pack(_ADD, cache.cache_id, region.nbytes, lay.num_tensors, lay.rows, lay.row_bytes,
                            lay.tensor_bytes) + struct.pack(f"!{len(offsets)}Q", *offsets)
                + _READABLE.pack(slot, model_id, geo.data_type, geo.block_shape))
        if self._send(body, region, (_ADD, cache.cache_id)):
            self.sent[cache.cache_id] = cache

    def _full(self) -> bool:
        """Whether the peer holds as many of our caches as it takes (``MAX_REGIONS``, counted as it counts them:
        host and device records, mapped or not, less those withdrawn, in the order sent). A cache past it is
        served over the data channels; before, its record dropped the peer's whole share (an honest owner of
        4097 caches lost it, in-flight pulls included; found by a hunt)."""
        return len(self.sent) + len(self.sent_device) >= MAX_REGIONS

    def _offer_device(self, cache: KvCache) -> None:
        export = cache.device_export
        if self.closed or cache.cache_id in self.sent_device or self.devices is None:
            return
        why = self.devices.ipc_export_refused() or self.devices.ipc_unavailable()
        if why is None and export is None:
            why = "registered (framework-owned) device caches are not exported; only allocated ones are"
        if why is not None:
            self.say_ipc_off(f"our device caches are not exported: {why}")
            return
        lay = cache.layout
        if lay.num_tensors > MAX_TENSORS or self._full():
            return
        offsets = [b - export.address for b in lay.bases]
        body = (_ENTRY.pack(_ADD_DEVICE, cache.cache_id, export.nbytes, lay.num_tensors, lay.rows, lay.row_bytes,
                            lay.tensor_bytes) + struct.pack(f"!{len(offsets)}Q", *offsets)
                + _DEVICE.pack(_DEVICE_CODES[self.devices.kind], self.devices.ipc_identity()))
        if self._send(body, export, (_ADD_DEVICE, cache.cache_id)):
            self.sent_device.add(cache.cache_id)

    def say_ipc_off(self, why: str) -> None:
        """Device caches on this link take the staging plane because of ``why``: say so once (INFO), for the first
        ``MAX_IPC_REASONS`` reasons of the link (the reasons a peer's records lead to name nothing of theirs, but
        a share keeps no more than that whatever it is sent)."""
        self.ipc_off = why
        if why not in self._said and len(self._said) < MAX_IPC_REASONS:
            self._said.add(why)
            log.info("%s: device caches take the staging plane, not device IPC: %s", self.name, why)

    def device_shared(self, cache: KvCache) -> bool:
        """Whether the peer mapped our device cache ``cache`` (it answered ``MAPPED``; its answers queued here are
        read first, as for ``shared``)."""
        return self._mapped(_ADD_DEVICE, cache.cache_id, self.sent_device)

    def device_offered(self, cache: KvCache) -> bool:
        """Whether our record of device cache ``cache`` left and the peer did not answer ``UNMAPPED``: what a
        device-IPC push of ours needs (as ``offered`` for host caches: the peer maps the export when the push
        names it, or answers ``USE_STREAM``)."""
        return self._left(_ADD_DEVICE, cache.cache_id, self.sent_device)

    def device_region(self, cache_id: int) -> PeerDeviceCache | None:
        """The peer's device cache ``cache_id`` as we mapped it (records already queued are read first)."""
        if cache_id not in self.device_regions:
            self._readable(SYNC_RECORDS_MAX)
        return self.device_regions.get(cache_id)

    @property
    def imports_devices(self) -> bool:
        """Whether this end can map a peer's device caches at all."""
        return self.devices is not None and self.devices.ipc_unavailable() is None and not self.closed

    def withdraw(self, cache_id: int) -> None:
        if self.closed:
            return
        if cache_id in self.sent_device:
            self.sent_device.discard(cache_id)
            self.peer_mapped.discard(cache_id)
            self.peer_refused.pop(cache_id, None)
            if not self._unsent((_ADD_DEVICE, cache_id)):
                self._send(_ENTRY.pack(_DEL, cache_id, 0, 0, 0, 0, 0))
            return
        if cache_id not in self.sent:
            return
        del self.sent[cache_id]
        self.peer_mapped.discard(cache_id)
        self.peer_refused.pop(cache_id, None)
        if not self._unsent((_ADD, cache_id)):
            self._send(_ENTRY.pack(_DEL, cache_id, 0, 0, 0, 0, 0))

    def offered(self, cache: KvCache) -> bool:
        """Whether our record of host cache ``cache`` left and the peer did not answer ``UNMAPPED``: what a
        same-host push of ours needs, the peer maps the region when the push names it and says so if it cannot."""
        return self._left(_ADD, cache.cache_id, self.sent)

    def shared(self, cache: KvCache) -> bool:
        """Whether the peer mapped our host cache ``cache`` (it answered ``MAPPED``): what serving its pull in
        place needs. The peer's answers queued here are read first: a requester answers a record before it asks
        for the cache (``SameHostPlane.prepare``). Device caches are never shared here (``device_shared``)."""
        return self._mapped(_ADD, cache.cache_id, self.sent)

    def _left(self, kind: int, cache_id: int, sent: Container[int]) -> bool:
        """Whether our record (``kind``: ADD or ADD_DEVICE) of cache ``cache_id``, one of ``sent``, left and the peer
        did not refuse it (one still queued here has not reached the peer, and a message naming the cache would
        reach it first; what the socket takes now goes first)."""
        if cache_id not in sent or cache_id in self.peer_refused or self.closed:
            return False
        if (kind, cache_id) in self._queued:
            self._flush()
        return (kind, cache_id) not in self._queued and not self.closed

    def _mapped(self, kind: int, cache_id: int, sent: Container[int]) -> bool:
        """Whether the peer answered ``MAPPED`` for our record of ``cache_id`` (see ``_left``), its answers queued
        here read first."""
        if cache_id in sent and cache_id not in self.peer_mapped and self._left(kind, cache_id, sent):
            self.catch_up()
        return (cache_id in sent and cache_id in self.peer_mapped and (kind, cache_id) not in self._queued
                and not self.closed)

    def listed_region(self, model_id: int) -> PeerRegion | None:
        """The peer's blocks cache bound to blocks key ``model_id`` if its ledger lets us read it without
        asking, now."""
        region = self.listed.get(model_id)
        if region is None:  # the peer may have just shared it: its record would be queued here
            self._readable(SYNC_RECORDS_MAX)
            region = self.listed.get(model_id)
        if region is None or self.peer_ledger is None or not self.peer_ledger.holds(region.slot, region.cache_id):
            return None
        return region

    def tell_read(self, cache_id: int, nbytes: int, seconds: float) -> None:
        """Tell the peer we read ``nbytes`` of its cache ``cache_id`` without asking (``READ``). Reads are
        summed per cache and reported ``REPORT_AFTER_S`` after the first, or once the socket takes more: a
        burst of reads never fills the socket, and a full one loses nothing but reads beyond ``MAX_READS``
        per cache."""
        if self.closed:
            return
        reads = self._reads.get(cache_id)
        if reads is None:
            self._reads[cache_id] = [1, nbytes, seconds]
        elif reads[0] < MAX_READS:
            reads[0] += 1
            reads[1] += nbytes
            reads[2] += seconds
            if reads[0] == MAX_READS:  # a record says at most MAX_READS: the sums leave now (unless the socket is full)
                if self._reporting is not None:
                    self._reporting.cancel()
                    self._reporting = None
                self._report_reads()
                return
        if self._reporting is None:
            self._reporting = self._loop.call_later(REPORT_AFTER_S, self._report_reads)

    def _report_reads(self) -> None:
        # A loop callback (and the writer's): nothing may escape it.
        while self._reads and not self.closed:
            cache_id, (count, nbytes, seconds) = next(iter(self._reads.items()))
            try:
                self.sock.send(_ENTRY.pack(_READ, cache_id, nbytes, count, min(int(seconds * 1e6), READ_MICROS_MAX),
                                           0, 0))
            except BlockingIOError:
                self._loop.add_writer(self.sock.fileno(), self._writable)
                return
            except OSError:
                self._lost()
                return
            del self._reads[cache_id]
        self._reporting = None

    def _writable(self) -> None:
        self._loop.remove_writer(self.sock.fileno())
        if self._flush():
            self._report_reads()

    def report_reads(self) -> None:
        """Send the reads not reported yet now, what the socket takes without waiting (the link is about to
        go: our ``UNLINK`` follows, and the share closes before the next report would leave)."""
        if self._reporting is not None:
            self._reporting.cancel()
            self._reporting = None
        self._report_reads()

    def halt_copies(self, error: LLMException) -> None:
        """The link is being unlinked: stop our copies out of the peer's regions now, and start none, before the
        peer hears of it (its memory is its own again once its unlink returned); they fail with ``error``."""
        if self.halted is None:
            self.halted = error
        for halt in list(self.copies.values()):
            halt(error)

    def finish(self) -> None:
        """Close the share as its link goes: our reads not reported yet leave first (without waiting), and the
        peer's ``READ`` records queued here are counted; the peer sent them before the word that ends the
        link (its ``UNLINK``, or the answer to ours), so they are all here. Other records queued are moot
        now, and a peer gone meanwhile is no loss of the share to announce."""
        self._finishing = True
        self.report_reads()
        self._readable(SYNC_RECORDS_MAX, reads_only=True)
        self.close()

    def catch_up(self) -> None:
        """Act on the records the peer sent that are queued here (a withdrawal, the end of the share). A peek
        first: with nothing queued (a pull's usual case) no record is read."""
        if _core.input_pending(self.sock.fileno()):
            self._readable(SYNC_RECORDS_MAX)

    def region(self, cache_id: int) -> PeerRegion | None:
        """The peer's cache ``cache_id``; reads share records already queued first.

        The peer sends a cache's record before any control message naming it,
        so by the time a message names the cache, its record is in our queue.
        """
        if cache_id not in self.regions:
            self._readable(SYNC_RECORDS_MAX)
        return self.regions.get(cache_id)

    def _readable(self, budget: int, reads_only: bool = False, walk: int | None = None) -> None:
        # A loop callback: nothing may escape it. Each received fd is closed exactly once, here. Acts on at most
        # ``budget`` records (the reader fires again next turn for the rest), and stops once their checks walked
        # ``walk`` bytes of regions (None: no bound, a synchronous read); ``reads_only``: on READ records alone
        # (finish), the others are read and dropped.
        self._walked = 0
        while not self.closed and budget > 0 and (walk is None or self._walked < walk):
            budget -= 1
            fds: list[int] = []
            try:
                data, fds, flags = _recv_record(self.sock)
            except BlockingIOError:
                return
            except OSError:
                self._lost()
                return
            try:
                if not data:
                    self._lost()
                    return
                record = parse_record(data, len(fds), flags)
                if not reads_only or record.kind == _READ:
                    self._apply(record, fds)
            except (ShareError, OSError, ValueError) as exc:
                _BAD_RECORDS.note("same-host share: dropping the share after a record that could not be taken: %s", exc)
                self._lost()
                return
            finally:
                for fd in fds:
                    os.close(fd)

    def _apply(self, record: ShareRecord, fds: list[int]) -> None:
        if record.kind == _READY:
            if not self.ready.done():
                self.ready.set_result(None)
            return
        if record.kind == _MAPPED:
            if record.cache_id in self.sent or record.cache_id in self.sent_device:  # else ignored: grants nothing
                self.peer_mapped.add(record.cache_id)
            return
        if record.kind == _UNMAPPED:
            if record.cache_id not in self.sent and record.cache_id not in self.sent_device:
                return  # else ignored: it names no cache of ours the peer holds
            self.peer_refused[record.cache_id] = None
            if not self._said_unmapped:
                self._said_unmapped = True
                log.info("%s: the peer could not map our cache %d (its process maps no more of its peers' "
                         "regions, or not this device's): caches it refuses are served over the data channels",
                         self.name, record.cache_id)
            return
        if record.kind == _ROOM:
            self._room_asked = max(self._room_asked, record.size)
            self._offer_again()
            return
        if record.kind == _READ:
            # Counted whatever the cache's fate since (the reader may free it right after the pull): a peer that
            # lies here inflates only its own link's counters.
            if self.on_read is not None:
                self.on_read(record.tensor_bytes, record.size, min(record.rows, READ_MICROS_MAX) / 1e6)
            return
        if record.kind == _LEDGER:
            if self.peer_ledger is not None or self._ledger_refused:
                raise ShareError("the peer sent a second ledger")
            try:
                self.peer_ledger = PeerLedger(fds[0])
            except OSError as exc:
                if exc.errno != errno.ENOMEM:
                    raise
                # No fault of the peer's (the budget of peers' mappings is spent): the share stays, and every
                # pull of its caches asks (their slots are not read).
                self._ledger_refused = True
                self._say_refused("its read ledger", exc)
            return
        # A file this share maps passed its check and can get no hole: sent again (under this id or another),
        # it is not walked again (the old region of this id still maps it until the new one does). So for a device
        # export (the host backend walks it too).
        file = file_of(fds[0]) if record.kind in (_ADD, _ADD_DEVICE) else None
        files = self._device_files if record.kind == _ADD_DEVICE else self._files
        whole = file is not None and files.get(file, 0) > 0
        old = self.regions.pop(record.cache_id, None)
        if old is not None:
            self._unlist(old)
        self._drop_device(record.cache_id)
        self.device_refused.discard(record.cache_id)
        self.refused.discard(record.cache_id)
        if record.kind == _DEL:
            return
        if (len(self.regions) + len(self.device_regions) + len(self.device_refused) + len(self.refused)
                >= MAX_REGIONS):
            raise ShareError(f"the peer shares more than {MAX_REGIONS} caches")
        if record.kind == _ADD_DEVICE:
            assert file is not None
            self._map_device(record, fds[0], file, whole)
            return
        if record.slot != NO_SLOT and self.peer_ledger is None:
            if not self._ledger_refused:
                raise ShareError(f"cache {record.cache_id} names a ledger slot before the peer sent its ledger")
            record = dataclasses.replace(record, slot=NO_SLOT)  # a ledger we could not map: asked for
        assert file is not None
        seen = _room_given
        mappings, nbytes = peer_room()
        if not mappings or nbytes < record.size:  # refused before its pages are walked (an offer again costs nothing)
            check_fd(fds[0], record.size, whole=True)  # a bad fd still drops the share (no walk: cheap)
            self._refuse(record.cache_id, OSError(errno.ENOMEM, "this process's budget of peers' mappings is spent"),
                         seen)
            return
        try:
            region = PeerRegion(record, fds[0], file, whole=whole)
        except OSError as exc:
            if exc.errno != errno.ENOMEM:
                raise
            self._refuse(record.cache_id, exc, seen)  # no fault of the peer's: the share stays
            return
        finally:
            if not whole:
                self._walked += record.size  # its check walked every page
        self.regions[record.cache_id] = region
        self._files[file] = self._files.get(file, 0) + 1
        if region.geometry is not None:
            self.listed[region.model_id] = region
        self._answer(_MAPPED, record.cache_id)

    def _refuse(self, cache_id: int, exc: OSError, seen: int) -> None:
        """The peer's host cache ``cache_id`` cannot be mapped now (``ENOMEM``): answer ``UNMAPPED``, count it
        against ``MAX_REGIONS`` until withdrawn, and say ``ROOM`` once there is room."""
        self._say_refused(f"its cache {cache_id}", exc)
        self.refused.add(cache_id)
        self._answer(_UNMAPPED, cache_id)
        self._wait_for_room(seen)

    def _wait_for_room(self, seen: int) -> None:
        """Be told (``_say_room``) once a peer's mapping gives the budget back (``seen``: ``_room_given`` before
        the budget was read; room given back since was told to shares registered then, not to us)."""
        if self._room_say is None:  # else told by its timer
            _refusing[id(self)] = weakref.ref(self)
            if _room_given != seen:
                self._loop.call_soon(self._say_room)

    def _put_off(self, name: str, last_at: float, then: Callable[[], None]) -> bool:
        """Whether ``then`` (saying ``ROOM``, or acting on the peer's) must wait: its timer (attribute ``name``) is
        pending, or it ran under ``ROOM_EVERY_S`` ago (at ``last_at``) and the timer is set now for the rest."""
        if getattr(self, name) is not None:
            return True
        wait = last_at + ROOM_EVERY_S - time.monotonic()
        if wait <= 0:
            return False
        setattr(self, name, self._loop.call_later(wait, self._room_timer, name, then))
        return True

    def _room_timer(self, name: str, then: Callable[[], None]) -> None:
        setattr(self, name, None)  # (a timer's own ``when`` may read later than the loop's clock as it fires)
        then()

    def _say_room(self) -> None:
        # A loop callback (from _room_again or a timer): nothing may escape it. Tells the peer how many of the caches
        # we refused we could map now, at most once per ROOM_EVERY_S.
        if self.closed or not self.refused or self._put_off("_room_say", self._room_said_at, self._say_room):
            return
        seen = _room_given
        mappings, nbytes = peer_room()
        if not mappings or not nbytes:
            self._wait_for_room(seen)
            return
        self._room_said_at = time.monotonic()
        self._answer(_ROOM, 0, min(mappings, len(self.refused)))
        self._wait_for_room(seen)  # what it offers again may be refused again, or room may come for more

    def _offer_again(self) -> None:
        """Act on the peer's ``ROOM``: withdraw and offer again that many of the caches it refused, oldest first,
        at most once per ``ROOM_EVERY_S``."""
        if self.closed or not self._room_asked or self._put_off("_room_act", self._room_acted_at, self._offer_again):
            return
        refused = [self.sent[c] for c in self.peer_refused if c in self.sent]
        count = min(self._room_asked, ROOM_BATCH, len(refused))
        self._room_asked = min(self._room_asked, len(refused)) - count  # the rest next time
        self._room_acted_at = time.monotonic()
        for cache in refused[:count]:
            self.withdraw(cache.cache_id)
            self.offer(cache)
        if self._room_asked and not self.closed and not self._put_off("_room_act", self._room_acted_at,
                                                                      self._offer_again):
            self._loop.call_soon(self._offer_again)  # the rest: a second from now, or at once if that passed

    def _say_refused(self, what: str, exc: OSError) -> None:
        """Log, once per share, that this process cannot map ``what`` of the peer's now (``exc``, ``ENOMEM``:
        peers' regions spent ``devices.host``'s budget, or the kernel's map count)."""
        if not self._said_refused:
            self._said_refused = True
            log.warning("%s: cannot map %s (%s): what is refused is read over the data channels", self.name, what,
                        exc.strerror or exc)

    def _unlist(self, region: PeerRegion) -> None:
        """``region`` is no longer the peer's cache here (replaced, withdrawn): forget it and its file."""
        region.close()
        if self.listed.get(region.model_id) is region:
            del self.listed[region.model_id]
        left = self._files.pop(region.file, 0) - 1
        if left > 0:
            self._files[region.file] = left

    def _drop_device(self, cache_id: int) -> None:
        """The peer's device cache ``cache_id`` is no longer mapped here (replaced, withdrawn): forget its file."""
        peer = self.device_regions.pop(cache_id, None)
        if peer is None:
            return
        peer.close()
        file = self._device_file.pop(cache_id)
        left = self._device_files.pop(file, 0) - 1
        if left > 0:
            self._device_files[file] = left

    def _map_device(self, record: ShareRecord, fd: int, file: tuple[int, int], whole: bool) -> None:
        """Map a peer's device cache read-only and answer ``MAPPED``; say why not where we cannot (``whole``: a
        device cache mapped here is of the same ``file``, see ``ipc_import``)."""
        devices = self.devices
        if devices is None:
            self.device_refused.add(record.cache_id)
            self.say_ipc_off("the peer's device caches cannot be mapped: this endpoint has no device backend "
                             "(aio.DeviceType)")
            self._answer(_UNMAPPED, record.cache_id)
            return
        try:
            mapping = devices.ipc_import(record.device_kind, record.identity, fd, record.size, whole=whole)
        except (IpcUnavailable, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno != errno.ENOMEM:
                raise
            self.device_refused.add(record.cache_id)
            self.say_ipc_off(f"the peer's device caches cannot be mapped here: {exc}")
            self._answer(_UNMAPPED, record.cache_id)
            return
        except ExportInvalid as exc:
            raise ShareError(f"device export of cache {record.cache_id}: {exc}") from None
        if not whole:
            self._walked += record.size  # the host backend's check walked every page; other imports count alike
        try:
            peer = PeerDeviceCache(record.cache_id, mapping, record.rows, record.row_bytes, record.tensor_bytes,
                                   record.offsets, devices.device)
        except ExportInvalid as exc:
            mapping.close()
            raise ShareError(f"device export of cache {record.cache_id}: {exc}") from None
        self.device_regions[record.cache_id] = peer
        self._device_file[record.cache_id] = file
        self._device_files[file] = self._device_files.get(file, 0) + 1
        self._answer(_MAPPED, record.cache_id)

    def _lost(self) -> None:
        if not self.closed:
            self.close()
            if not self._finishing:
                self.on_lost()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.ready.done():
            self.ready.cancel()
        if not self._loop.is_closed():
            self._loop.remove_reader(self.sock.fileno())
            self._loop.remove_writer(self.sock.fileno())
        self.sock.close()
        for region in self.regions.values():
            region.close()
        self.regions.clear()
        self._files.clear()
        self.listed.clear()
        self._reads.clear()
        self._out.clear()
        self._answers.clear()
        if self._answered is not None and not self._answered.done():
            self._answered.set_result(None)
        self._queued.clear()
        self._withdrawn = 0
        if self._reporting is not None:
            self._reporting.cancel()
        if self.peer_ledger is not None:
            self.peer_ledger.close()
            self.peer_ledger = None
        for device_region in self.device_regions.values():
            device_region.close()
        self.device_regions.clear()
        self._device_file.clear()
        self._device_files.clear()
        self.device_refused.clear()
        self.sent.clear()
        self.refused.clear()
        self.peer_mapped.clear()
        self.peer_refused.clear()
        for timer in (self._room_say, self._room_act):
            if timer is not None:
                timer.cancel()
        self._room_say = self._room_act = None


#: What the listener asks of its owner: the ``(link token, attach)`` pairs of links that may attach a
#: share now; ``attach(sock)`` hands the authenticated connection to that link.
Candidates = Callable[[], Iterable[tuple[bytes, Callable[[socket.socket], None]]]]


class LocalListener:
    """An abstract unix socket where same-host peers attach their share channel.

    A connection gets a fresh server nonce and must answer, within
    ``SHARE_AUTH_S``, with its own nonce and an HMAC over both nonces and a
    live link's token under the shared secret; it then gets the server's
    proof and only after that any fd. A captured answer is useless on
    another connection (the server nonce differs), the link token that
    crossed the wire in LINK_OK is not enough without the secret, and each
    link attaches one share. At most ``MAX_PENDING_SHARES`` connections are
    proving themselves at once: a newcomer evicts the oldest. An honest peer
    answers the challenge at once, so a flood evicts it only by opening more
    than the cap within that one round trip, and the link then uses TCP.
    """

    def __init__(self, secret: bytes | None, candidates: Candidates) -> None:
        self.secret = secret
        self.candidates = candidates
        self.name = b"\0aio_datadist." + os.urandom(12).hex().encode()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self.sock.bind(self.name)
            self.sock.listen(128)
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise
        self._loop = asyncio.get_running_loop()
        self._pending: dict[asyncio.Task, tuple[socket.socket, float]] = {}
        self._loop.add_reader(self.sock.fileno(), self._accept)
        self._retry: asyncio.TimerHandle | None = None  # accept() again, after it found no room
        self._starved = False  # accept() found no room, and said so, since it last took a connection
        # A process connecting again and again with a claim that proves nothing cannot flood the log (row 202).
        self._refused = RefusalLog(log)
        self.closed = False

    def pending(self) -> int:
        """Share connections still proving themselves."""
        return len(self._pending)

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in ACCEPT_GONE:
                    continue  # that connection is gone, not the listener
                self._wait_for_room(exc)  # no fd or memory now (or worse): try again later, not every turn
                return
            self._starved = False
            if len(self._pending) >= MAX_PENDING_SHARES:
                self._evict_oldest()
            conn.setblocking(False)
            task = self._loop.create_task(self._attach(conn))
            self._pending[task] = (conn, self._loop.time())
            task.add_done_callback(functools.partial(self._settled, conn=conn))

    def _wait_for_room(self, exc: OSError) -> None:
        # The connection stays in the backlog and the socket readable: a (level-triggered) reader left on it
        # ran again every loop turn, all the CPU, for as long as the process had no fd free.
        self._loop.remove_reader(self.sock.fileno())
        if not self._starved:
            self._starved = True
            log.warning("same-host share: cannot accept a connection now (%s); it waits in the listen backlog", exc)
        self._retry = self._loop.call_later(ACCEPT_RETRY_S, self._resume)

    def _resume(self) -> None:
        self._retry = None
        if not self.closed:
            self._loop.add_reader(self.sock.fileno(), self._accept)

    def _evict_oldest(self) -> None:
        task = min(self._pending.items(), key=lambda item: item[1][1])[0]
        task.cancel()
        del self._pending[task]

    def _settled(self, task: asyncio.Task, *, conn: socket.socket) -> None:
        self._pending.pop(task, None)
        if task.cancelled():
            # Cancelled before its first step (``close`` as the listener stops, an eviction): its ``finally`` never
            # ran. (Closed already when it ran: a second close does nothing.)
            conn.close()

    async def _attach(self, conn: socket.socket) -> None:
        keep = False
        try:
            async with asyncio.timeout(SHARE_AUTH_S):
                server_nonce = os.urandom(32)
                await self._loop.sock_sendall(conn, _CHALLENGE.pack(_MAGIC, SHARE_VERSION, server_nonce))
                data = await self._loop.sock_recv(conn, _CLAIM.size + 1)
            if len(data) != _CLAIM.size:
                return
            magic, client_nonce, claimed = _CLAIM.unpack(data)
            if magic != _MAGIC:
                return
            for token, attach in self.candidates():
                if hmac.compare_digest(claimed, share_proof(self.secret, token, b"share-client",
                                                            server_nonce, client_nonce)):
                    conn.send(_ACCEPT.pack(_MAGIC, share_proof(self.secret, token, b"share-server",
                                                              client_nonce, server_nonce)))
                    attach(conn)
                    keep = True
                    return
            self._refused.note("same-host share: refused a connection that did not prove a live link")
        except (TimeoutError, OSError):
            pass
        finally:
            if not keep:
                conn.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if not self._loop.is_closed():
            self._loop.remove_reader(self.sock.fileno())
        for task in list(self._pending):
            task.cancel()
        close_listening(self.sock)


async def connect_share(name: bytes, token: bytes, secret: bytes | None) -> socket.socket:
    """Dial a same-host peer's share listener and prove the link to it (and it to us).

    :raises OSError: the listener is unreachable, or ``ConnectionRefusedError`` when it does not
        prove the link (a stale name taken by another process, a peer without the secret).
    """
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, name)
        data = await loop.sock_recv(sock, _CHALLENGE.size + 1)
        if len(data) != _CHALLENGE.size:
            raise ConnectionRefusedError("same-host share: malformed challenge")
        magic, version, server_nonce = _CHALLENGE.unpack(data)
        if magic != _MAGIC or version != SHARE_VERSION:
            raise ConnectionRefusedError(f"same-host share: unknown protocol {magic!r} version {version}")
        client_nonce = os.urandom(32)
        await loop.sock_sendall(sock, _CLAIM.pack(_MAGIC, client_nonce,
                                                  share_proof(secret, token, b"share-client", server_nonce,
                                                              client_nonce)))
        # A plain recv: any fd a message carried here would be discarded by the kernel, not received.
        data = await loop.sock_recv(sock, _ACCEPT.size + 1)
        expected = share_proof(secret, token, b"share-server", client_nonce, server_nonce)
        if len(data) != _ACCEPT.size or not hmac.compare_digest(_ACCEPT.unpack(data)[1], expected):
            raise ConnectionRefusedError("same-host share: the listener did not prove the link")
        return sock
    except BaseException:
        sock.close()
        raise
