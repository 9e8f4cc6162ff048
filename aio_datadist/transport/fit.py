"""Whether a transfer request fits a cache: the one check an owner and a same-host reader both run.

The owner checks every request a peer sends it against the cache it names
(``owner.serve_plan``). A same-host requester that may read the owner's
blocks cache without asking (``transport/ledger.py``) runs the same check
against the geometry the owner declared when it shared the cache, and asks
the owner instead whenever it does not pass; the owner's refusal is then
the one the caller sees.
"""

from __future__ import annotations

import dataclasses
import weakref

from aio_datadist._checks import param_invalid
from aio_datadist.cache import KvCache
from aio_datadist.layers import one_side_span
from aio_datadist.plans import block_shape_digest
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.types import ALL_LAYERS, DataType
from aio_datadist.wire import ReqFlag, TransferReq

__all__ = ["Geometry", "Refusal", "fit", "geometry_of"]


class Refusal(Exception):
    """The owner refuses a peer's request with ``code`` before any byte moves."""

    def __init__(self, code: LLMStatusCode, text: str) -> None:
        super().__init__(text)
        self.code = code
        self.text = text


@dataclasses.dataclass(slots=True)
class Geometry:
    """What a request is checked against: one cache's kind, data type and geometry."""

    cache_id: int
    is_blocks: bool
    data_type: int  # DataType.value
    num_tensors: int
    rows: int
    row_bytes: int
    block_shape: int = 0  # the digest of a blocks cache's shape[1:] (plans.block_shape_digest)
    block_dims: tuple[int, ...] | None = None  # that shape, for messages (None: a peer's, declared by digest)


_KNOWN: weakref.WeakKeyDictionary[KvCache, Geometry] = weakref.WeakKeyDictionary()


def geometry_of(cache: KvCache) -> Geometry:
    """``cache``'s geometry (made once per cache)."""
    geo = _KNOWN.get(cache)
    if geo is None:
        lay, desc = cache.layout, cache.cache_desc
        blocks = cache.is_blocks_cache
        geo = _KNOWN[cache] = Geometry(cache.cache_id, blocks, desc.data_type.value, lay.num_tensors, lay.rows,
                                       lay.row_bytes, block_shape_digest(cache) if blocks else 0,
                                       tuple(desc.shape[1:]))
    return geo


def _type_name(value: int) -> str:
    """``value``'s DataType name; a peer's geometry (a NIXL ``GRANT``) may name one we do not know."""
    try:
        return DataType(value).name
    except ValueError:
        return f"data type {value}"


def fit(geo: Geometry, req: TransferReq, *, pull: bool, row: int | None) -> tuple[list[int], int, int]:
    """The rows ``req`` names in the cache (``row``, its target's row, when it names none), and the first
    tensor and tensor count of its layer range; :class:`Refusal` with the status the owner answers if it
    does not fit."""
    flags = req.flags
    # A cache that does not match the requester's is named by the key the requester gave for it.
    key_arg = "cache_key" if pull else "dst_cache_key"
    if flags & ReqFlag.BLOCKS and not geo.is_blocks:
        raise Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                      f"invalid argument '{key_arg}': cache {geo.cache_id} is not a blocks cache")
    if flags & ReqFlag.CONTIG and geo.is_blocks:
        raise Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                      f"invalid argument '{key_arg}': cache {geo.cache_id} is a blocks cache")
    if req.data_type != geo.data_type:
        raise Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                      f"invalid argument '{key_arg}': data types differ: cache {geo.cache_id} holds "
                      f"{_type_name(geo.data_type)}, the request's cache holds data type {req.data_type}")
    rows = list(req.rows)
    arg = "src_blocks" if pull else "dst_blocks"
    if rows and row is not None and not geo.is_blocks:
        # a key or (id, index) of a contiguous cache names its one row: listed rows would reach past the key
        raise Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                      f"invalid argument '{arg}': a request naming contiguous cache {geo.cache_id} by key or by "
                      "id and index moves that row only, and lists no rows")
    if not rows:
        if row is None:
            raise Refusal(LLMStatusCode.LLM_PARAM_INVALID, f"invalid argument '{arg}': no rows given")
        rows = [row]
        # the row came with the key (CacheKeyByIdAndIndex); the caller named no blocks
        arg = "cache_key.batch_index" if pull else "dst_cache_key.batch_index"
    bad = [r for r in rows if r >= geo.rows]
    if bad:
        what = "block" if geo.is_blocks else "batch"
        raise Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                      f"invalid argument '{arg}': {what} index {bad[0]} out of range [0, {geo.rows}) "
                      f"of cache {geo.cache_id}")
    if not pull and len(set(rows)) != len(rows):
        raise Refusal(LLMStatusCode.LLM_PARAM_INVALID, "invalid argument 'dst_blocks': a block is named twice")
    per_layer = req.tensor_num_per_layer
    arg = "src_layer_range" if pull else "dst_layer_range"
    try:
        if per_layer < 1:
            raise param_invalid("tensor_num_per_layer", "must be >= 1")
        first, count = one_side_span(geo.num_tensors, (req.layer_first, req.layer_last), per_layer, arg)
    except LLMException as exc:
        raise Refusal(exc.status_code, str(exc)) from None
    if count != req.tensor_count:
        whole = (req.layer_first, req.layer_last) == ALL_LAYERS  # the caller named no range: say what to give
        raise Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                      f"invalid argument '{arg}': the peer cache has {count} tensors in range, "
                      f"the local side {req.tensor_count}" + (
                          " (no layer range was given, so each side moves its whole cache; src_layer_range and "
                          "dst_layer_range select the layers to move)" if whole else ""))
    offset, nbytes = req.offset, req.nbytes
    if pull and offset and offset + nbytes > geo.row_bytes:  # only a pull's src_cache_offset moves into the row
        raise Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                      f"invalid argument 'src_cache_offset': src_cache_offset {offset} + size {nbytes} is past "
                      f"the end of the rows of cache {geo.cache_id} ({geo.row_bytes} bytes)")
    if nbytes == 0 or offset + nbytes > geo.row_bytes or (flags & ReqFlag.EXACT and offset + nbytes != geo.row_bytes):
        # whole rows that differ: the cache the key names does not match; else the caller's own ``size``
        size_arg = key_arg if flags & ReqFlag.EXACT else "size"
        raise Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                      f"invalid argument '{size_arg}': row size mismatch: cache {geo.cache_id} rows are "
                      f"{geo.row_bytes} bytes, "
                      f"the request moves {nbytes} bytes per row" + (f" from byte {offset}" if offset else ""))
    if req.block_shape and geo.is_blocks and req.block_shape != geo.block_shape:
        held = "blocks of another shape" if geo.block_dims is None else f"blocks of shape {geo.block_dims}"
        raise Refusal(LLMStatusCode.LLM_PARAM_INVALID,
                      f"invalid argument '{key_arg}': block shapes differ: cache {geo.cache_id} holds {held}, the "
                      "requester's blocks have the same bytes but another shape")
    return rows, first, count
