"""A same-host peer's device cache as this process mapped it: the source side of a device IPC copy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from aio_datadist.devices.copies import Side
from aio_datadist.devices.ipc import ExportInvalid

__all__ = ["PeerDeviceCache"]


class PeerDeviceCache:
    """A same-host peer's device cache mapped here, with the geometry the peer declared for it."""

    __slots__ = ("cache_id", "mapping", "rows", "row_bytes", "tensor_bytes", "offsets", "device")

    def __init__(self, cache_id: int, mapping: Any, rows: int, row_bytes: int, tensor_bytes: int,
                 offsets: Sequence[int], device: torch.device) -> None:
        if rows <= 0 or row_bytes <= 0 or rows * row_bytes != tensor_bytes:
            raise ExportInvalid(f"geometry {rows} rows x {row_bytes} bytes != {tensor_bytes} tensor bytes")
        if not offsets or any(o < 0 or o + tensor_bytes > mapping.nbytes for o in offsets):
            raise ExportInvalid(f"a tensor lies outside the {mapping.nbytes}-byte export")
        self.cache_id = cache_id
        self.mapping = mapping
        self.rows = rows
        self.row_bytes = row_bytes
        self.tensor_bytes = tensor_bytes
        self.offsets = tuple(offsets)
        self.device = device

    @property
    def num_tensors(self) -> int:
        return len(self.offsets)

    def side(self, rows: Sequence[int], offset: int, nbytes: int, first: int, count: int) -> Side:
        """Rows of tensors ``[first, first + count)`` as the source of a device copy, bounds checked."""
        if not (0 <= first and 0 < count and first + count <= self.num_tensors):
            raise ExportInvalid("tensor span outside the peer cache")
        if not rows or min(rows) < 0 or max(rows) >= self.rows:
            raise ExportInvalid("row outside the peer cache")
        if offset < 0 or nbytes <= 0 or offset + nbytes > self.row_bytes:
            raise ExportInvalid("byte range outside the peer cache's rows")
        base = self.mapping.address
        if not base:
            raise ExportInvalid("the peer cache is no longer mapped")
        offsets = self.offsets[first:first + count]
        mapping, rows_n, row_bytes, tensor_bytes = self.mapping, self.rows, self.row_bytes, self.tensor_bytes

        def views() -> tuple[torch.Tensor, ...]:
            return tuple(mapping.view(o, tensor_bytes).view(rows_n, row_bytes) for o in offsets)

        return Side(tuple(base + o for o in offsets), self.row_bytes, tuple(rows), offset, self.device, views)

    def close(self) -> None:
        self.mapping.close()
