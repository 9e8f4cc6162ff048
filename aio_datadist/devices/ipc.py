"""CUDA IPC handles for device caches: same-host peers copy device to device, no host round trip.

The owner :func:`export_cache` s a device cache once (at link or allocation
time, as memfds are shared for host caches): the result is plain bytes, no
pickle, made of torch's CUDA IPC storage handles (``_share_cuda_``, the
mechanism ``torch.multiprocessing`` uses, with its producer-side reference
counting, so the owner's allocator keeps the memory while a peer maps it)
and the cache geometry. The peer :func:`open_export` s those bytes, which
validates every length and bound, and gets a :class:`PeerDeviceCache` whose
rows the copy engine reads like any local device cache: a pull is one
batched device-to-device copy on the puller's copy stream.

Ordering: a mapped cache only shows what the owner's device work has
finished. The owner must answer a request only after the rows are final on
its device (a StreamNotifier completion on the stream that wrote them).

Hook for the link layer (not wired here): send ``export_cache(cache)`` with
the cache id when a device cache is added (``registry.on_add``), withdraw it
on ``on_free``; the puller keeps ``open_export`` results per (peer, cache id),
validates each request as for host caches, then calls :func:`pull_rows`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from aio_datadist.cache import KvCache
from aio_datadist.devices.copies import DeviceCopy, Side, cache_side

if TYPE_CHECKING:
    from aio_datadist.devices.ops import DeviceRuntime

__all__ = ["PeerDeviceCache", "export_cache", "open_export", "pull_rows"]

_MAGIC = b"AIOI"
_VERSION = 1
_HEAD = struct.Struct("<4sHHHIQQQ")      # magic, version, device, storages, tensors, rows, row bytes, tensor bytes
_STORAGE = struct.Struct("<QQQB")        # storage bytes, storage offset, ref-counter offset, event sync required
_TENSOR = struct.Struct("<HQ")           # storage index, byte offset in the storage
_NONE = 0xFFFF
MAX_TENSORS = 1 << 16


@dataclass(frozen=True)
class _Shared:
    handle: bytes | None
    size: int
    offset: int
    ref_counter: bytes | None
    ref_offset: int
    event: bytes | None
    event_sync: bool


def _put_bytes(out: bytearray, value: bytes | None) -> None:
    if value is None:
        out += struct.pack("<H", _NONE)
        return
    if len(value) >= _NONE:
        raise ValueError("IPC handle field too long")
    out += struct.pack("<H", len(value)) + value


def _get_bytes(data: bytes, pos: int) -> tuple[bytes | None, int]:
    if pos + 2 > len(data):
        raise ValueError("truncated IPC export")
    (n,) = struct.unpack_from("<H", data, pos)
    pos += 2
    if n == _NONE:
        return None, pos
    if pos + n > len(data):
        raise ValueError("truncated IPC export")
    return bytes(data[pos:pos + n]), pos + n


def export_cache(cache: KvCache) -> bytes:
    """The bytes a same-host peer needs to map ``cache`` (a CUDA device cache)."""
    if cache.device.type != "cuda":
        raise ValueError(f"only CUDA device caches have IPC handles, this one is on {cache.device}")
    storages: list[Any] = []
    index: dict[int, int] = {}
    tensors = []
    for t in cache.tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in index:
            index[key] = len(storages)
            storages.append(storage)
        tensors.append((index[key], t.data_ptr() - key))
    lay = cache.layout
    out = bytearray(_HEAD.pack(_MAGIC, _VERSION, cache.device.index, len(storages), len(tensors),
                               lay.rows, lay.row_bytes, lay.tensor_bytes))
    for storage in storages:
        _, handle, size, offset, ref_counter, ref_offset, event, event_sync = storage._share_cuda_()
        _put_bytes(out, handle)
        _put_bytes(out, ref_counter)
        _put_bytes(out, event)
        out += _STORAGE.pack(size, offset, ref_offset, bool(event_sync))
    for storage_index, offset in tensors:
        out += _TENSOR.pack(storage_index, offset)
    return bytes(out)


class PeerDeviceCache:
    """A same-host peer's device cache mapped into this process (read through the copy engine)."""

    def __init__(self, device: torch.device, rows: int, row_bytes: int, tensor_bytes: int,
                 storages: list[Any], tensors: list[tuple[int, int]]) -> None:
        self.device = device
        self.rows = rows
        self.row_bytes = row_bytes
        self.tensor_bytes = tensor_bytes
        self._storages = storages
        self.bases = tuple(storages[s].data_ptr() + off for s, off in tensors)
        self._views = tuple(torch.empty(0, dtype=torch.uint8, device=device)
                            .set_(storages[s], off, (rows, row_bytes), (row_bytes, 1)) for s, off in tensors)

    @property
    def num_tensors(self) -> int:
        return len(self.bases)

    def side(self, rows: Sequence[int], offset: int, nbytes: int, first: int = 0, count: int | None = None) -> Side:
        """Rows of tensors ``[first, first+count)`` for the copy engine, bounds checked."""
        count = self.num_tensors - first if count is None else count
        if not (0 <= first and 0 <= count and first + count <= self.num_tensors):
            raise AssertionError("tensor span outside the peer cache")
        if rows and not (0 <= min(rows) and max(rows) < self.rows):
            raise AssertionError("row outside the peer cache")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.row_bytes:
            raise AssertionError("byte range outside the peer cache's rows")
        views = self._views[first:first + count]
        return Side(self.bases[first:first + count], self.row_bytes, tuple(rows), offset, self.device,
                    lambda: views)

    def close(self) -> None:
        """Drop the mapping (it goes once no copy in flight holds it)."""
        self._views = ()
        self._storages = []


def open_export(data: bytes, device: torch.device) -> PeerDeviceCache:
    """Map a peer's :func:`export_cache` bytes; ValueError for anything malformed or out of bounds."""
    if len(data) < _HEAD.size:
        raise ValueError("truncated IPC export")
    magic, version, dev, n_storages, n_tensors, rows, row_bytes, tensor_bytes = _HEAD.unpack_from(data, 0)
    if magic != _MAGIC or version != _VERSION:
        raise ValueError("not an aio_datadist IPC export (or another version)")
    if dev != device.index:
        raise ValueError(f"the export is of cuda:{dev}, this process uses {device}")
    if not (0 < n_tensors <= MAX_TENSORS and 0 < n_storages <= n_tensors):
        raise ValueError("bad tensor or storage count")
    if rows == 0 or row_bytes == 0 or rows * row_bytes != tensor_bytes:
        raise ValueError("bad cache geometry")
    pos = _HEAD.size
    shared = []
    for _ in range(n_storages):
        handle, pos = _get_bytes(data, pos)
        ref_counter, pos = _get_bytes(data, pos)
        event, pos = _get_bytes(data, pos)
        if pos + _STORAGE.size > len(data):
            raise ValueError("truncated IPC export")
        size, offset, ref_offset, event_sync = _STORAGE.unpack_from(data, pos)
        pos += _STORAGE.size
        if handle is None or size == 0:
            raise ValueError("an exported storage has no memory")
        shared.append(_Shared(handle, size, offset, ref_counter, ref_offset, event, bool(event_sync)))
    tensors = []
    for _ in range(n_tensors):
        if pos + _TENSOR.size > len(data):
            raise ValueError("truncated IPC export")
        storage_index, offset = _TENSOR.unpack_from(data, pos)
        pos += _TENSOR.size
        if storage_index >= n_storages or offset + tensor_bytes > shared[storage_index].size:
            raise ValueError("an exported tensor lies outside its storage")
        tensors.append((storage_index, offset))
    if pos != len(data):
        raise ValueError("trailing bytes after the IPC export")
    torch.cuda.init()
    storages = [torch.UntypedStorage._new_shared_cuda(dev, s.handle, s.size, s.offset, s.ref_counter,
                                                      s.ref_offset, s.event, s.event_sync)
                for s in shared]
    return PeerDeviceCache(device, rows, row_bytes, tensor_bytes, storages, tensors)


async def pull_rows(rt: DeviceRuntime, peer: PeerDeviceCache, src_rows: Sequence[int], dst: KvCache,
                    dst_rows: Sequence[int], offset: int, nbytes: int, timeout_ms: int, what: str = "ipc pull",
                    first: int = 0, count: int | None = None, method: str | None = None) -> int:
    """Copy rows of a mapped peer cache into a local device cache; returns the bytes moved."""
    backend = rt.devices
    if backend is None:
        raise AssertionError("IPC pulls need the CUDA backend")
    count = peer.num_tensors - first if count is None else count
    src = peer.side(src_rows, offset, nbytes, first, count)
    dst_side = cache_side(dst, dst_rows, offset, nbytes, first, count)
    job = DeviceCopy(backend, dst_side, src, nbytes, method, keepalive=(peer, dst))
    return await rt.completions.start(job.submit, job.cancel, timeout_ms=timeout_ms, what=what, keepalive=job)
