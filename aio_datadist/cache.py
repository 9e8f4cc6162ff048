"""KvCache objects, their validated geometry, and the per-instance registry.

Geometry follows LLM-DataDist: every tensor of a cache has ``cache_desc.shape``;
its leading dimension holds rows (batch rows of a contiguous cache, blocks of
a blocks cache), ``row_bytes = tensor_bytes / shape[0]``. Raw addresses live
only in :class:`CacheLayout`, which every request is checked against before a
segment list is built.
"""

from __future__ import annotations

import array
import contextlib
import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from aio_datadist import _core
from aio_datadist._checks import check_instance, param_invalid, param_type_error, shown
from aio_datadist.devices.host import HostRegion, round_up, tensor_at
from aio_datadist.mapped import check_mapped
from aio_datadist.spans import SpanIndex
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.types import (
    UINT64_MAX,
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    Placement,
)

__all__ = ["CacheLayout", "CacheRegistry", "KeyBinding", "KvCache", "check_bounds"]

log = logging.getLogger("aio_datadist.cache")


class CacheLayout:
    """Base addresses and row geometry of a cache's tensors."""

    __slots__ = ("bases", "rows", "row_bytes", "tensor_bytes", "num_tensors")

    def __init__(self, addrs: Sequence[int], desc: CacheDesc) -> None:
        self.bases = array.array("Q", addrs)
        self.num_tensors = desc.num_tensors
        self.tensor_bytes = desc.size
        self.rows = desc.shape[0]
        self.row_bytes = desc.size // desc.shape[0]

    def span_bases(self, first: int, count: int) -> array.array:
        return self.bases[first:first + count]

    def segments(self, first: int, count: int, rows: Sequence[int], offset: int,
                 nbytes: int) -> array.array:
        """``[addr, nbytes, ...]`` of ``rows`` in tensors ``[first, first+count)``.

        The caller has validated rows and byte ranges; this only asserts the
        final bounds once more, since the result is handed to native code.
        """
        check_bounds(self, first, count, rows, offset, nbytes)
        return _core.segments(self.span_bases(first, count), array.array("q", rows),
                              self.row_bytes, offset, nbytes)


def check_bounds(layout: CacheLayout, first: int, count: int, rows: Sequence[int],
                 offset: int, nbytes: int) -> None:
    """Assert that tensors ``[first, first+count)``, ``rows`` and the byte range lie inside the cache."""
    if not (0 <= first and first + count <= layout.num_tensors):
        raise AssertionError("tensor span outside the cache")
    if rows and not (0 <= min(rows) and max(rows) < layout.rows):
        raise AssertionError("row outside the cache")
    end = (max(rows) if rows else 0) * layout.row_bytes + offset + nbytes
    if offset < 0 or nbytes < 0 or end > layout.tensor_bytes:
        raise AssertionError("byte range outside the cache")


def copy_triples(dst: CacheLayout, dst_first: int, dst_rows: Sequence[int], dst_offset: int,
                 src: CacheLayout, src_first: int, src_rows: Sequence[int], src_offset: int,
                 count: int, nbytes: int) -> array.array:
    """``[dst, src, nbytes, ...]`` for a row-to-row copy between two layouts."""
    check_bounds(dst, dst_first, count, dst_rows, dst_offset, nbytes)
    check_bounds(src, src_first, count, src_rows, src_offset, nbytes)
    return _core.copy_segments(
        dst.span_bases(dst_first, count), array.array("q", dst_rows), dst.row_bytes, dst_offset,
        src.span_bases(src_first, count), array.array("q", src_rows), src.row_bytes, src_offset,
        nbytes)


class KvCache:
    """A KV cache: ``num_tensors`` tensors of ``cache_desc.shape`` each.

    Returned by ``allocate_cache``/``allocate_blocks_cache``/``register_*``;
    ``create_cpu_cache`` wraps caller-owned host memory (``cache_id == -1``).
    """

    __slots__ = ("_cache_id", "_desc", "_tensors", "_layout", "_is_blocks", "_region",
                 "_owned", "_alive", "_pin", "_on_device", "_device_export", "_maker", "__weakref__")

    def __init__(self, cache_id: int, desc: CacheDesc, tensors: list[torch.Tensor], *,
                 is_blocks: bool, owned: bool, region: Any = None, pin: Any = None,
                 on_device: bool | None = None, device_export: Any = None) -> None:
        self._cache_id = cache_id
        self._desc = desc
        self._tensors = tensors
        self._layout = CacheLayout([t.data_ptr() for t in tensors], desc)
        self._is_blocks = is_blocks
        self._owned = owned
        self._region = region
        # Page-locks host memory for device copies while this object (and any copy keeping it) lives.
        self._pin = pin
        self._on_device = tensors[0].device.type != "cpu" if on_device is None else on_device
        # The exportable allocation a library-allocated device cache lives in (devices/ipc.py), if any.
        self._device_export = device_export
        self._alive = True
        self._maker: object = None  # the token of the CacheRegistry that added it (CacheRegistry.add)

    @property
    def cache_id(self) -> int:
        """Id of the cache within its LLMDataDist (from 1); -1 for a CPU cache."""
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        """The :class:`CacheDesc` the cache was created with."""
        return self._desc

    @property
    def per_device_tensor_addrs(self) -> list[list[int]]:
        """Tensor addresses, outer list per device (always one here); ``[]`` once the memory is released."""
        return [list(self._layout.bases)] if self._alive else []

    @property
    def tensor_addrs(self) -> list[int]:
        """Tensor addresses, one per tensor (the v2 ``Cache`` spelling); ``[]`` once the memory is released
        (freed or unregistered), as LLM-DataDist empties them, so no address of memory gone is handed out."""
        return list(self._layout.bases) if self._alive else []

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Torch views of the cache's tensors (no copy)."""
        return list(self._tensors)

    @property
    def is_blocks_cache(self) -> bool:
        """Whether the leading dimension holds PagedAttention blocks."""
        return self._is_blocks

    @property
    def layout(self) -> CacheLayout:
        return self._layout

    @property
    def device(self) -> torch.device:
        return self._tensors[0].device

    @property
    def on_device(self) -> bool:
        """Whether the cache lives on the endpoint's device backend (``Placement.DEVICE`` with
        ``aio.DeviceType`` cuda, npu or host): its bytes move through device streams, never straight
        between a socket and its memory."""
        return self._on_device

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def owned(self) -> bool:
        """Whether the library allocated the memory; False for a registered cache, whose memory the caller owns
        and reuses as soon as the cache is released."""
        return self._owned

    @property
    def region(self) -> HostRegion | None:
        """The sealed host memory an allocated host cache lives in (what same-host peers map and NIXL
        registers), or None for device and registered caches."""
        return self._region

    @property
    def device_export(self) -> Any:
        """The allocation a same-host peer may map read-only (``devices/ipc.py``): library-allocated device
        caches on a backend that exports; None for host, registered and unexportable caches."""
        return self._device_export

    def __repr__(self) -> str:
        kind = "blocks" if self._is_blocks else "cache"
        return f"KvCache(cache_id={self._cache_id}, {kind}, {self._desc!r})"

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: Sequence[int] | Sequence[Sequence[int]]) -> KvCache:
        """Wrap caller-owned host memory as a HOST blocks cache (``cache_id=-1``).

        :param cache_desc: a HOST :class:`CacheDesc`.
        :param addrs: one address per tensor, or a one-element list of such lists.
        :raises LLMException: ``LLM_PARAM_INVALID`` for a non-HOST desc, a wrong
            address count, a zero address, an address whose tensor is not in memory this
            process may read and write (``/proc/self/maps``), or tensors that overlap.
        """
        check_instance("cache_desc", cache_desc, CacheDesc)
        if cache_desc.placement != Placement.HOST:
            raise param_invalid("cache_desc", "create_cpu_cache needs Placement.HOST")
        flat = _flatten_addrs("addrs", addrs, cache_desc.num_tensors)
        check_mapped("addrs", [(a, cache_desc.size) for a in flat])  # a bare int is never trusted
        _check_disjoint("addrs", flat, cache_desc.size)
        dtype = cache_desc.data_type.torch_dtype
        tensors = [tensor_at(a, dtype, cache_desc.shape) for a in flat]
        return cls(-1, cache_desc, tensors, is_blocks=True, owned=False)


def _flatten_addrs(arg: str, addrs: Any, num_tensors: int) -> list[int]:
    if isinstance(addrs, (list, tuple)) and addrs and all(isinstance(a, (list, tuple)) for a in addrs):
        if len(addrs) != 1:
            raise param_invalid(arg, f"one device supported, got {len(addrs)} address lists")
        addrs = addrs[0]
    if not isinstance(addrs, (list, tuple)):
        raise param_type_error(arg, f"expected a list of addresses, got {type(addrs).__name__}")
    if len(addrs) != num_tensors:
        raise param_invalid(arg, f"expected {num_tensors} addresses (num_tensors), got {len(addrs)}")
    out = []
    for i, a in enumerate(addrs):
        if isinstance(a, bool) or not isinstance(a, int):
            raise param_type_error(arg, f"address {i} must be an int, got {type(a).__name__}")
        if not 0 < a < 1 << 64:
            raise param_invalid(arg, f"address {i} must be a positive int, got {shown(a)}")
        out.append(a)
    return out


def allocate_host_tensors(desc: CacheDesc) -> tuple[HostRegion, list[torch.Tensor]]:
    """Page-aligned tensors for ``desc`` in one shareable host region."""
    stride = round_up(desc.size)
    region = HostRegion(stride * desc.num_tensors)
    dtype = desc.data_type.torch_dtype
    tensors = [region.tensor(i * stride, dtype, desc.shape) for i in range(desc.num_tensors)]
    return region, tensors


def check_user_tensors(arg: str, desc: CacheDesc, tensors: Sequence[Any],
                       device: torch.device) -> list[torch.Tensor]:
    """Validate framework-owned tensors against ``desc``: count, layout, dtype, shape, device, host memory we
    may write, overlap."""
    if not isinstance(tensors, (list, tuple)):
        raise param_type_error(arg, f"expected a list of tensors or addresses, got {type(tensors).__name__}")
    if len(tensors) != desc.num_tensors:
        raise param_invalid(arg, f"expected {desc.num_tensors} entries (num_tensors), got {len(tensors)}")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in tensors):
        if device.type != "cpu":
            raise param_invalid(arg, f"raw addresses are accepted for host memory only, not {device}")
        addrs = _flatten_addrs(arg, list(tensors), desc.num_tensors)
        check_mapped(arg, [(a, desc.size) for a in addrs])  # a bare int is never trusted
        out = [tensor_at(a, desc.data_type.torch_dtype, desc.shape) for a in addrs]
    else:
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) and (isinstance(t, bool) or not isinstance(t, int)):
                raise param_type_error(arg, f"entry {i} must be a torch.Tensor or an int address, "
                                       f"got {type(t).__name__}")
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            raise param_type_error(arg, "mixes int addresses and tensors; give all addresses or all tensors")
        dtype = desc.data_type.torch_dtype
        out = []
        for i, t in enumerate(tensors):
            if t.is_nested or t.layout is not torch.strided:
                kind = "nested" if t.is_nested else f"of layout {t.layout}"
                raise param_invalid(arg, f"tensor {i} is {kind}; only dense (strided) tensors hold a cache")
            if t.dtype != dtype:
                raise param_invalid(arg, f"tensor {i} has dtype {t.dtype}, cache_desc says {dtype}")
            if tuple(t.shape) != desc.shape:
                raise param_invalid(arg, f"tensor {i} has shape {tuple(t.shape)}, cache_desc says {desc.shape}")
            if not t.is_contiguous():
                raise param_invalid(arg, f"tensor {i} is not contiguous")
            if t.device.type != device.type or (device.index is not None and t.device.index != device.index):
                raise param_invalid(arg, f"tensor {i} is on {t.device}, the cache placement needs {device}")
            # A new tensor object over the same storage: the memory the layout names stays alive while
            # registered, even if the caller points its own tensor elsewhere (``t.data = x``, ``t.set_(x)``).
            out.append(t.detach())
        if device.type == "cpu":  # a tensor over read-only memory (a read-only mmap) would crash our copies into it
            check_mapped(arg, [(t.data_ptr(), desc.size) for t in out])
    _check_disjoint(arg, [t.data_ptr() for t in out], desc.size)
    return out


def _check_disjoint(arg: str, addrs: Sequence[int], nbytes: int) -> None:
    spans = sorted((a, a + nbytes) for a in addrs)
    for (_, a1), (b0, _) in itertools.pairwise(spans):
        if b0 < a1:
            raise param_invalid(arg, "tensors overlap in memory")


class KeyBinding:
    """One binding of a key to a row of a cache, from ``allocate_cache``/``register_cache`` until
    the key is removed, consumed or its cache goes. A pull claims and consumes the binding it
    resolved, never a later one of the same key: ``generation`` tells bindings of one key apart."""

    __slots__ = ("ident", "cache_id", "row", "generation", "pulled")

    def __init__(self, ident: tuple[int, int, int], cache_id: int, row: int, generation: int) -> None:
        self.ident = ident
        self.cache_id = cache_id
        self.row = row
        self.generation = generation
        self.pulled: set[int] = set()

    def __repr__(self) -> str:
        return f"KeyBinding({self.ident}, cache {self.cache_id}, row {self.row}, generation {self.generation})"


class _Entry:
    __slots__ = ("cache", "keys", "blocks_key", "deallocated", "nbytes", "on_freed")

    def __init__(self, cache: KvCache, nbytes: int) -> None:
        self.cache = cache
        self.keys: dict[tuple[int, int, int], KeyBinding] = {}
        self.blocks_key: int | None = None
        self.deallocated = False
        self.nbytes = nbytes
        self.on_freed: list[Callable[[], None]] = []  # see CacheRegistry.when_freed


class CacheRegistry:
    """Caches of one LLMDataDist: ids from 1, keys, and the memory cap.

    A cache stays registered while its id reference (until ``deallocate``)
    or any of its keys remains, as in LLM-DataDist's reference counting.
    """

    def __init__(self, cap_bytes: int) -> None:
        self._cap = cap_bytes
        self._token = object()  # marks the caches made here, to tell one freed here from another's
        self._used = 0
        self._next_id = 1
        self._entries: dict[int, _Entry] = {}
        self._spans = SpanIndex()  # where the entries' tensors lie
        self._keys: dict[tuple[int, int, int], KeyBinding] = {}
        self._blocks_keys: dict[int, int] = {}
        self._reserved: dict[KeyBinding, set[int]] = {}
        self._generations = itertools.count(1)
        self._hidden: set[int] = set()  # ids of caches registered with remote_accessible=False
        # Registered (caller-owned) cache id -> the jobs serving peers against its memory, each as the
        # callable that stops it at once (``serving``); run when the cache is unregistered.
        self._serving: dict[int, dict[int, Callable[[], None]]] = {}
        self._serving_ids = itertools.count(1)
        self.on_add: Callable[[KvCache], None] | None = None
        #: Raises, before anything changes, when ``on_add`` could not run now (NIXL registers on the endpoint's
        #: loop): ``add`` and ``refresh`` call it first, so a refused call leaves nothing half-registered.
        self.check_add: Callable[[], None] | None = None
        self.on_free: Callable[[KvCache], None] | None = None
        # Peers reach caches through caches(), by_id(), by_key() and by_blocks_key(). Device caches
        # are among those answers once the runtime can move them (the staging plane): it sets this.
        self.peers_see_device_caches = False

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def cap_bytes(self) -> int:
        return self._cap

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def key_count(self) -> int:
        """Keys bound now: cache keys and blocks keys."""
        return len(self._keys) + len(self._blocks_keys)

    def caches(self) -> list[KvCache]:
        """Registered caches that peers may address (see ``peers_see_device_caches``)."""
        return [e.cache for e in self._entries.values() if self._peer_visible(e.cache)]

    def all_caches(self) -> list[KvCache]:
        """Every registered cache, device caches included."""
        return [e.cache for e in self._entries.values()]

    def _peer_visible(self, cache: KvCache) -> bool:
        if cache.cache_id in self._hidden:
            return False
        return self.peers_see_device_caches or not cache.on_device

    def hidden(self, cache: KvCache) -> bool:
        """Whether ``cache`` was kept from peers (``remote_accessible=False``)."""
        return cache.cache_id in self._hidden

    def hide(self, cache: KvCache) -> None:
        """Keep a registered cache from peers (``remote_accessible=False``): no peer request
        resolves it any more, and the transports that offered it withdraw it (``on_free``)."""
        self.get(cache)
        self._hidden.add(cache.cache_id)
        if self.on_free is not None:
            self.on_free(cache)

    def refresh(self, cache: KvCache) -> None:
        """Withdraw a cache from the transports and offer it again (``on_free``, then ``on_add``):
        what they registered of its memory is made anew, after its pages were replaced in place.
        A cache deallocated but still kept by its keys is offered too, so it is refreshed as well."""
        entry = self._entries.get(cache.cache_id)
        if entry is None or entry.cache is not cache:
            self.get(cache)
        if self.check_add is not None:
            self.check_add()
        if self.on_free is not None:
            self.on_free(cache)
        if self.on_add is not None and cache.cache_id not in self._hidden:
            self.on_add(cache)

    def reserve(self, nbytes: int) -> None:
        """Raise ``LLM_OUT_OF_MEMORY`` unless ``nbytes`` more fit under the cap."""
        if self._used + nbytes > self._cap:
            raise LLMException(
                f"registering {nbytes} bytes would exceed the registered-memory cap "
                f"({self._used} of {self._cap} bytes in use; set aio.RegisteredMemoryCap)",
                status_code=LLMStatusCode.LLM_OUT_OF_MEMORY)

    def check_unregistered(self, arg: str, tensors: Sequence[torch.Tensor], nbytes: int) -> None:
        """``LLM_PARAM_INVALID`` if any tensor overlaps memory of a registered cache.

        Registered memory is disjoint, so sorted starts give sorted ends and
        only the last span starting before a tensor's end can overlap it.
        """
        for i, t in enumerate(tensors):
            other = self._spans.overlapping(t.data_ptr(), nbytes)
            if other is not None:
                raise param_invalid(arg, f"tensor {i} overlaps memory of cache {other}")

    def holding(self, start: int, end: int) -> tuple[KvCache, int] | None:
        """The cache peers may address by id (see :meth:`by_id`) one of whose tensors holds all of
        ``[start, end)``, and that tensor's index; None if there is none."""
        found = self._spans.holding(start, end)
        if found is None:
            return None
        cache = self.by_id(found[0])
        return None if cache is None else (cache, found[1])

    def check_keys(self, desc: CacheDesc, cache_keys: Iterable[Any]) -> list[tuple[int, CacheKey]]:
        """Validate keys for a new cache; returns ``(row, key)`` of the real ones."""
        if not isinstance(cache_keys, (list, tuple)):
            raise param_type_error("cache_keys",
                                   f"expected a list or tuple of CacheKey, got {type(cache_keys).__name__}")
        rows = desc.shape[0]  # a key per row; rows are along shape[0] whatever batch_dim_index says
        if len(cache_keys) > rows:
            raise param_invalid("cache_keys", f"{len(cache_keys)} keys for {rows} rows (shape[0])")
        seen: set[tuple[int, int, int]] = set()
        bound = []
        for row, key in enumerate(cache_keys):
            check_instance(f"cache_keys[{row}]", key, CacheKey)
            if key.is_placeholder:
                continue
            if key.req_id != UINT64_MAX and key.prefix_id != UINT64_MAX:
                raise param_invalid(f"cache_keys[{row}]", "set req_id or prefix_id, not both")
            ident = key.lookup_key()
            if ident in seen:
                raise param_invalid(f"cache_keys[{row}]", f"duplicate key {key!r}")
            if ident in self._keys:
                raise param_invalid(f"cache_keys[{row}]",
                                    f"{key!r} is already bound to cache {self._keys[ident].cache_id}")
            seen.add(ident)
            bound.append((row, key))
        return bound

    def check_blocks_key(self, key: Any) -> BlocksCacheKey | None:
        if key is None:
            return None
        check_instance("blocks_cache_key", key, BlocksCacheKey)
        if key.model_id in self._blocks_keys:
            raise param_invalid("blocks_cache_key",
                                f"model_id {key.model_id} is already bound to cache {self._blocks_keys[key.model_id]}")
        return key

    def add(self, make_cache: Any, nbytes: int, keys: list[tuple[int, CacheKey]],
            blocks_key: BlocksCacheKey | None) -> KvCache:
        """Assign the next id, build the cache with it, and bind its keys.

        Everything has been validated before (``check_add`` last); this cannot fail half-way.
        """
        if self.check_add is not None:
            self.check_add()
        self.reserve(nbytes)
        cache_id = self._next_id
        cache = make_cache(cache_id)
        cache._maker = self._token
        self._next_id += 1
        entry = _Entry(cache, nbytes)
        for row, key in keys:
            ident = key.lookup_key()
            binding = KeyBinding(ident, cache_id, row, next(self._generations))
            entry.keys[ident] = binding
            self._keys[ident] = binding
        if blocks_key is not None:
            entry.blocks_key = blocks_key.model_id
            self._blocks_keys[blocks_key.model_id] = cache_id
        self._entries[cache_id] = entry
        self._spans.add(cache_id, cache.layout.bases, cache.layout.tensor_bytes)
        self._used += nbytes
        if self.on_add is not None:
            self.on_add(cache)
        return cache

    def get(self, cache: Any, arg: str = "cache") -> KvCache:
        """The live registered cache for a local argument, else the documented error."""
        check_instance(arg, cache, KvCache)
        entry = self._entries.get(cache.cache_id)
        if entry is None or entry.cache is not cache or entry.deallocated:
            raise LLMException(f"invalid argument '{arg}': cache {cache.cache_id} does not exist "
                               "(deallocated or from another LLMDataDist)",
                               status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
        return cache

    def by_id(self, cache_id: int) -> KvCache | None:
        """The live cache ``cache_id`` for a peer's request, if peers may address it."""
        entry = self._entries.get(cache_id)
        if entry is None or entry.deallocated or not self._peer_visible(entry.cache):
            return None
        return entry.cache

    def by_key(self, ident: tuple[int, int, int]) -> tuple[KvCache, int] | None:
        found = self.resolve_key(ident)
        return None if found is None else (found[0], found[1].row)

    def resolve_key(self, ident: tuple[int, int, int]) -> tuple[KvCache, KeyBinding] | None:
        """The cache a key is bound to now and that binding, if peers may address the cache."""
        found = self._keys.get(ident)
        if found is None or not self._peer_visible(self._entries[found.cache_id].cache):
            return None
        return self._entries[found.cache_id].cache, found

    def bound_to(self, key: CacheKey, cache: KvCache) -> bool:
        """Whether ``key`` is bound to a row of ``cache`` now (not to a cache that replaced it)."""
        found = self._keys.get(key.lookup_key())
        return found is not None and self._entries[found.cache_id].cache is cache

    def by_blocks_key(self, model_id: int) -> KvCache | None:
        cache_id = self._blocks_keys.get(model_id)
        if cache_id is None or not self._peer_visible(self._entries[cache_id].cache):
            return None
        return self._entries[cache_id].cache

    def blocks_key_of(self, cache_id: int) -> int | None:
        """The model id of the blocks key bound to ``cache_id``, if one is and peers may reach the cache."""
        entry = self._entries.get(cache_id)
        if entry is None or not self._peer_visible(entry.cache):
            return None
        return entry.blocks_key

    def key_at(self, cache_id: int, row: int) -> KeyBinding | None:
        """The binding of the key bound to ``row`` of ``cache_id``, if any (pull-by-id consumes it)."""
        entry = self._entries.get(cache_id)
        if entry is None:
            return None
        for binding in entry.keys.values():
            if binding.row == row:
                return binding
        return None

    def deallocate(self, cache: Any) -> None:
        """Drop the id reference; the memory goes once no key refers to it.

        A cache deallocated before (freed, or still kept by its keys) is left
        as it is: a no-op, as LLM-DataDist's deallocate of an id it no longer holds.
        """
        check_instance("cache", cache, KvCache)
        if cache.cache_id == -1:  # KvCache.create_cpu_cache: the caller's memory, never ours to free
            raise param_invalid("cache", "a create_cpu_cache cache is not allocated or registered here; only such "
                                "caches can be deallocated")
        entry = self._entries.get(cache.cache_id)
        gone = (entry is None and not cache.alive) or (entry is not None and entry.cache is cache and entry.deallocated)
        if gone and cache._maker is self._token:  # freed here, not by another LLMDataDist whose id we lack
            return
        if entry is None or entry.cache is not cache:
            raise LLMException(f"invalid argument 'cache': cache {cache.cache_id} does not belong to this "
                               "LLMDataDist", status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
        entry.deallocated = True
        if not entry.cache._owned:
            for ident in list(entry.keys):
                self._unbind(entry, ident)
        if entry.blocks_key is not None:
            del self._blocks_keys[entry.blocks_key]
            entry.blocks_key = None
        self._maybe_free(entry)

    def release_keys(self, cache: KvCache) -> None:
        """Unbind every key of ``cache`` (an allocated cache's keys keep it after ``deallocate``) and free it if
        its id reference is gone too, as ``remove_key`` of each would; pulls in flight by one are as after
        ``remove_key``."""
        entry = self._entries.get(cache.cache_id)
        if entry is None or entry.cache is not cache:
            return
        for ident in list(entry.keys):
            self._unbind(entry, ident)
        self._maybe_free(entry)

    def remove_key(self, key: CacheKey, *, owned_only: bool = False) -> bool:
        """Unbind ``key``; True if it was bound. Frees a deallocated cache left keyless.

        :param owned_only: leave a key of a registered (user-owned) cache bound, as
            LLM-DataDist's ``remove_cache_key`` does (its keys go with the cache).
        """
        ident = key.lookup_key()
        found = self._keys.get(ident)
        if found is None:
            return False
        entry = self._entries[found.cache_id]
        if owned_only and not entry.cache._owned:
            return False
        self._unbind(entry, ident)
        self._maybe_free(entry)
        return True

    def serving(self, caches: Iterable[KvCache], cut: Callable[[], None]) -> Callable[[], None] | None:
        """A job serves a peer against ``caches``: if any is registered (memory the caller owns, which is
        freed or reused once unregistering it returned), unregistering it runs ``cut``, which must stop
        the job before it returns. Returns what forgets the job once it no longer touches the memory, or
        None when no cache is registered.

        An allocated cache needs none of this: its memory lives until the job lets go of it."""
        held = {c.cache_id for c in caches if not c._owned}
        if not held:
            return None
        ident = next(self._serving_ids)
        for cache_id in held:
            self._serving.setdefault(cache_id, {})[ident] = cut

        def forget() -> None:
            for cache_id in held:
                cuts = self._serving.get(cache_id)
                if cuts is not None:
                    cuts.pop(ident, None)
                    if not cuts:
                        del self._serving[cache_id]

        return forget

    def when_freed(self, cache: KvCache, fn: Callable[[], None]) -> Callable[[], None]:
        """Run ``fn()`` once ``cache`` is freed: its id reference dropped and its last key gone (pulled or
        removed), not by ``clear``. Returns what forgets ``fn`` (a watcher that no longer cares, on a cache
        that may live long, must not pile up). Nothing for a cache that is not registered here."""
        entry = self._entries.get(cache.cache_id)
        if entry is None or entry.cache is not cache:
            return _nothing
        watchers = entry.on_freed  # not the entry: a watcher keeping this would keep the cache
        watchers.append(fn)

        def forget() -> None:
            with contextlib.suppress(ValueError):  # ran (the list is cleared then) or forgotten already
                watchers.remove(fn)

        return forget

    def serving_count(self) -> int:
        """Jobs serving peers against registered caches now (see :meth:`serving`)."""
        return sum(len(cuts) for cuts in self._serving.values())

    def claim_key(self, binding: KeyBinding, tensors: range) -> bool:
        """Claim ``tensors`` of a binding for one pull in flight; False if another has them.

        A binding no pull consumes (a prefix key, a registered cache's key) is not claimed: any
        number of pulls may read it at once, as nothing of it is used up."""
        if not self._consumable(binding):
            return True
        held = self._reserved.setdefault(binding, set())
        if held.intersection(tensors):
            return False
        held.update(tensors)
        return True

    def release_key(self, binding: KeyBinding, tensors: range) -> None:
        """Give back what :meth:`claim_key` claimed (of that binding only)."""
        held = self._reserved.get(binding)
        if held is not None:
            held.difference_update(tensors)
            if not held:
                del self._reserved[binding]

    def consume(self, binding: KeyBinding, tensors: range, num_tensors: int) -> None:
        """Record a successful pull of a binding; the key goes once every tensor was pulled.

        A binding that is no longer current (its key was removed, and maybe
        bound again since) is left alone, and so is the key's new binding.
        Registered (user-owned) caches and prefix keys keep their keys.
        """
        if self._keys.get(binding.ident) is not binding or not self._consumable(binding):
            return
        entry = self._entries[binding.cache_id]
        binding.pulled.update(tensors)
        if len(binding.pulled) >= num_tensors:
            self._unbind(entry, binding.ident)
            self._maybe_free(entry)

    def _consumable(self, binding: KeyBinding) -> bool:
        """Whether a pull consumes ``binding``: a key of an allocated cache, not a prefix key."""
        entry = self._entries.get(binding.cache_id)
        return entry is not None and entry.cache._owned and binding.ident[1] == UINT64_MAX

    def _unbind(self, entry: _Entry, ident: tuple[int, int, int]) -> None:
        binding = entry.keys.pop(ident, None)
        if binding is not None and self._keys.get(ident) is binding:
            del self._keys[ident]

    def _maybe_free(self, entry: _Entry) -> None:
        if entry.deallocated and not entry.keys:
            del self._entries[entry.cache.cache_id]
            self._spans.remove(entry.cache.cache_id)
            self._hidden.discard(entry.cache.cache_id)
            self._used -= entry.nbytes
            # A registered cache's memory is the caller's again once this returns: stop every job that
            # serves a peer against it first (each cut returns once its job touches no byte any more).
            for cut in list(self._serving.pop(entry.cache.cache_id, {}).values()):
                try:
                    cut()
                except Exception:  # one job's failure to stop must not leave the registry half updated
                    log.exception("stopping a job that served a peer against cache %s failed",
                                  entry.cache.cache_id)
            if self.on_free is not None:
                self.on_free(entry.cache)
            _released(entry.cache)
            for fn in entry.on_freed:
                try:
                    fn()
                except Exception:  # one watcher's failure must not leave the others uncalled
                    log.exception("a watcher of cache %s's release failed", entry.cache.cache_id)
            entry.on_freed.clear()

    def device_memory(self) -> list[Any]:
        """What keeps the device caches' memory allocated (their tensors and exports), to keep it."""
        return [(e.cache.tensors, e.cache._device_export) for e in self._entries.values() if e.cache.on_device]

    def clear(self) -> None:
        for entry in self._entries.values():
            _released(entry.cache)
        self._entries.clear()
        self._spans.clear()
        self._serving.clear()
        self._hidden.clear()
        self._keys.clear()
        self._blocks_keys.clear()
        self._used = 0


def _nothing() -> None:
    pass


def _released(cache: KvCache) -> None:
    """Mark ``cache`` released. A registered cache lets go of its aliases of the caller's tensors: the memory is
    the caller's again, and a cache object kept after its release must not keep it allocated."""
    cache._alive = False
    cache._region = None
    cache._device_export = None
    if not cache._owned:
        cache._tensors = [torch.empty(0, dtype=t.dtype, device=t.device) for t in cache._tensors]
