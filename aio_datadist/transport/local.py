"""Same-host transport: peers share cache memory instead of streaming it.

Allocated caches live in memfd-backed regions (``devices/host.py``). When both
ends of a link run on one kernel (same boot id), the client connects to the
server's abstract unix socket, proves it holds the link token, and from then
on each end sends the other one record per shareable cache, with the memfd
attached (SCM_RIGHTS): cache id, region size and geometry. The receiving end
maps the region once. A pull or push then resolves its target through the
owner exactly as over TCP (same validation, same refusals) and becomes one
native copy between the local cache and the peer's mapping, run by the
HostCopyEngine. Registered framework tensors are not memfd-backed: requests
touching them take the TCP data channels.
"""

from __future__ import annotations

import array
import asyncio
import hmac
import logging
import mmap
import os
import socket
import struct
from typing import TYPE_CHECKING, Any

import torch

from aio_datadist.status import LLMException, LLMStatusCode

if TYPE_CHECKING:
    from aio_datadist.cache import KvCache

__all__ = ["LocalListener", "LocalShare", "PeerRegion", "boot_id"]

log = logging.getLogger("aio_datadist.local")

_HELLO = struct.Struct("!4s32s")
_HELLO_MAGIC = b"AIDL"
# kind, cache id, region bytes, tensors, rows, row bytes, tensor bytes, then one u64 offset per tensor
_ENTRY = struct.Struct("!BqQIQQQ")
_ADD, _DEL, _READY = 1, 2, 3
MAX_MESSAGE = _ENTRY.size + 8 * 4096


def boot_id() -> bytes:
    """16 bytes naming this kernel boot; equal on both ends means same host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))[:16].ljust(16, b"\0")
    except OSError:
        return bytes(16)


class PeerRegion:
    """A peer's cache mapped into this process, with the geometry it declared."""

    __slots__ = ("cache_id", "rows", "row_bytes", "tensor_bytes", "offsets", "base", "size", "_map", "_view")

    def __init__(self, cache_id: int, fd: int, size: int, rows: int, row_bytes: int, tensor_bytes: int,
                 offsets: list[int]) -> None:
        if rows <= 0 or row_bytes * rows != tensor_bytes or any(o + tensor_bytes > size for o in offsets):
            raise ValueError("peer declared a geometry outside its region")
        self.cache_id = cache_id
        self.rows = rows
        self.row_bytes = row_bytes
        self.tensor_bytes = tensor_bytes
        self.offsets = offsets
        self.size = size
        self._map = mmap.mmap(fd, size)
        self._view = torch.frombuffer(self._map, dtype=torch.uint8)
        self.base = self._view.data_ptr()

    def tensor_bases(self, first: int, count: int) -> array.array:
        if first < 0 or first + count > len(self.offsets):
            raise LLMException("peer region has fewer tensors than requested",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        return array.array("Q", [self.base + o for o in self.offsets[first:first + count]])

    def close(self) -> None:
        """Forget the region. The mapping itself goes with the last reference:
        a copy in flight keeps its region alive until the core reports it done."""
        self.base = 0


class LocalShare:
    """One link's unix socket: our shareable caches out, the peer's in."""

    def __init__(self, sock: socket.socket, runtime: Any, on_lost: Any) -> None:
        self.sock = sock
        self.sock.setblocking(False)
        self.runtime = runtime
        self.regions: dict[int, PeerRegion] = {}
        self.sent: set[int] = set()
        self.on_lost = on_lost
        self._loop = asyncio.get_running_loop()
        self.ready = self._loop.create_future()
        self._loop.add_reader(sock.fileno(), self._readable)
        self.closed = False

    def announce_ready(self) -> None:
        """Tell the peer every cache we had has been offered."""
        try:
            self.sock.send(_ENTRY.pack(_READY, 0, 0, 0, 0, 0, 0))
        except OSError:
            self._lost()

    def offer(self, cache: KvCache) -> None:
        """Send ``cache`` with its memfd, if it has one."""
        region = cache._region
        if self.closed or region is None or cache.cache_id in self.sent:
            return
        lay = cache.layout
        offsets = [b - region.address for b in lay.bases]
        body = _ENTRY.pack(_ADD, cache.cache_id, region.nbytes, lay.num_tensors, lay.rows, lay.row_bytes,
                           lay.tensor_bytes) + struct.pack(f"!{len(offsets)}Q", *offsets)
        try:
            socket.send_fds(self.sock, [body], [region.fd])
        except OSError as exc:
            log.info("same-host share lost: %s", exc)
            self._lost()
            return
        self.sent.add(cache.cache_id)

    def withdraw(self, cache_id: int) -> None:
        if self.closed or cache_id not in self.sent:
            return
        self.sent.discard(cache_id)
        try:
            self.sock.send(_ENTRY.pack(_DEL, cache_id, 0, 0, 0, 0, 0))
        except OSError:
            self._lost()

    def shared(self, cache: KvCache) -> bool:
        return cache.cache_id in self.sent and not self.closed

    def region(self, cache_id: int) -> PeerRegion | None:
        """The peer's cache ``cache_id``; reads share records already queued first.

        The owner sends a cache's record before any control message naming it,
        so by the time a response names the cache, its record is in our queue.
        """
        if cache_id not in self.regions:
            self._readable()
        return self.regions.get(cache_id)

    def _readable(self) -> None:
        while not self.closed:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE, 1)
            except BlockingIOError:
                return
            except OSError:
                self._lost()
                return
            if not data:
                for fd in fds:
                    os.close(fd)
                self._lost()
                return
            try:
                self._apply(data, fds)
            except (ValueError, struct.error, OSError) as exc:
                log.warning("dropping a malformed same-host share message: %s", exc)
                for fd in fds:
                    os.close(fd)
                self._lost()
                return

    def _apply(self, data: bytes, fds: list[int]) -> None:
        kind, cache_id, size, tensors, rows, row_bytes, tensor_bytes = _ENTRY.unpack_from(data, 0)
        if kind == _READY:
            if not self.ready.done():
                self.ready.set_result(None)
            return
        if kind == _DEL:
            old = self.regions.pop(cache_id, None)
            if old is not None:
                old.close()
            return
        if kind != _ADD or len(fds) != 1 or len(data) != _ENTRY.size + 8 * tensors:
            raise ValueError("bad share record")
        offsets = list(struct.unpack_from(f"!{tensors}Q", data, _ENTRY.size))
        try:
            region = PeerRegion(cache_id, fds[0], size, rows, row_bytes, tensor_bytes, offsets)
        finally:
            os.close(fds[0])
        old = self.regions.pop(cache_id, None)
        if old is not None:
            old.close()
        self.regions[cache_id] = region

    def _lost(self) -> None:
        if not self.closed:
            self.close()
            self.on_lost()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.ready.done():
            self.ready.cancel()
        if not self._loop.is_closed():
            self._loop.remove_reader(self.sock.fileno())
        self.sock.close()
        for region in self.regions.values():
            region.close()
        self.regions.clear()


class LocalListener:
    """An abstract unix socket where same-host peers attach their share channel."""

    def __init__(self, table: Any) -> None:
        self.table = table
        self.name = b"\0aio_datadist." + os.urandom(12).hex().encode()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self.sock.bind(self.name)
            self.sock.listen(64)
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.sock.fileno(), self._accept)
        self.closed = False

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return
            except OSError:
                return
            self._loop.create_task(self._attach(conn))

    async def _attach(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        try:
            async with asyncio.timeout(5):
                data = await self._loop.sock_recv(conn, _HELLO.size)
            magic, token = _HELLO.unpack(data)
        except (TimeoutError, OSError, struct.error):
            conn.close()
            return
        link = next((lk for lk in self.table.links.values()
                     if lk.broken is None and not lk.closed and hmac.compare_digest(lk.token, token)), None)
        if magic != _HELLO_MAGIC or link is None or link.local is not None:
            conn.close()
            return
        link.attach_local(conn)
        if link.local is not None:
            link.local.announce_ready()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self._loop.is_closed():
            self._loop.remove_reader(self.sock.fileno())
        self.sock.close()


async def connect_share(name: bytes, token: bytes) -> socket.socket:
    """Dial a same-host peer's listener and present the link token."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, name)
        await loop.sock_sendall(sock, _HELLO.pack(_HELLO_MAGIC, token))
        return sock
    except BaseException:
        sock.close()
        raise
