"""The one-pass block-copy kernel, written in Triton and loaded only where Triton exists.

One program copies one chunk of one (tensor, row pair): its addresses come
from a table of per-tensor base addresses and a table of row indices, so a
whole ``copy_blocks`` of any number of tensors and blocks is one launch, with
no intermediate buffer and no Python per block. Rows are moved in units of
the widest power of two (up to 16 bytes) that divides every address, stride,
offset and length, so aligned caches get 16-byte loads and stores.

Triton is imported lazily: this module imports (and :func:`available` says
False) on machines without it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

__all__ = ["available", "RowGeometry", "geometry", "launch_copy_rows"]

# Bytes one program moves per loop step, and at most per program.
STEP_BYTES = 8192
CHUNK_BYTES = 65536
NUM_WARPS = 4


@functools.cache
def _triton() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_rows(dst_bases, src_bases, dst_rows, src_rows, n_rows, dst_stride, src_stride,
                  dst_offset, src_offset, row_units, chunks_per_row,
                  ELEM: tl.constexpr, ALIGN: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                  EVEN: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        chunk = pid % chunks_per_row
        rest = pid // chunks_per_row
        r = rest % n_rows
        t = rest // n_rows
        d = tl.load(dst_bases + t) + tl.load(dst_rows + r) * dst_stride + dst_offset
        s = tl.load(src_bases + t) + tl.load(src_rows + r) * src_stride + src_offset
        # The hint goes on the pointers: on the integers it does not reach the loads.
        dp = tl.multiple_of(d.to(tl.pointer_type(ELEM)), ALIGN)
        sp = tl.multiple_of(s.to(tl.pointer_type(ELEM)), ALIGN)
        start = chunk * CHUNK
        end = tl.minimum(start + CHUNK, row_units)
        offs = tl.arange(0, BLOCK)
        for i in range(0, CHUNK, BLOCK):
            idx = start + i + offs
            if EVEN:
                tl.store(dp + idx, tl.load(sp + idx))
            else:
                mask = idx < end
                tl.store(dp + idx, tl.load(sp + idx, mask=mask), mask=mask)

    return triton, tl, copy_rows


def available() -> bool:
    """Whether Triton imports here (it exists only on machines with a GPU toolchain)."""
    try:
        _triton()
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class RowGeometry:
    """How the kernel moves rows of ``nbytes``: element width, units and chunking."""

    unit: int            # bytes per element (1, 2, 4 or 8)
    align: int           # bytes every address is known to be a multiple of (up to 16)
    row_units: int       # elements per row
    chunk_units: int     # elements per program
    chunks_per_row: int
    block: int           # elements per loop step
    even: bool           # every chunk is a whole number of steps (no masks)


def geometry(nbytes: int, *values: int) -> RowGeometry:
    """Kernel geometry for rows of ``nbytes`` whose addresses are built from ``values``.

    ``values`` are every base address, stride and offset that goes into an
    address; the widest power of two dividing all of them and ``nbytes``
    (capped at 16) is the alignment, and elements are at most 8 bytes wide.
    """
    if nbytes <= 0:
        raise ValueError("nbytes must be positive")
    acc = nbytes
    for v in values:
        acc |= v
    align = 16
    while acc % align:
        align //= 2
    unit = min(align, 8)
    row_units = nbytes // unit
    block = STEP_BYTES // unit
    chunk_units = min(row_units, CHUNK_BYTES // unit)
    if chunk_units > block:
        chunk_units -= chunk_units % block
    chunks = -(-row_units // chunk_units)
    even = row_units % chunk_units == 0 and chunk_units % block == 0
    return RowGeometry(unit, align, row_units, chunk_units, chunks, block, even)


def launch_copy_rows(dst_bases: Any, src_bases: Any, dst_rows: Any, src_rows: Any, *,
                     dst_stride: int, src_stride: int, dst_offset: int, src_offset: int,
                     geo: RowGeometry, num_tensors: int) -> None:
    """Enqueue one launch on the current stream of the tables' device.

    ``*_bases`` are int64 device tensors of ``num_tensors`` byte addresses,
    ``*_rows`` int64 device tensors of equal length. Callers validate bounds.
    """
    _, tl, kernel = _triton()
    elem = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}[geo.unit]
    n_rows = dst_rows.numel()
    grid = (geo.chunks_per_row * n_rows * num_tensors,)
    kernel[grid](dst_bases, src_bases, dst_rows, src_rows, n_rows, dst_stride, src_stride,
                 dst_offset, src_offset, geo.row_units, geo.chunks_per_row,
                 ELEM=elem, ALIGN=geo.align, CHUNK=geo.chunk_units, BLOCK=geo.block, EVEN=geo.even,
                 num_warps=NUM_WARPS)
