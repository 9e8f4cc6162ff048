"""Batched row copies on a device stream: the copy kernel, torch indexing, driver batches.

A copy moves ``nbytes`` from row ``src.rows[i]`` of tensor ``t`` to row
``dst.rows[i]`` of tensor ``t``, for every tensor and row pair of two
:class:`Side` s. It is enqueued on the backend's copy stream with a fixed
number of calls, whatever the number of rows:

``kernel``  one Triton launch over the per-tensor base-address tables and the
            row tables (device memory, or page-locked host memory the device
            can address). The default on CUDA between device rows, and between
            device rows and a page-locked host cache.
``torch``   ``index_select`` + ``index_copy_`` per tensor (two launches per
            tensor). The fallback without Triton, and the NPU path.
``batch``   one ``cuMemcpyBatchAsync`` of the coalesced segment list (CUDA
            12.8+ drivers); the copy engines move host<->device rows without
            staging. The default for host<->device on CUDA where the host
            cache is not page-locked or there is no Triton (page-locked host
            caches go by the kernel, through their mapped addresses).
``staged``  host<->device through page-locked chunk buffers (``staging.py``),
            when there are no driver batches (the NPU, older CUDA drivers).

Callers validate every index first; :func:`cache_side` checks the final
bounds once more, since the addresses go to a kernel or the driver.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from aio_datadist import _core
from aio_datadist.cache import KvCache, check_bounds
from aio_datadist.devices import kernels
from aio_datadist.devices.backend import DeviceBackend

__all__ = ["METHODS", "DeviceCopy", "Side", "buffer_side", "cache_side", "choose_method", "enqueue_rows",
           "kernel_side"]

METHODS = ("kernel", "torch", "batch", "staged")


@dataclass(frozen=True)
class Side:
    """One end of a row copy.

    ``bases[t]`` is tensor ``t``'s address, rows are ``stride`` bytes apart
    and the copied bytes start ``offset`` into each row. :meth:`views` gives
    the same memory as ``[rows, stride]`` uint8 tensors (built only for the
    torch path). ``identity`` says ``rows`` is ``0..n-1`` of a packed buffer.
    """

    bases: tuple[int, ...]
    stride: int
    rows: Sequence[int]  # a tuple, or an int64 array.array
    offset: int
    device: torch.device
    make_views: Callable[[], tuple[torch.Tensor, ...]]
    identity: bool = False
    #: Plain host memory (a host cache, a staging buffer), as opposed to the device backend's memory.
    on_host: bool = False

    def views(self) -> tuple[torch.Tensor, ...]:
        return self.make_views()


def cache_side(cache: KvCache, rows: Sequence[int], offset: int, nbytes: int,
               first: int = 0, count: int | None = None) -> Side:
    """Rows ``rows`` of tensors ``[first, first + count)`` of ``cache``, bounds checked."""
    lay = cache.layout
    count = lay.num_tensors - first if count is None else count
    check_bounds(lay, first, count, rows, offset, nbytes)
    tensors = cache.tensors[first:first + count]

    def views() -> tuple[torch.Tensor, ...]:
        return tuple(t.view(torch.uint8).view(lay.rows, lay.row_bytes) for t in tensors)

    # An int64 array (what copy_blocks' bulk check gives) stays one: the row table is then built by a copy.
    kept = array.array("q", rows) if isinstance(rows, array.array) else tuple(rows)
    return Side(tuple(lay.bases[first:first + count]), lay.row_bytes, kept, offset, cache.device, views,
                on_host=not cache.on_device)


def kernel_side(side: Side, pin: Any) -> Side:
    """``side`` of a page-locked host cache as a kernel on the device addresses it: through the pin's
    mapped device pointer (``HostPin.device_address``), which equals the host address only where the
    device can use host pointers for registered memory."""
    shift = pin.device_address - pin.address
    if shift == 0:
        return side
    for b in side.bases:
        if not pin.address <= b < pin.address + pin.nbytes:
            raise AssertionError("a tensor outside the cache's page-locked region")
    return dataclasses.replace(side, bases=tuple(b + shift for b in side.bases))


def buffer_side(buffer: torch.Tensor, position: int, tensors: int, rows: int, nbytes: int) -> Side:
    """``tensors x rows`` units of ``nbytes`` packed tensor-major in ``buffer`` from byte ``position``."""
    span = tensors * rows * nbytes
    if position < 0 or position + span > buffer.numel():
        raise AssertionError("packed span outside the staging buffer")
    base = buffer.data_ptr() + position

    def views() -> tuple[torch.Tensor, ...]:
        packed = buffer[position:position + span].view(tensors, rows, nbytes)
        return tuple(packed[t] for t in range(tensors))

    return Side(tuple(base + t * rows * nbytes for t in range(tensors)), nbytes, tuple(range(rows)), 0,
                buffer.device, views, identity=True, on_host=True)


def choose_method(backend: DeviceBackend, dst: Side, src: Side, *, host_pinned: bool = False) -> str:
    """The default method for a copy between ``dst`` and ``src`` (see the module docstring).

    ``host_pinned``: the host sides are page-locked caches the device can address (``HostPin``), which the
    kernel reaches directly: on an H200 it moved 512 rows of 32 KiB x 64 tensors host<->device at 0.95-0.97x a
    contiguous page-locked copy, ``cuMemcpyBatchAsync`` at 0.52-0.54x (benchmarks/RESULTS.md, "GPU").
    """
    if dst.on_host or src.on_host:
        if host_pinned and backend.kind == "cuda" and kernels.available():
            return "kernel"
        return "batch" if backend.batch_copies else "staged"
    if backend.kind == "host":
        return "batch"  # the host backend's stream runs driver-style copy lists
    return "kernel" if backend.kind == "cuda" and kernels.available() else "torch"


def enqueue_rows(backend: DeviceBackend, dst: Side, src: Side, nbytes: int, method: str,
                 keep: list[Any]) -> int:
    """Enqueue the copy on the current stream (the caller holds the copy stream); returns its bytes.

    Device tensors it allocates (row tables, torch temporaries) belong to the
    current stream, so the allocator does not reuse them before the stream
    passes the copy; ``keep`` gets them as well.
    """
    if len(dst.bases) != len(src.bases) or len(dst.rows) != len(src.rows):
        raise AssertionError("the two sides of a copy differ in tensors or rows")
    total = len(dst.bases) * len(dst.rows) * nbytes
    if total == 0:
        return 0
    if method == "batch":
        triples = _core.copy_segments(array.array("Q", dst.bases), array.array("q", dst.rows), dst.stride,
                                      dst.offset, array.array("Q", src.bases), array.array("q", src.rows),
                                      src.stride, src.offset, nbytes)
        cols = np.frombuffer(triples, dtype=np.uint64).reshape(-1, 3)
        dsts, srcs, sizes = (np.ascontiguousarray(cols[:, i]) for i in range(3))
        keep.append((dsts, srcs, sizes))
        backend.memcpy_batch(dsts, srcs, sizes)
    elif method == "kernel":
        dst_bases = backend.table(dst.bases, cache=True)
        src_bases = backend.table(src.bases, cache=True)
        joined = array.array("q", dst.rows)  # one upload for both row tables
        joined.extend(src.rows)
        both = backend.table(joined)
        n = len(dst.rows)
        dst_rows, src_rows = both[:n], both[n:]
        keep.extend((dst_bases, src_bases, both))
        geo = kernels.geometry(nbytes, backend.alignment(dst.bases), backend.alignment(src.bases), dst.stride,
                               src.stride, dst.offset, src.offset)
        kernels.launch_copy_rows(dst_bases, src_bases, dst_rows, src_rows, dst_stride=dst.stride,
                                 src_stride=src.stride, dst_offset=dst.offset, src_offset=src.offset,
                                 geo=geo, num_tensors=len(dst.bases))
    elif method == "torch":
        _enqueue_torch(backend, dst, src, nbytes, keep)
    else:
        raise ValueError(f"unknown copy method {method!r}")
    return total


def _enqueue_torch(backend: DeviceBackend, dst: Side, src: Side, nbytes: int, keep: list[Any]) -> None:
    for side in (dst, src):
        if side.on_host and not side.identity:
            # A host gather or scatter would run on this thread; only packed staging buffers come here.
            raise AssertionError("torch copies touch the host only through packed staging buffers")
    src_rows = None if src.identity else backend.table(src.rows)
    dst_rows = None if dst.identity else backend.table(dst.rows)
    keep.extend((src_rows, dst_rows))
    for s_view, d_view in zip(src.views(), dst.views(), strict=True):
        s = s_view[:, src.offset:src.offset + nbytes]
        d = d_view[:, dst.offset:dst.offset + nbytes]
        picked = s if src_rows is None else s.index_select(0, src_rows)
        if src.on_host:
            picked = picked.to(backend.device, non_blocking=True)
        if dst_rows is None:
            d.copy_(picked, non_blocking=True)
        else:
            d.index_copy_(0, dst_rows, picked)
        keep.append(picked)


class DeviceCopy:
    """One row copy as a completion: :meth:`submit` enqueues it and the notifier's record ends it.

    Pass ``submit`` and ``cancel`` to ``Completions.start`` with the copy
    itself as keepalive: the caches and every temporary stay alive until the
    record says the stream is past the copy.
    """

    def __init__(self, backend: DeviceBackend, dst: Side, src: Side, nbytes: int, method: str | None = None,
                 keepalive: Any = None) -> None:
        if dst.on_host and src.on_host:
            raise AssertionError("host-to-host copies belong to the HostCopyEngine")
        self.backend = backend
        self.dst = dst
        self.src = src
        self.nbytes = nbytes
        self.method = method or choose_method(backend, dst, src)
        if self.method == "staged":
            raise AssertionError("staged copies run through devices.staging")
        self.keep: list[Any] = [keepalive]
        self.total = len(dst.bases) * len(dst.rows) * nbytes

    def submit(self, token: int) -> None:
        # Part of the copy may be enqueued when this fails: the backend then holds the copy (and with
        # it the caches and temporaries) until the stream drained; nothing blocks.
        self.backend.enqueue_and_notify(
            token, lambda: enqueue_rows(self.backend, self.dst, self.src, self.nbytes, self.method, self.keep),
            self.total, self, f"device copy ({self.method})")

    def cancel(self, token: int) -> bool:
        return self.backend.cancel(token)
