"""CacheManager: LLM-DataDist's CacheManager mode (v2), on the KvCacheManager's machinery.

An endpoint whose ``init`` options select CacheManager mode
(``llm.EnableCacheManager = "1"``, or ``llm.LocalCommRes`` present) hands out
this manager as ``LLMDataDist.cache_manager``. It has the reference's v2
names, signatures and defaults; every call is checked here in v2 terms
(argument names and exception types as LLM-DataDist's v2 Python code raises
them), then carried out by the endpoint's :class:`KvCacheManager`: the same
validation of geometry, the same plans (``plans.build_plan``) and the same
requester (``transfers.run_pull`` / ``run_push``). What v2 changes is kept
here and in :class:`~aio_datadist.endpoint.Endpoint`: the role is only a
label (either end of a link may pull and push), push layer ranges are Python
``range`` keywords, ``register_*`` take ``remote_accessible``, and caches
are released by ``unregister_cache`` / ``deallocate_blocks_cache`` too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from aio_datadist._checks import (
    check_bool,
    check_instance,
    check_range,
    check_sint,
    check_uint,
    named_by_caller,
    param_invalid,
)
from aio_datadist.arrivals import PushWatch
from aio_datadist.cache import KvCache
from aio_datadist.layers import range_pair
from aio_datadist.manager import PUSH_KEY_AS_DST_CACHE_KEY, KvCacheManager
from aio_datadist.status import LLMStatusCode
from aio_datadist.task import CacheTask
from aio_datadist.types import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    KvCacheExtParam,
    LayerSynchronizer,
    MemInfo,
    Memtype,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

if TYPE_CHECKING:
    from aio_datadist.runtime import Runtime

__all__ = ["Cache", "CacheManager"]

#: The v2 name of :class:`KvCache`: ``cache_id``, ``cache_desc``, ``tensor_addrs``,
#: ``is_blocks_cache`` and ``Cache.create_cpu_cache(cache_desc, addrs)`` as the reference lists them.
Cache = KvCache



class CacheManager:
    """Caches of one :class:`~aio_datadist.LLMDataDist` in CacheManager mode, and the work on them.

    Obtain it from ``LLMDataDist.cache_manager``. Plain methods do local
    bookkeeping; coroutine methods wait for copies or peers and accept
    ``timeout=`` in milliseconds (default: ``LLMConfig.sync_kv_timeout``);
    they and ``transfer_cache_async`` run on the event loop the LLMDataDist
    was initialised on (from another: ``LLM_FAILED``). Either role may pull and push. Wrong-typed arguments raise
    ``LLMException(LLM_PARAM_INVALID)`` that is also a ``TypeError`` where
    LLM-DataDist raises ``TypeError``; every message names the argument.
    """

    def __init__(self, manager: KvCacheManager) -> None:
        self._kv = manager
        self._endpoint = manager.endpoint

    def _rt(self) -> Runtime:
        rt = self._endpoint.require_runtime()
        self._endpoint.require_mode("cache_manager", cache_manager=True)
        return rt

    # -- registration and allocation ---------------------------------------

    def register_cache(self, cache_desc: CacheDesc, addrs: list[Any], cache_keys: Sequence[CacheKey] = (),
                       remote_accessible: bool | None = None) -> KvCache:
        """Register memory the caller owns as a contiguous cache; key ``i`` names batch row ``i``.

        :param addrs: a list with one entry per tensor: an int address of
            memory that already exists (checked against this process's
            writable mappings; never trusted as it is) or a contiguous torch
            tensor of the desc's dtype, shape and placement.
        :param cache_keys: keys peers may pull rows by.
        :param remote_accessible: whether peers may read and write the cache;
            None means True for ``Placement.DEVICE`` and False for ``HOST``,
            as in LLM-DataDist.
        :returns: the new :class:`Cache` (next cache id).
        :raises LLMException: ``LLM_PARAM_INVALID`` naming the argument (also a
            ``TypeError`` for a wrong type): an empty list, a zero, unmapped,
            undersized or overlapping address, bad keys;
            ``LLM_OUT_OF_MEMORY`` past the registered-memory cap.
        """
        self._rt()
        visible = _check_register(cache_desc, addrs, remote_accessible)
        check_instance("cache_keys", cache_keys, (list, tuple))
        with named_by_caller({"tensors_or_addrs": "addrs"}):
            return self._kv.register_cache(cache_desc, addrs, cache_keys, remote_accessible=visible)

    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: list[Any],
                              blocks_cache_key: BlocksCacheKey | None = None,
                              remote_accessible: bool | None = None) -> KvCache:
        """Register memory the caller owns as a PagedAttention blocks cache (``shape[0]`` = blocks).

        :param blocks_cache_key: the key peers address the cache by, if any.
        :raises LLMException: as :meth:`register_cache`.
        """
        self._rt()
        visible = _check_register(cache_desc, addrs, remote_accessible)
        if blocks_cache_key is not None:
            check_instance("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        with named_by_caller({"tensors_or_addrs": "addrs"}):
            return self._kv.register_blocks_cache(cache_desc, addrs, blocks_cache_key, remote_accessible=visible)

    def unregister_cache(self, cache_id: int) -> None:
        """Release cache ``cache_id`` (registered or allocated), with its keys; a registered cache's memory
        stays the caller's. Peers' requests for it (by id or by key) fail with ``LLM_KV_CACHE_NOT_EXIST``
        from then on, and those served against a registered cache over a TCP or TLS data channel, or by a
        same-host push's copy, are cut before this returns (as :meth:`KvCacheManager.deallocate_cache`, which
        says what is not cut), so no such job reads or writes its memory afterwards.

        An id that names no cache (already released included) is a no-op, as
        in LLM-DataDist.

        :raises LLMException: ``LLM_PARAM_INVALID`` naming ``cache_id`` (a
            ``TypeError`` for a non-int, a ``ValueError`` outside int64).
        """
        rt = self._rt()
        number = check_sint("cache_id", cache_id)
        cache = next((c for c in rt.registry.all_caches() if c.cache_id == number), None)
        if cache is not None:
            self._kv.deallocate_cache(cache)  # (refused from another thread before anything changes)
            # The id is the cache: an allocated cache's keys go with it, as a registered cache's do. Before, they
            # kept it registered and pullable by key after this returned (found by a hunt).
            rt.registry.release_keys(cache)

    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey] = ()) -> KvCache:
        """Allocate a contiguous cache; key ``i`` names batch row ``i`` (no memory pool needed).

        :raises LLMException: as :meth:`KvCacheManager.allocate_cache`.
        """
        self._rt()
        check_instance("cache_desc", cache_desc, CacheDesc)
        check_instance("cache_keys", cache_keys, (list, tuple))
        return self._kv.allocate_cache(cache_desc, cache_keys)

    def allocate_blocks_cache(self, cache_desc: CacheDesc,
                              blocks_cache_key: BlocksCacheKey | None = None) -> KvCache:
        """Allocate a blocks cache; release it with :meth:`deallocate_blocks_cache`.

        :raises LLMException: as :meth:`KvCacheManager.allocate_blocks_cache`.
        """
        self._rt()
        check_instance("cache_desc", cache_desc, CacheDesc)
        if blocks_cache_key is not None:
            check_instance("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        return self._kv.allocate_blocks_cache(cache_desc, blocks_cache_key)

    def deallocate_cache(self, cache: KvCache) -> None:
        """Release a contiguous cache's id reference (its keys may keep it until pulled). A second
        call is a no-op.

        :raises LLMException: ``LLM_PARAM_INVALID`` naming ``cache`` for a
            blocks cache (use :meth:`deallocate_blocks_cache`) or a wrong type;
            ``LLM_KV_CACHE_NOT_EXIST`` for a cache of another LLMDataDist.
        """
        self._rt()
        check_instance("cache", cache, KvCache)
        if cache.is_blocks_cache:
            raise param_invalid("cache", "can not be a blocks cache (use deallocate_blocks_cache)")
        self._kv.deallocate_cache(cache)

    def deallocate_blocks_cache(self, cache: KvCache) -> None:
        """Release a blocks cache at once. A second call is a no-op.

        :raises LLMException: as :meth:`deallocate_cache`, for a cache that is not a blocks cache.
        """
        self._rt()
        check_instance("cache", cache, KvCache)
        if not cache.is_blocks_cache:
            raise param_invalid("cache", "should be a blocks cache (use deallocate_cache)")
        self._kv.deallocate_cache(cache)

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Stop offering a row under ``cache_key``. No-op if unbound, and for a key of a registered
        cache (its keys go with it, as in LLM-DataDist)."""
        self._rt()
        check_instance("cache_key", cache_key, CacheKey)
        self._kv.remove_cache_key(cache_key)

    def remap_registered_memory(self, mem_infos: MemInfo | list[MemInfo]) -> None:
        """Refresh what transports hold of registered memory whose pages were replaced in place
        (memory-fault recovery): each cache that overlaps a region is withdrawn from the link
        transports and offered again, so registrations that pin pages (NIXL) are made anew.

        :param mem_infos: a :class:`MemInfo` or a list of them, ``Memtype.MEM_TYPE_DEVICE`` only.
        :raises LLMException: ``LLM_PARAM_INVALID`` naming ``mem_infos`` (or
            ``mem_infos[i]``) for a wrong type, a host region, or a region that
            overlaps no registered cache; ``LLM_FAILED`` with ``aio.Transport=nixl``
            off the endpoint's event loop, and from another thread while that loop
            runs (nothing refreshed).
        """
        rt = self._rt()
        infos = [mem_infos] if isinstance(mem_infos, MemInfo) else mem_infos
        if not isinstance(infos, list):
            raise param_invalid("mem_infos", f"expected a MemInfo or a list of MemInfo, got {type(mem_infos).__name__}")
        caches = rt.registry.all_caches()
        touched: dict[int, KvCache] = {}
        for i, info in enumerate(infos):
            if not isinstance(info, MemInfo):
                raise param_invalid(f"mem_infos[{i}]", f"expected MemInfo, got {type(info).__name__}")
            if info.mem_type != Memtype.MEM_TYPE_DEVICE:
                raise param_invalid(f"mem_infos[{i}]", "only Memtype.MEM_TYPE_DEVICE is supported")
            hits = [c for c in caches if _overlaps(c, info.addr, info.size)]
            if not hits:
                raise param_invalid(f"mem_infos[{i}]", f"[{info.addr:#x}, +{info.size}) overlaps no registered cache")
            touched.update((c.cache_id, c) for c in hits)
        for cache in touched.values():
            rt.registry.refresh(cache)

    # -- local copies -------------------------------------------------------

    async def copy_cache(self, dst: KvCache, src: KvCache, dst_batch_index: int = 0, src_batch_index: int = 0,
                         offset: int = 0, size: int = -1, req_id: int | None = None, *,
                         timeout: int | None = None) -> None:
        """Copy one batch row of every tensor from ``src`` to ``dst`` (contiguous caches).

        :param req_id: for logs only, as in LLM-DataDist (a uint64 when given).
        :raises LLMException: as :meth:`KvCacheManager.copy_cache`.
        """
        self._rt()
        check_sint("size", size)  # int64, a ValueError past it, as LLM-DataDist's check_int64
        if req_id is not None:
            check_uint("req_id", req_id)
        await self._kv.copy_cache(dst, src, dst_batch_index, src_batch_index, offset, size, timeout=timeout)

    async def copy_blocks(self, cache: KvCache, copy_block_info: Mapping[int, Sequence[int]], *,
                          timeout: int | None = None) -> None:
        """Copy blocks inside one blocks cache: ``{src_block: [dst_block, ...]}``."""
        self._rt()
        await self._kv.copy_blocks(cache, copy_block_info, timeout=timeout)

    async def swap_blocks(self, src_cache: KvCache, dst_cache: KvCache, src_to_dst: Mapping[int, int], *,
                          timeout: int | None = None) -> None:
        """Copy blocks between a HOST and a DEVICE blocks cache: ``{src_block: dst_block}``."""
        self._rt()
        with named_by_caller({"src": "src_cache", "dst": "dst_cache"}):
            await self._kv.swap_blocks(src_cache, dst_cache, src_to_dst, timeout=timeout)

    # -- transfers with peers -------------------------------------------------

    async def pull_cache(self, cache_key: CacheKey | CacheKeyByIdAndIndex, cache: KvCache, batch_index: int = 0,
                         size: int = -1, *, src_layer_range: range | None = None, dst_layer_range: range | None = None,
                         tensor_num_per_layer: int = 2, timeout: int | None = None, **unknown: Any) -> None:
        """Pull one remote batch row into row ``batch_index`` of the contiguous ``cache``.

        :param src_layer_range: the owner's layers (``range``; None: all).
        :param dst_layer_range: the local layers (``range``; None: all).
        :param tensor_num_per_layer: tensors per layer (2: K and V).
        :param timeout: ms; None: ``sync_kv_timeout``.
        :param unknown: refused with ``LLM_PARAM_INVALID`` naming the keyword (v2 has no offsets).
        :raises LLMException: ``LLM_PARAM_INVALID``, ``LLM_NOT_YET_LINK``,
            ``LLM_KV_CACHE_NOT_EXIST``, ``LLM_TIMEOUT``, ``LLM_LINK_FAILED``.
        """
        self._rt()
        check_sint("size", size)
        keywords = _pull_keywords(src_layer_range, dst_layer_range, tensor_num_per_layer, timeout, unknown)
        check_instance("cache_key", cache_key, (CacheKey, CacheKeyByIdAndIndex))
        cache = self._endpoint.live(cache, "cache")
        if cache.is_blocks_cache:
            raise param_invalid("cache", "can not be a blocks cache (use pull_blocks)")
        with named_by_caller({"kv_cache": "cache"}):
            await self._kv.pull_cache(cache_key, cache, batch_index, size, **keywords)

    async def pull_blocks(self, src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey, dst_cache: KvCache,
                          src_blocks: Sequence[int] | None = (), dst_blocks: Sequence[int] = (), *,
                          src_layer_range: range | None = None, dst_layer_range: range | None = None,
                          tensor_num_per_layer: int = 2, timeout: int | None = None, **unknown: Any) -> None:
        """Pull remote blocks (a :class:`BlocksCacheKey` and ``src_blocks``) or one remote
        contiguous row (a :class:`CacheKey` / :class:`CacheKeyByIdAndIndex`, ``src_blocks`` empty)
        into ``dst_blocks`` of the blocks cache ``dst_cache``.

        Keywords as :meth:`pull_cache`.

        :raises LLMException: as :meth:`pull_cache`.
        """
        self._rt()
        keywords = _pull_keywords(src_layer_range, dst_layer_range, tensor_num_per_layer, timeout, unknown)
        check_instance("src_cache_key", src_cache_key, (CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey))
        await self._kv.pull_blocks(src_cache_key, dst_cache, () if src_blocks is None else src_blocks, dst_blocks,
                                   **keywords)

    async def push_cache(self, dst_cache_key: CacheKeyByIdAndIndex, src_cache: KvCache, src_batch_index: int = 0,
                         src_layer_range: range | None = None, dst_layer_range: range | None = None,
                         size: int = -1, tensor_num_per_layer: int = 2, *, timeout: int | None = None) -> None:
        """Push batch row ``src_batch_index`` of ``src_cache`` into a peer's contiguous cache row.

        :param dst_cache_key: remote cluster, cache id and destination row.
        :param src_layer_range: local layers (None: all of ``src_cache``).
        :param dst_layer_range: remote layers, as many as ``src_layer_range``
            (None: every layer of ``src_cache``).
        :param size: must be -1 (whole rows).
        :returns: once the peer confirmed the bytes are in place.
        :raises LLMException: ``LLM_PARAM_INVALID``, ``LLM_NOT_YET_LINK``,
            ``LLM_TIMEOUT``, ``LLM_KV_CACHE_NOT_EXIST``, ``LLM_LINK_FAILED``.
        """
        self._rt()
        check_sint("size", size)
        check_instance("dst_cache_key", dst_cache_key, CacheKeyByIdAndIndex)
        check_instance("src_cache", src_cache, KvCache)
        ext = _push_layers(src_cache, src_layer_range, dst_layer_range, tensor_num_per_layer)
        with named_by_caller(PUSH_KEY_AS_DST_CACHE_KEY):
            await self._kv.push_cache(dst_cache_key, src_cache, src_batch_index, ext, size, timeout=timeout)

    async def push_blocks(self, dst_cache_key: BlocksCacheKey, src_cache: KvCache, src_blocks: Sequence[int] = (),
                          dst_blocks: Sequence[int] = (), src_layer_range: range | None = None,
                          dst_layer_range: range | None = None, tensor_num_per_layer: int = 2, *,
                          timeout: int | None = None) -> None:
        """Push blocks ``src_blocks`` of the blocks cache ``src_cache`` into ``dst_blocks`` of a
        peer's blocks cache.

        Layer ranges as :meth:`push_cache`.

        :raises LLMException: as :meth:`push_cache`.
        """
        self._rt()
        check_instance("dst_cache_key", dst_cache_key, BlocksCacheKey)
        check_instance("src_cache", src_cache, KvCache)
        ext = _push_layers(src_cache, src_layer_range, dst_layer_range, tensor_num_per_layer)
        with named_by_caller(PUSH_KEY_AS_DST_CACHE_KEY):
            await self._kv.push_blocks(dst_cache_key, src_cache, src_blocks, dst_blocks, ext, timeout=timeout)

    def transfer_cache_async(self, src_cache: KvCache, layer_synchronizer: LayerSynchronizer,
                             transfer_configs: Sequence[TransferConfig | TransferWithCacheKeyConfig],
                             src_block_indices: Sequence[int] | None = None,
                             dst_block_indices: Sequence[int] | None = None,
                             dst_block_memory_size: int | None = None) -> CacheTask:
        """Push ``src_cache`` layer by layer as prefill computes it (see
        :meth:`KvCacheManager.transfer_cache_async`); called from a running event loop.

        A blocks cache sent without block indices (None or empty on both
        sides) moves as LLM-DataDist's layer-wise job moves it: block 0 of
        each tensor to block 0 of the peer (see ``layerwise.start_transfer``).
        A contiguous cache goes into blocks with ``dst_block_indices`` and
        ``dst_block_memory_size``: its row ``src_batch_index`` is cut into
        pieces of ``dst_block_memory_size`` bytes, piece ``j`` into block
        ``dst_block_indices[j]`` (the last piece may be shorter), as in
        LLM-DataDist's CacheManager.

        :raises LLMException: ``LLM_PARAM_INVALID`` for bad arguments (before
            anything is sent), ``LLM_NOT_YET_LINK`` for an unlinked destination.
        """
        self._rt()
        cache = self._endpoint.live(src_cache, "src_cache")
        task = self._kv._start_layerwise(cache, layer_synchronizer, transfer_configs, src_block_indices,
                                        dst_block_indices, dst_block_memory_size, cache_to_blocks=True)
        task.timeout_code = LLMStatusCode.LLM_TIMEOUT  # v2's default error code (v1's: LLM_WAIT_PROCESS_TIMEOUT)
        return task

    def watch_pushes(self, cache: KvCache, rows: Sequence[int], layers: range | None = None, *,
                     tensors_per_layer: int = 2) -> PushWatch:
        """Watch peer pushes land in ``rows`` of ``cache`` (an aio_datadist addition; see
        :meth:`KvCacheManager.watch_pushes`)."""
        self._rt()
        return self._kv.watch_pushes(cache, rows, layers, tensors_per_layer=tensors_per_layer)


def _check_register(cache_desc: Any, addrs: Any, remote_accessible: Any) -> bool:
    """The v2 checks of a registration; whether peers may reach the cache."""
    check_instance("cache_desc", cache_desc, CacheDesc)
    check_instance("addrs", addrs, list)
    if not addrs:
        raise param_invalid("addrs", "can not be empty")
    if remote_accessible is None:
        return bool(cache_desc.placement == Placement.DEVICE)
    return check_bool("remote_accessible", remote_accessible)


def _tensors_per_layer(value: Any) -> int:
    """v2's ``tensor_num_per_layer``: a uint32 (``ValueError`` outside, as LLM-DataDist checks it) that the
    transfer can carry (1 to 255: the request's one byte, as ``KvCacheExtParam``'s field)."""
    per_layer = check_uint("tensor_num_per_layer", value, 32)
    if not 1 <= per_layer <= 255:
        raise param_invalid("tensor_num_per_layer", f"must be in [1, 255], got {per_layer}")
    return per_layer


def _pull_keywords(src_layer_range: Any, dst_layer_range: Any, tensor_num_per_layer: Any, timeout: Any,
                   unknown: dict[str, Any]) -> dict[str, Any]:
    """The v2 pull keywords for the v1 call (LLM-DataDist's v2 has no offsets); anything else names itself."""
    if unknown:
        raise param_invalid(sorted(unknown)[0], "is not a keyword of the v2 pull calls (src_layer_range, "
                            "dst_layer_range, tensor_num_per_layer, timeout)")
    _tensors_per_layer(tensor_num_per_layer)
    for arg, value in (("src_layer_range", src_layer_range), ("dst_layer_range", dst_layer_range)):
        check_range(arg, value)  # a range or None, as v2 takes them (v1's inclusive pairs are not v2's)
    return {"src_layer_range": src_layer_range, "dst_layer_range": dst_layer_range,
            "tensor_num_per_layer": tensor_num_per_layer, "timeout": timeout}


def _push_layers(src_cache: KvCache, src_layer_range: Any, dst_layer_range: Any,
                 tensor_num_per_layer: Any) -> KvCacheExtParam:
    """v2 push layer keywords as the inclusive pairs of ``KvCacheExtParam``; None is every layer
    of ``src_cache`` on either side, and both ranges hold as many layers."""
    per_layer = _tensors_per_layer(tensor_num_per_layer)
    num_layers = src_cache.cache_desc.num_tensors // per_layer
    ranges = []
    for arg, value in (("src_layer_range", src_layer_range), ("dst_layer_range", dst_layer_range)):
        layers = check_range(arg, value)
        if layers is None:
            if not num_layers:
                raise param_invalid("tensor_num_per_layer", f"{per_layer} exceeds num_tensors "
                                    f"{src_cache.cache_desc.num_tensors} of src_cache")
            layers = range(num_layers)
        ranges.append(layers)
    if len(ranges[0]) != len(ranges[1]):
        raise param_invalid("dst_layer_range", f"holds {len(ranges[1])} layers, src_layer_range {len(ranges[0])}")
    return KvCacheExtParam(range_pair("src_layer_range", ranges[0]), range_pair("dst_layer_range", ranges[1]),
                           per_layer)


def _overlaps(cache: KvCache, addr: int, size: int) -> bool:
    lay = cache.layout
    return any(base < addr + size and addr < base + lay.tensor_bytes for base in lay.bases)
