"""A transfer request, planned: the local rows it moves and the request the owner receives.

The manager and the layer-wise driver validate the caller's arguments, then
:func:`build_plan` turns them into a :class:`Plan`: the local half as copy
pairs (address, length runs in the wire's byte order) and the owner's half as
a :class:`~aio_datadist.wire.TransferReq` with no channel or timeout yet.
The requester (``transfers.py``) fills those in and sends it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Sequence
from typing import Any

from aio_datadist._checks import param_invalid
from aio_datadist.cache import KvCache, check_bounds
from aio_datadist.layers import check_spans, one_side_span
from aio_datadist.types import UINT64_MAX, BlocksCacheKey, CacheIndex, CacheKey, CacheKeyByIdAndIndex
from aio_datadist.wire import MAX_ROWS, ReqFlag, Target, TransferReq

__all__ = ["Plan", "addrs_target", "block_shape_digest", "build_plan", "target_fields"]


def block_shape_digest(cache: KvCache) -> int:
    """A non-zero 64-bit digest of a blocks cache's block shape (``shape[1:]``), for the owner to
    compare with its own: blocks of equal bytes but another shape are another layout."""
    return _shape_digest(tuple(cache.cache_desc.shape[1:]))


@functools.lru_cache(maxsize=256)
def _shape_digest(shape: tuple[int, ...]) -> int:
    digest = hashlib.blake2b(repr(shape).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") or 1


def target_fields(key: Any) -> dict[str, int]:
    """Wire fields naming a remote cache by key, id and row, or blocks key."""
    fields = dict(target_kind=0, cluster_id=0, cache_id=0, key_req_id=UINT64_MAX, prefix_id=UINT64_MAX,
                  model_id=0, batch_index=0)
    if isinstance(key, CacheKey):
        fields.update(target_kind=Target.CACHE_KEY, cluster_id=key.cluster_id, key_req_id=key.req_id,
                      prefix_id=key.prefix_id, model_id=key.model_id)
    elif isinstance(key, (CacheKeyByIdAndIndex, CacheIndex)):
        fields.update(target_kind=Target.ID_INDEX, cluster_id=key.cluster_id, cache_id=key.cache_id,
                      batch_index=key.batch_index)
    elif isinstance(key, BlocksCacheKey):
        fields.update(target_kind=Target.BLOCKS_KEY, cluster_id=key.cluster_id, model_id=key.model_id)
    else:
        raise TypeError(type(key).__name__)
    return fields


def addrs_target(cluster_id: int) -> dict[str, int]:
    """Wire fields of a request that names the owner's memory by raw addresses (in its rows)."""
    return dict(target_kind=Target.ADDRS, cluster_id=cluster_id, cache_id=0, key_req_id=0, prefix_id=0,
                model_id=0, batch_index=0)


@dataclasses.dataclass
class Plan:
    """A validated request: the local half and what to ask the owner (``remote``, channel and timeout unset)."""

    local: KvCache
    total: int
    remote: TransferReq
    local_first: int = 0
    local_count: int = 0
    local_rows: tuple[int, ...] = ()
    local_nbytes: int = 0
    local_offset: int = 0

    @functools.cached_property
    def local_pairs(self) -> Any:
        """The local half as copy pairs (made when a plane copies by address: NIXL reads by row index)."""
        return self.local.layout.segments(self.local_first, self.local_count, list(self.local_rows),
                                          self.local_offset, self.local_nbytes)

    @property
    def by_address(self) -> bool:
        """Whether the owner's memory is named by raw addresses (only the stream plane carries that)."""
        return self.remote.target_kind == Target.ADDRS


def build_plan(local: KvCache, local_layers: tuple[int, int], remote_layers: tuple[int, int],
               per_layer: int, local_rows: Sequence[int], local_nbytes: int, remote_rows: Sequence[int],
               remote_nbytes: int, flags: int, target: dict[str, int], local_arg: str, *,
               remote_offset: int = 0, local_offset: int = 0) -> Plan:
    """Check the two layer spans against each other and the local cache, and plan both halves.

    ``local_arg`` is ``"dst"`` for a pull (the local cache receives) and ``"src"`` for a push; it
    picks the argument names of errors. ``local_offset`` and ``remote_offset`` are byte offsets
    inside each row. A whole-block transfer between blocks caches (``BLOCKS | EXACT``) carries the
    local block shape for the owner to check.
    """
    if len(remote_rows) > MAX_ROWS:
        raise param_invalid("src_blocks" if local_arg == "dst" else "dst_blocks",
                            f"{len(remote_rows)} blocks in one request; the protocol carries at most {MAX_ROWS}")
    check_spans(remote_layers, local_layers)
    first, count = one_side_span(local.cache_desc.num_tensors, local_layers, per_layer,
                                 "dst_layer_range" if local_arg == "dst" else "src_layer_range")
    check_bounds(local.layout, first, count, local_rows, local_offset, local_nbytes)  # before anything is sent
    total = count * len(local_rows) * local_nbytes
    whole_blocks = local.is_blocks_cache and flags & ReqFlag.BLOCKS and flags & ReqFlag.EXACT
    remote = TransferReq(channel=0, **target, layer_first=remote_layers[0], layer_last=remote_layers[1],
                         tensor_num_per_layer=per_layer, tensor_count=count,
                         data_type=local.cache_desc.data_type._value_, offset=remote_offset, nbytes=remote_nbytes,
                         flags=flags, timeout_ms=0, rows=tuple(remote_rows),
                         block_shape=block_shape_digest(local) if whole_blocks else 0)
    return Plan(local, total, remote, first, count, tuple(local_rows), local_nbytes, local_offset)
