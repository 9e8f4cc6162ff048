"""The workload every benchmark shares: KV cache geometry, sizes, block lists, buffers."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

#: Request sizes, in blocks, that every benchmark reports.
BLOCK_COUNTS: tuple[int, ...] = (1, 4, 64, 512)
#: Sizes with ``--full``.
FULL_BLOCK_COUNTS: tuple[int, ...] = (1, 4, 64, 512, 4096)


@dataclass(frozen=True)
class KvGeometry:
    """Geometry of the paged KV cache every benchmark uses.

    ``num_tensors`` tensors of shape ``[num_blocks, *block_shape]``; one block of
    one tensor is :attr:`block_bytes` (32 KiB by default), a request of ``B``
    blocks moves ``B * num_tensors * block_bytes`` (B=64 -> 128 MiB).
    """

    num_tensors: int = 64
    block_shape: tuple[int, ...] = (16, 8, 128)
    dtype: str = "float16"

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one tensor."""
        return math.prod(self.block_shape) * self.itemsize

    def request_bytes(self, num_blocks: int) -> int:
        """Bytes moved by a request of ``num_blocks`` blocks over all tensors."""
        return num_blocks * self.num_tensors * self.block_bytes

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, *self.block_shape)

    @property
    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.dtype)

    def make_tensors(self, num_blocks: int, *, device: str = "cpu", zeroed: bool = True) -> list[Any]:
        """The cache as torch tensors.

        ``zeroed=True`` fills them, so every page is resident before timing;
        ``zeroed=False`` leaves them untouched: cheaper when only some blocks are
        used, and those are then faulted in by the first (warmup) transfer.
        """
        import torch

        make = torch.zeros if zeroed else torch.empty
        shape = self.tensor_shape(num_blocks)
        return [make(shape, dtype=self.torch_dtype, device=device) for _ in range(self.num_tensors)]


def cache_blocks_for(num_blocks_request: int) -> int:
    """Cache size (blocks per tensor) the benchmarks allocate for a request size."""
    return max(64, 2 * num_blocks_request)


def random_blocks(num_blocks_total: int, count: int, seed: int) -> list[int]:
    """``count`` unique block indices in ``[0, num_blocks_total)``, shuffled, seeded.

    Raises:
        ValueError: ``count`` is negative or larger than ``num_blocks_total``.
    """
    if not 0 <= count <= num_blocks_total:
        raise ValueError(f"count must be within [0, num_blocks_total={num_blocks_total}], got {count!r}")
    return random.Random(seed).sample(range(num_blocks_total), count)


_STAMP_BASE = 2048  # fp16 holds every integer below 2049 exactly


def stamp_blocks(tensors: Sequence[Any]) -> None:
    """Write a marker (block index, tensor index) into the first elements of every block.

    Lets a benchmark check cheaply, after timing, that the right blocks landed in
    the right places (:func:`verify_blocks`). Torch tensors of any float dtype.
    """
    import torch

    for i, t in enumerate(tensors):
        flat = t.view(t.shape[0], -1)
        idx = torch.arange(t.shape[0], device=t.device)
        flat[:, 0] = (idx % _STAMP_BASE).to(t.dtype)
        flat[:, 1] = (idx // _STAMP_BASE).to(t.dtype)
        flat[:, 2] = float(i % _STAMP_BASE)


def verify_blocks(dst_tensors: Sequence[Any], dst_blocks: Sequence[int], src_blocks: Sequence[int]) -> bool:
    """True when block ``dst_blocks[k]`` of every tensor carries the stamp of ``src_blocks[k]``."""
    import torch

    if len(dst_blocks) != len(src_blocks):
        raise ValueError("dst_blocks and src_blocks must have the same length")
    if not dst_blocks:
        return True
    src = torch.tensor(list(src_blocks), dtype=torch.int64)
    dst = torch.tensor(list(dst_blocks), dtype=torch.int64)
    for i, t in enumerate(dst_tensors):
        got = t.view(t.shape[0], -1)[dst.to(t.device), :3].to("cpu", torch.float64)
        tensor_index = torch.full_like(src, i % _STAMP_BASE)
        want = torch.stack([src % _STAMP_BASE, src // _STAMP_BASE, tensor_index], dim=1).double()
        if not torch.equal(got, want):
            return False
    return True


def aligned_empty(nbytes: int, alignment: int = 4096) -> np.ndarray:
    """An uninitialised uint8 numpy array of ``nbytes`` whose data starts on ``alignment``."""
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment!r}")
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw[offset : offset + nbytes]


def format_bytes(nbytes: int) -> str:
    """``2 MiB``, ``32 KiB``, ``1.5 GiB``, ``32 B``."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= size:
            value = nbytes / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes} B"


def blocks_label(num_blocks: int, geometry: KvGeometry | None = None) -> str:
    """Case label for a request size: ``64 blk (128 MiB)``."""
    geometry = geometry or KvGeometry()
    return f"{num_blocks} blk ({format_bytes(geometry.request_bytes(num_blocks))})"

