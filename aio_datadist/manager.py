"""KvCacheManager: cache allocation, registration, keys and local copies.

Transfers between processes are added by the link layer; this module holds
everything that needs no peer. Every call validates all of its arguments
before any memory is touched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from aio_datadist import _core, _trace
from aio_datadist._checks import (
    check_bool,
    check_index,
    check_indices,
    check_instance,
    check_int,
    check_uint,
    param_invalid,
    param_type_error,
    param_value_error,
    shown,
)
from aio_datadist.arrivals import PushWatch
from aio_datadist.cache import (
    KvCache,
    allocate_host_tensors,
    check_user_tensors,
    copy_triples,
)
from aio_datadist.devices.host import round_up
from aio_datadist.devices.ops import copy_rows, involves_device
from aio_datadist.layers import layer_pair
from aio_datadist.layerwise import start_transfer
from aio_datadist.leases import allocate_leased_cache
from aio_datadist.plans import build_plan, target_fields
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.task import CacheTask
from aio_datadist.transfers import run_pull, run_push
from aio_datadist.transport.same_host import run_copy_job, stop_host_copies
from aio_datadist.transport.staging import wait_cut_copies
from aio_datadist.types import (
    UINT64_MAX,
    BlocksCacheKey,
    CacheDesc,
    CacheIndex,
    CacheKey,
    CacheKeyByIdAndIndex,
    KvCacheExtParam,
    LayerSynchronizer,
    LLMRole,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from aio_datadist.wire import ReqFlag

if TYPE_CHECKING:
    from aio_datadist.endpoint import Endpoint
    from aio_datadist.runtime import Runtime

__all__ = ["KvCacheManager"]


class KvCacheManager:
    """Caches of one :class:`~aio_datadist.LLMDataDist` and the work on them.

    Obtain it from ``LLMDataDist.kv_cache_manager``. Plain methods do local
    bookkeeping; coroutine methods wait for copies or peers and accept
    ``timeout=`` in milliseconds (default: ``LLMConfig.sync_kv_timeout``).
    They and ``transfer_cache_async`` run on the event loop the LLMDataDist
    was initialised on; from another loop they raise ``LLM_FAILED``
    (``Endpoint.home_loop``): the links' answers, a release's cut of a copy
    and the layer-wise driver's futures are settled from that loop's thread,
    which would not wake another loop.
    """

    def __init__(self, endpoint: Endpoint, *, v1: bool = True) -> None:
        """``v1``: the manager ``LLMDataDist.kv_cache_manager`` hands out, whose calls are refused once ``init``
        chose CacheManager mode (also when it was taken before); False for the one the v2
        :class:`~aio_datadist.CacheManager` runs its calls through."""
        self._endpoint = endpoint
        self._v1 = v1

    def _mode(self) -> None:
        """Refuse a call of the v1 manager in CacheManager mode, as ``kv_cache_manager`` itself is refused."""
        if self._v1:
            self._endpoint.require_mode("kv_cache_manager", cache_manager=False)

    # -- state -----------------------------------------------------------

    @property
    def endpoint(self) -> Endpoint:
        """The endpoint this manager works for (role, runtime, links and their checks), for the
        library's own parts built on the manager, such as ``aio_datadist.leases``."""
        return self._endpoint

    def is_initialized(self) -> bool:
        """Whether the owning LLMDataDist is initialised (False after finalize)."""
        return self._endpoint.initialized

    def _rt(self) -> Runtime:
        return self._endpoint.require_runtime()

    def _timeout(self, timeout: Any) -> int:
        if timeout is None:
            return self._rt().default_timeout_ms()
        return check_int("timeout", timeout, lo=1, hi=2**31 - 1)

    # -- allocation and registration --------------------------------------

    def _check_desc(self, cache_desc: Any) -> CacheDesc:
        check_instance("cache_desc", cache_desc, CacheDesc)
        _ = cache_desc.data_type.torch_dtype  # raises for DT_STRING, which has no tensor form
        return cache_desc

    def _device_for(self, desc: CacheDesc) -> torch.device:
        return torch.device("cpu") if desc.placement == Placement.HOST else self._rt().device

    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey] = (), *,
                       lease_ms: int | None = None) -> KvCache:
        """Allocate a contiguous cache; key ``i`` names batch row ``i``.

        :param cache_desc: the cache's shape, dtype, tensor count and placement.
        :param cache_keys: keys peers may pull rows by (placeholders skipped).
        :param lease_ms: hand the cache over under a lease (PROMPT or MIX,
            from a running event loop): after ``lease_ms`` milliseconds the
            keys not pulled yet are removed and the id reference is dropped,
            so a decoder that vanished cannot pin the memory
            (``aio_datadist.leases.lease_of(cache)`` renews or cancels it).
        :returns: the new :class:`KvCache`, with the next cache id.
        :raises LLMException: ``LLM_PARAM_INVALID`` for a bad desc or key (more
            keys than rows, duplicates, keys already bound) or naming
            ``lease_ms`` (not an int in [1, 2**31 - 1], or a DECODER);
            ``LLM_OUT_OF_MEMORY`` past the registered-memory cap.
        """
        self._mode()
        if lease_ms is not None:
            return allocate_leased_cache(self, cache_desc, cache_keys, lease_ms=lease_ms)[0]
        rt = self._rt()
        desc = self._check_desc(cache_desc)
        keys = rt.registry.check_keys(desc, cache_keys)
        if keys:
            self._keys_for_prompt("cache_keys")
        return self._allocate(desc, keys, None, is_blocks=False)

    def _keys_for_prompt(self, arg: str) -> None:
        """Cache keys are a PROMPT's (or MIX's) to hand out (reference 2.4: ``ValueError``): a v1 DECODER's would
        pin its cache until finalize, as ``deallocate_cache`` leaves a keyed cache to its keys and
        ``remove_cache_key`` is a PROMPT's call. (A blocks key, which pushes name, frees with its cache.)"""
        if self._v1 and self._endpoint.role == LLMRole.DECODER:
            raise param_value_error(arg, "keys are for a PROMPT or MIX endpoint; this LLMDataDist is DECODER")

    def allocate_blocks_cache(self, cache_desc: CacheDesc,
                              blocks_cache_key: BlocksCacheKey | None = None) -> KvCache:
        """Allocate a PagedAttention blocks cache (``shape[0]`` = number of blocks).

        :param blocks_cache_key: the key peers address the cache by, if any.
        :raises LLMException: as :meth:`allocate_cache`.
        """
        self._mode()
        rt = self._rt()
        desc = self._check_desc(cache_desc)
        key = rt.registry.check_blocks_key(blocks_cache_key)
        return self._allocate(desc, [], key, is_blocks=True)

    def _allocate(self, desc: CacheDesc, keys: list, blocks_key: BlocksCacheKey | None,
                  *, is_blocks: bool) -> KvCache:
        rt = self._rt()
        on_device = rt.devices is not None and desc.placement == Placement.DEVICE
        # The cap counts what is mapped: host tensors start on pages of their own (allocate_host_tensors), a
        # device cache is one allocation of the backend's granularity.
        nbytes = rt.devices.allocation_bytes(desc) if on_device else round_up(desc.size) * desc.num_tensors  # type: ignore[union-attr]
        rt.registry.reserve(nbytes)
        if rt.registry.check_add is not None:
            rt.registry.check_add()  # (add checks it again; here before any memory is allocated and pinned)
        if on_device:
            tensors, export = _allocate_device(rt, desc, nbytes)
            return rt.registry.add(
                lambda cache_id: KvCache(cache_id, desc, tensors, is_blocks=is_blocks, owned=True, on_device=True,
                                         device_export=export),
                nbytes, keys, blocks_key)
        try:
            region, tensors = allocate_host_tensors(desc)
        except (OSError, MemoryError) as exc:
            raise LLMException(f"allocating {nbytes} bytes failed: {exc}",
                               status_code=LLMStatusCode.LLM_OUT_OF_MEMORY) from exc
        # Page-locked, so that swaps with device caches run at full speed and asynchronously.
        pin = None if rt.devices is None else rt.devices.pin_host(region)
        return rt.registry.add(
            lambda cache_id: KvCache(cache_id, desc, tensors, is_blocks=is_blocks, owned=True, region=region,
                                     pin=pin),
            nbytes, keys, blocks_key)

    def register_cache(self, cache_desc: CacheDesc, tensors_or_addrs: Sequence[Any],
                       cache_keys: Sequence[CacheKey] = (), remote_accessible: bool | None = None) -> KvCache:
        """Register framework-owned memory as a contiguous cache.

        :param tensors_or_addrs: one contiguous tensor per cache tensor (dtype,
            shape and device as the desc says), or host addresses.
        :param remote_accessible: False keeps the cache from peers (their
            requests for it get ``LLM_KV_CACHE_NOT_EXIST``); None or True lets
            peers reach it.
        :raises LLMException: ``LLM_PARAM_INVALID`` for mismatched tensors,
            overlapping memory (with each other or with any registered cache)
            or bad keys (``TypeError`` too for a wrong type); ``LLM_OUT_OF_MEMORY``
            past the cap.
        """
        self._mode()
        rt = self._rt()
        desc = self._check_desc(cache_desc)
        hidden = _check_remote_accessible(remote_accessible)
        tensors = check_user_tensors("tensors_or_addrs", desc, tensors_or_addrs, self._device_for(desc))
        rt.registry.check_unregistered("tensors_or_addrs", tensors, desc.size)
        keys = rt.registry.check_keys(desc, cache_keys)
        on_device = rt.devices is not None and desc.placement == Placement.DEVICE
        cache = rt.registry.add(
            lambda cache_id: KvCache(cache_id, desc, tensors, is_blocks=False, owned=False, on_device=on_device),
            desc.size * desc.num_tensors, keys, None)
        if hidden:
            rt.registry.hide(cache)
        return cache

    def register_blocks_cache(self, cache_desc: CacheDesc, tensors_or_addrs: Sequence[Any],
                              blocks_cache_key: BlocksCacheKey | None = None,
                              remote_accessible: bool | None = None) -> KvCache:
        """Register framework-owned memory as a blocks cache (see :meth:`register_cache`)."""
        self._mode()
        rt = self._rt()
        desc = self._check_desc(cache_desc)
        hidden = _check_remote_accessible(remote_accessible)
        tensors = check_user_tensors("tensors_or_addrs", desc, tensors_or_addrs, self._device_for(desc))
        rt.registry.check_unregistered("tensors_or_addrs", tensors, desc.size)
        key = rt.registry.check_blocks_key(blocks_cache_key)
        on_device = rt.devices is not None and desc.placement == Placement.DEVICE
        cache = rt.registry.add(
            lambda cache_id: KvCache(cache_id, desc, tensors, is_blocks=True, owned=False, on_device=on_device),
            desc.size * desc.num_tensors, [], key)
        if hidden:
            rt.registry.hide(cache)
        return cache

    def deallocate_cache(self, cache: KvCache) -> None:
        """Release the cache's id reference.

        An allocated cache's memory goes once no key refers to it any more
        (keys go by a peer's pull or :meth:`remove_cache_key`); a registered
        cache is unregistered at once and its memory stays the caller's: every
        peer's transfer served against it over a TCP or TLS data channel (the
        stream plane), and every same-host push's copy into it, is cut before
        this returns (the peer's call fails with ``LLM_KV_CACHE_NOT_EXIST``), so
        no such job reads or writes that memory afterwards, and a NIXL pull
        without asking that read it meanwhile asks after all; device-IPC
        pushes, the staging plane (device caches) and NIXL transfers the owner
        answered are not cut (reliability rows 128, 145). A second call for the
        same cache is a no-op, as in LLM-DataDist.

        :raises LLMException: ``LLM_KV_CACHE_NOT_EXIST`` for a cache of another
            LLMDataDist; ``LLM_PARAM_INVALID`` for a ``create_cpu_cache`` cache,
            as LLM-DataDist ("only support device cache"); ``LLM_FAILED``, with
            nothing changed, from another thread while the endpoint's loop runs
            (a release fails that loop's push watches and cuts its transfers).
        """
        self._mode()
        rt = self._rt()
        rt.on_home_thread("deallocate_cache")
        rt.registry.deallocate(cache)
        rt.arrivals.released(cache)  # a watch of its pushes would wait for bytes that cannot come

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Stop offering a row under ``cache_key`` (PROMPT or MIX). No-op if unbound, and for a key of a
        registered cache, which keeps its keys until it is released, as in LLM-DataDist (reference 4.2).
        ``LLM_FAILED``, with nothing changed, from another thread while the endpoint's loop runs."""
        self._mode()
        rt = self._rt()
        self._endpoint.require_role("remove_cache_key", LLMRole.PROMPT, LLMRole.MIX)
        check_instance("cache_key", cache_key, CacheKey)
        rt.on_home_thread("remove_cache_key")
        rt.registry.remove_key(cache_key, owned_only=True)

    def get_cache_tensors(self, cache: KvCache, tensor_index: int = 0) -> list[torch.Tensor]:
        """Torch views of tensor ``tensor_index``, one per device (one here)."""
        self._mode()
        self._rt()
        cache = self._endpoint.live(cache, "cache")
        index = check_index("tensor_index", tensor_index, cache.cache_desc.num_tensors)
        return [cache.tensors[index]]

    # -- local copies ------------------------------------------------------

    async def copy_cache(self, dst: KvCache, src: KvCache, dst_batch_index: int = 0,
                         src_batch_index: int = 0, offset: int = 0, size: int = -1,
                         req_id: int | None = None, *, timeout: int | None = None) -> None:
        """Copy one batch row of every tensor from ``src`` to ``dst``.

        :param offset: byte offset inside the row (both sides).
        :param size: bytes per tensor; -1 copies the rest of the row.
        :param req_id: the request the copy is for (uint64), for logs only, as in LLM-DataDist.
        :raises LLMException: ``LLM_PARAM_INVALID`` for blocks caches,
            mismatched descs or out-of-range rows/bytes; ``LLM_TIMEOUT``.
        """
        self._mode()
        if req_id is not None:
            check_uint("req_id", req_id)
        dst = self._endpoint.live(dst, "dst")
        src = self._endpoint.live(src, "src")
        for arg, cache in (("dst", dst), ("src", src)):
            if cache.is_blocks_cache:
                raise param_invalid(arg, "copy_cache needs a contiguous cache, got a blocks cache (use copy_blocks)")
        _check_same_rows("src", dst, src)
        dl, sl = dst.layout, src.layout
        drow = _check_batch_index("dst_batch_index", dst_batch_index, dl.rows)
        srow = _check_batch_index("src_batch_index", src_batch_index, sl.rows)
        offset = check_int("offset", check_uint("offset", offset), hi=dl.row_bytes - 1)
        size = check_int("size", size, lo=-1)
        nbytes = dl.row_bytes - offset if size == -1 else size
        if size == 0 or nbytes > dl.row_bytes - offset:
            raise param_invalid("size", f"must be -1 or in [1, {dl.row_bytes - offset}] (row bytes minus offset), "
                                f"got {shown(size)}")
        if dst is src and drow == srow:
            raise param_invalid("dst_batch_index", "source and destination are the same row")
        await self._copy_rows(dst, [drow], src, [srow], offset, nbytes, "copy_cache", timeout)

    async def copy_blocks(self, cache: KvCache, copy_block_info: Mapping[int, Sequence[int]], *,
                          timeout: int | None = None) -> None:
        """Copy blocks inside one blocks cache: ``{src_block: [dst_block, ...]}``.

        :raises LLMException: ``LLM_PARAM_INVALID`` for a non-blocks cache,
            out-of-range blocks, a destination named twice or a destination
            that is also a source; ``LLM_TIMEOUT``.
        """
        self._mode()
        cache = self._endpoint.live(cache, "cache")
        if not cache.is_blocks_cache:
            raise param_invalid("cache", "copy_blocks needs a blocks cache")
        if not isinstance(copy_block_info, Mapping):
            raise param_type_error("copy_block_info", f"expected a dict {{src_block: [dst_blocks]}}, got "
                                   f"{type(copy_block_info).__name__}")
        if not copy_block_info:
            raise param_invalid("copy_block_info", "expected a non-empty dict {src_block: [dst_blocks]}")
        rows = cache.layout.rows
        # On a device the copy of hundreds of blocks takes well under a millisecond: the core checks a plain,
        # valid dict in one pass; anything else goes through the checks below, which name what is wrong.
        fast = _core.block_pairs(copy_block_info, rows)
        if fast is not None:
            await self._copy_rows(cache, fast[1], cache, fast[0], 0, cache.layout.row_bytes, "copy_blocks", timeout)
            return
        srcs: list[int] = []
        dsts: list[int] = []
        for src_block, dst_blocks in copy_block_info.items():
            s = check_index("copy_block_info", src_block, rows, what="source block")
            if isinstance(dst_blocks, (int, str, bytes)) or not isinstance(dst_blocks, Sequence):
                raise param_type_error("copy_block_info", f"destinations of block {s} must be a list, got "
                                       f"{type(dst_blocks).__name__}")
            if not dst_blocks:
                raise param_invalid("copy_block_info", f"destinations of block {s} must be a non-empty list")
            for d in dst_blocks:
                dsts.append(check_index("copy_block_info", d, rows, what="destination block"))
                srcs.append(s)
        if len(set(dsts)) != len(dsts):
            raise param_invalid("copy_block_info", "a destination block is named twice")
        both = set(dsts) & set(srcs)
        if both:
            raise param_invalid("copy_block_info", f"block {min(both)} is both a source and a destination")
        await self._copy_rows(cache, dsts, cache, srcs, 0, cache.layout.row_bytes, "copy_blocks", timeout)

    async def swap_blocks(self, src: KvCache, dst: KvCache, src_to_dst: Mapping[int, int], *,
                          timeout: int | None = None) -> None:
        """Copy blocks between a HOST and a DEVICE blocks cache: ``{src_block: dst_block}``.

        ``src`` or ``dst`` may come from :meth:`KvCache.create_cpu_cache`.

        :raises LLMException: ``LLM_PARAM_INVALID`` for non-blocks caches, equal
            placements, different block sizes or tensor counts, out-of-range or
            repeated destination blocks; ``LLM_TIMEOUT``.
        """
        self._mode()
        src = self._endpoint.live(src, "src")
        dst = self._endpoint.live(dst, "dst")
        for arg, cache in (("src", src), ("dst", dst)):
            if not cache.is_blocks_cache:
                raise param_invalid(arg, "swap_blocks needs blocks caches")
        if src.cache_desc.placement == dst.cache_desc.placement:
            raise param_invalid("dst", "swap_blocks moves between HOST and DEVICE; both caches have "
                                f"placement {src.cache_desc.placement.name}")
        _check_same_rows("dst", src, dst)
        if not isinstance(src_to_dst, Mapping):
            raise param_type_error("src_to_dst", f"expected a dict {{src_block: dst_block}}, got "
                                   f"{type(src_to_dst).__name__}")
        if not src_to_dst:
            raise param_invalid("src_to_dst", "expected a non-empty dict {src_block: dst_block}")
        pairs = list(src_to_dst.items())  # one pass: a Mapping's keys and values() need not agree
        srcs = [check_index("src_to_dst", s, src.layout.rows, what="source block") for s, _ in pairs]
        dsts = [check_index("src_to_dst", d, dst.layout.rows, what="destination block") for _, d in pairs]
        if len(set(dsts)) != len(dsts):
            raise param_invalid("src_to_dst", "a destination block is named twice")
        await self._copy_rows(dst, dsts, src, srcs, 0, dst.layout.row_bytes, "swap_blocks", timeout)

    async def _copy_rows(self, dst: KvCache, dst_rows: Sequence[int], src: KvCache, src_rows: Sequence[int],
                         offset: int, nbytes: int, what: str, timeout: Any) -> None:
        """A local copy between two caches of ours. Releasing a registered one of them (the caller's memory
        again once that call returned) stops the copy inside that call; the copy then fails
        ``LLM_KV_CACHE_NOT_EXIST`` (``docs/reliability.md``, row 206)."""
        rt = self._rt()
        self._endpoint.home_loop(what)
        timeout_ms = self._timeout(timeout)
        if involves_device(dst, src):
            await _device_copy_cut_on_release(rt, dst, dst_rows, src, src_rows, offset, nbytes, timeout_ms, what)
            return
        triples = copy_triples(dst.layout, 0, dst_rows, offset, src.layout, 0, src_rows, offset,
                               dst.layout.num_tensors, nbytes)
        await run_copy_job(rt, triples, what, (dst, src), timeout_ms, caches=(dst, src))


    # -- transfers with peers -----------------------------------------------

    def _layer_args(self, src_layer_range: Any, dst_layer_range: Any, tensor_num_per_layer: Any,
                    timeout: Any) -> tuple[tuple[int, int], tuple[int, int], int, int]:
        src = layer_pair("src_layer_range", src_layer_range)
        dst = layer_pair("dst_layer_range", dst_layer_range)
        per_layer = check_int("tensor_num_per_layer", tensor_num_per_layer, lo=1, hi=255)
        return src, dst, per_layer, self._timeout(timeout)

    def _ext_param(self, ext_param: Any) -> tuple[tuple[int, int], tuple[int, int], int]:
        if ext_param is None:
            return (-1, -1), (-1, -1), 2
        check_instance("ext_param", ext_param, KvCacheExtParam)
        return (tuple(ext_param.src_layer_range), tuple(ext_param.dst_layer_range),
                ext_param.tensor_num_per_layer)

    async def pull_cache(self, cache_key: CacheKey | CacheKeyByIdAndIndex, kv_cache: KvCache,
                         batch_index: int = 0, size: int = -1, *, src_layer_range: range | None = None,
                         dst_layer_range: range | None = None, tensor_num_per_layer: int = 2,
                         src_cache_offset: int | None = None, dst_cache_offset: int | None = None,
                         timeout: int | None = None, **unknown: Any) -> None:
        """Pull one remote batch row into row ``batch_index`` of ``kv_cache`` (DECODER or MIX).

        :param cache_key: a :class:`CacheKey` bound on the owner (consumed by a
            successful pull), or a :class:`CacheKeyByIdAndIndex`.
        :param size: bytes per tensor; -1 pulls the whole row (row sizes must
            match), or with an offset the rest of the local row from
            ``dst_cache_offset`` on.
        :param src_layer_range: the owner's layers (``range``; None: all).
        :param dst_layer_range: the local layers (``range``; None: all).
        :param tensor_num_per_layer: tensors per layer (2: K and V).
        :param src_cache_offset: bytes into the remote row (>= 0), LLM-DataDist's
            KvCacheManager spelling; None: 0.
        :param dst_cache_offset: bytes into the local row (>= 0); None: 0.
        :param timeout: ms; None: ``sync_kv_timeout``.
        :param unknown: any other keyword is refused (``LLM_PARAM_INVALID`` naming it, a ``TypeError``).
        :raises LLMException: ``LLM_PARAM_INVALID``, ``LLM_NOT_YET_LINK``,
            ``LLM_KV_CACHE_NOT_EXIST``, ``LLM_TIMEOUT``, ``LLM_LINK_FAILED``.
        """
        self._mode()
        _no_unknown(unknown)
        rt = self._rt()
        self._endpoint.require_role("pull_cache", LLMRole.DECODER, LLMRole.MIX)
        self._endpoint.home_loop("pull_cache")
        key = _check_pull_key("cache_key", cache_key, (CacheKey, CacheKeyByIdAndIndex))
        cache = self._endpoint.live(kv_cache, "kv_cache")
        if cache.is_blocks_cache:
            raise param_invalid("kv_cache", "pull_cache needs a contiguous cache (use pull_blocks for blocks)")
        src_offset = _cache_offset("src_cache_offset", src_cache_offset)
        dst_offset = _cache_offset("dst_cache_offset", dst_cache_offset)
        src, dst, per_layer, timeout_ms = self._layer_args(src_layer_range, dst_layer_range, tensor_num_per_layer,
                                                           timeout)
        lay = cache.layout
        row = _check_batch_index("batch_index", batch_index, lay.rows)
        local_offset = dst_offset or 0
        if local_offset >= lay.row_bytes:
            raise param_invalid("dst_cache_offset",
                                f"must be below the row size {lay.row_bytes}, got {shown(local_offset)}")
        room = lay.row_bytes - local_offset
        size = check_int("size", size, lo=-1, hi=room)
        if size == 0:
            raise param_invalid("size", f"must be -1 or in [1, {room}], got 0")
        nbytes = room if size == -1 else size
        whole_rows = size == -1 and src_offset is None and dst_offset is None
        flags = ReqFlag.CONTIG | (ReqFlag.EXACT if whole_rows else 0)
        plan = build_plan(cache, dst, src, per_layer, [row], nbytes, (), nbytes, flags,
                          target_fields(key), "dst", remote_offset=src_offset or 0, local_offset=local_offset)
        link = self._endpoint.require_links().get(key.cluster_id)
        await run_pull(rt, link, plan, timeout_ms, "pull_cache")

    async def pull_blocks(self, src_cache_key: BlocksCacheKey | CacheKey | CacheKeyByIdAndIndex | None = None,
                          dst_cache: KvCache | None = None, src_blocks: Sequence[int] = (),
                          dst_blocks: Sequence[int] = (), *, src_layer_range: range | None = None,
                          dst_layer_range: range | None = None, tensor_num_per_layer: int = 2,
                          timeout: int | None = None, prompt_cache_key: Any = None, decoder_kv_cache: Any = None,
                          prompt_blocks: Sequence[int] | None = None,
                          decoder_blocks: Sequence[int] | None = None, **unknown: Any) -> None:
        """Pull remote blocks into ``dst_blocks`` of a local blocks cache (DECODER or MIX).

        With a :class:`BlocksCacheKey`, remote block ``src_blocks[i]`` lands in
        ``dst_blocks[i]``. With a :class:`CacheKey` or
        :class:`CacheKeyByIdAndIndex` and empty ``src_blocks``, one remote
        contiguous row is scattered over ``dst_blocks`` in order.

        :param src_layer_range: the owner's layers (``range``; None: all).
        :param dst_layer_range: the local layers (``range``; None: all).
        :param tensor_num_per_layer: tensors per layer (2: K and V).
        :param timeout: ms; None: ``sync_kv_timeout``.
        :param prompt_cache_key: the KvCacheManager (v1) name of ``src_cache_key``
            (likewise ``decoder_kv_cache`` of ``dst_cache``, ``prompt_blocks`` of
            ``src_blocks``, ``decoder_blocks`` of ``dst_blocks``); give one name or the other.
        :param unknown: any other keyword is refused, as by :meth:`pull_cache`.
        :raises LLMException: as :meth:`pull_cache`.
        """
        if _trace.ON:
            _trace.mark("call")
        self._mode()
        _no_unknown(unknown)
        src_cache_key = _alias(prompt_cache_key, "prompt_cache_key", "src_cache_key", src_cache_key, None)
        dst_cache = _alias(decoder_kv_cache, "decoder_kv_cache", "dst_cache", dst_cache, None)
        src_blocks = _alias(prompt_blocks, "prompt_blocks", "src_blocks", src_blocks, ())
        dst_blocks = _alias(decoder_blocks, "decoder_blocks", "dst_blocks", dst_blocks, ())
        rt = self._rt()
        self._endpoint.require_role("pull_blocks", LLMRole.DECODER, LLMRole.MIX)
        self._endpoint.home_loop("pull_blocks")
        key = _check_pull_key("src_cache_key", src_cache_key, (BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex))
        cache = self._endpoint.live(dst_cache, "dst_cache")
        if not cache.is_blocks_cache:
            raise param_invalid("dst_cache", "pull_blocks needs a blocks cache")
        src, dst, per_layer, timeout_ms = self._layer_args(src_layer_range, dst_layer_range, tensor_num_per_layer,
                                                           timeout)
        lay = cache.layout
        dsts = check_indices("dst_blocks", dst_blocks, lay.rows, what="block index", allow_empty=False)
        _check_unique("dst_blocks", dsts)
        if isinstance(key, BlocksCacheKey):
            srcs = check_indices("src_blocks", src_blocks, 2**63, what="block index", allow_empty=False)
            if len(srcs) != len(dsts):
                raise param_invalid("src_blocks", f"has {len(srcs)} blocks, dst_blocks has {len(dsts)}")
            plan = build_plan(cache, dst, src, per_layer, dsts, lay.row_bytes, srcs, lay.row_bytes,
                              ReqFlag.BLOCKS | ReqFlag.EXACT, target_fields(key), "dst")
        else:
            if check_indices("src_blocks", src_blocks, 2**63) != ():
                raise param_invalid("src_blocks", "must be empty when pulling a contiguous cache into blocks")
            plan = build_plan(cache, dst, src, per_layer, dsts, lay.row_bytes, (), lay.row_bytes * len(dsts),
                              ReqFlag.CONTIG, target_fields(key), "dst")
        link = self._endpoint.require_links().get(key.cluster_id)
        await run_pull(rt, link, plan, timeout_ms, "pull_blocks", names=_PULL_BLOCKS_NAMES)

    async def push_blocks(self, dst_cache_index_or_key: CacheIndex | BlocksCacheKey, src_cache: KvCache,
                          src_blocks: Sequence[int], dst_blocks: Sequence[int],
                          ext_param: KvCacheExtParam | None = None, *, timeout: int | None = None) -> None:
        """Push local blocks into a peer's blocks cache (PushKvBlocks; PROMPT or MIX).

        :param dst_cache_index_or_key: :class:`CacheIndex` (``batch_index`` 0)
            or :class:`BlocksCacheKey` of the remote blocks cache.
        :param ext_param: inclusive layer ranges and ``tensor_num_per_layer``.
        :returns: once the peer confirmed the bytes are in place.
        :raises LLMException: ``LLM_PARAM_INVALID``, ``LLM_NOT_YET_LINK``,
            ``LLM_TIMEOUT``, ``LLM_KV_CACHE_NOT_EXIST``, ``LLM_LINK_FAILED``.
        """
        self._mode()
        rt = self._rt()
        self._endpoint.require_role("push_blocks", LLMRole.PROMPT, LLMRole.MIX)
        self._endpoint.home_loop("push_blocks")
        key = _check_pull_key("dst_cache_index_or_key", dst_cache_index_or_key, (CacheIndex, BlocksCacheKey))
        if isinstance(key, CacheIndex) and key.batch_index != 0:
            raise param_invalid("dst_cache_index_or_key", "batch_index must be 0 for a blocks cache")
        cache = self._endpoint.live(src_cache, "src_cache")
        if not cache.is_blocks_cache:
            raise param_invalid("src_cache", "push_blocks needs a blocks cache")
        src, dst, per_layer = self._ext_param(ext_param)
        timeout_ms = self._timeout(timeout)
        lay = cache.layout
        srcs = check_indices("src_blocks", src_blocks, lay.rows, what="block index", allow_empty=False)
        dsts = check_indices("dst_blocks", dst_blocks, 2**63, what="block index", allow_empty=False)
        if len(srcs) != len(dsts):
            raise param_invalid("dst_blocks", f"has {len(dsts)} blocks, src_blocks has {len(srcs)}")
        _check_unique("dst_blocks", dsts)
        plan = build_plan(cache, src, dst, per_layer, srcs, lay.row_bytes, dsts, lay.row_bytes,
                          ReqFlag.BLOCKS | ReqFlag.EXACT, target_fields(key), "src")
        link = self._endpoint.require_links().get(key.cluster_id)
        await run_push(rt, link, plan, timeout_ms, "push_blocks", names=_PUSH_NAMES)

    async def push_cache(self, dst_cache_index_or_key: CacheIndex | CacheKeyByIdAndIndex, src_cache: KvCache,
                         src_batch_index: int = 0, ext_param: KvCacheExtParam | None = None,
                         size: int = -1, *, timeout: int | None = None) -> None:
        """Push one batch row of ``src_cache`` into a peer's contiguous cache row (PROMPT or MIX).

        :param dst_cache_index_or_key: remote cluster, cache id and destination row.
        :param size: must be -1 (whole rows), as in LLM-DataDist.
        :raises LLMException: as :meth:`push_blocks`.
        """
        self._mode()
        rt = self._rt()
        self._endpoint.require_role("push_cache", LLMRole.PROMPT, LLMRole.MIX)
        self._endpoint.home_loop("push_cache")
        key = _check_pull_key("dst_cache_index_or_key", dst_cache_index_or_key, (CacheIndex, CacheKeyByIdAndIndex))
        cache = self._endpoint.live(src_cache, "src_cache")
        if cache.is_blocks_cache:
            raise param_invalid("src_cache", "push_cache needs a contiguous cache (use push_blocks for blocks)")
        if check_int("size", size) != -1:
            raise param_invalid("size", f"only -1 (whole rows) is supported, got {shown(size)}")
        src, dst, per_layer = self._ext_param(ext_param)
        timeout_ms = self._timeout(timeout)
        lay = cache.layout
        row = _check_batch_index("src_batch_index", src_batch_index, lay.rows)
        plan = build_plan(cache, src, dst, per_layer, [row], lay.row_bytes, (), lay.row_bytes,
                          ReqFlag.CONTIG | ReqFlag.EXACT, target_fields(key), "src")
        link = self._endpoint.require_links().get(key.cluster_id)
        await run_push(rt, link, plan, timeout_ms, "push_cache", names=_PUSH_NAMES)


    # -- layer-wise -----------------------------------------------------------

    def transfer_cache_async(self, src_cache: KvCache, layer_synchronizer: LayerSynchronizer,
                             transfer_configs: Sequence[TransferConfig | TransferWithCacheKeyConfig],
                             src_block_indices: Sequence[int] | None = None,
                             dst_block_indices: Sequence[int] | None = None,
                             dst_block_memory_size: int | None = None) -> CacheTask:
        """Push ``src_cache`` layer by layer as prefill computes it (PROMPT or MIX).

        Called from the event loop the LLMDataDist was initialised on (from
        another: ``LLM_FAILED``); returns at once. For each layer, in
        order, ``layer_synchronizer.synchronize_layer(i, None)`` (plain or
        ``async``; the timeout is None, as LLM-DataDist passes it) is awaited,
        then that layer (K and V, tensors ``2i, 2i+1``) is pushed to every
        destination without waiting for earlier layers' confirmations.

        :param transfer_configs: :class:`TransferWithCacheKeyConfig` (remote
            cache by ``BlocksCacheKey`` or ``CacheKeyByIdAndIndex``) or
            :class:`TransferConfig` (raw remote tensor addresses, 2 per layer,
            checked by the receiver against its registered caches).
        :param src_block_indices: source blocks (blocks caches). Without block
            indices (None or empty on both) a blocks cache goes as LLM-DataDist
            moves it: as a contiguous cache whose rows are its blocks, row 0
            (block 0 of each tensor) to row 0 of the destination.
        :param dst_block_indices: destination blocks, one per source block
            (a contiguous source goes into blocks only through the
            CacheManager, as in LLM-DataDist).
        :param dst_block_memory_size: bytes between destination blocks for a
            ``TransferConfig`` into a blocks layout (default: the source's).
        :returns: a :class:`CacheTask` (``await`` it, or its layer futures).
        :raises LLMException: ``LLM_PARAM_INVALID`` for bad arguments (before
            anything is sent), ``LLM_NOT_YET_LINK`` for an unlinked destination.
        """
        self._mode()
        return self._start_layerwise(src_cache, layer_synchronizer, transfer_configs, src_block_indices,
                                    dst_block_indices, dst_block_memory_size, cache_to_blocks=False)

    def _start_layerwise(self, src_cache: KvCache, layer_synchronizer: LayerSynchronizer,
                        transfer_configs: Sequence[TransferConfig | TransferWithCacheKeyConfig],
                        src_block_indices: Sequence[int] | None, dst_block_indices: Sequence[int] | None,
                        dst_block_memory_size: int | None, *, cache_to_blocks: bool) -> CacheTask:
        """:meth:`transfer_cache_async`, and the CacheManager's (``cache_to_blocks``: a contiguous cache
        may go into destination blocks, as LLM-DataDist's CacheManager allows and its KvCacheManager not)."""
        self._rt()
        self._endpoint.require_role("transfer_cache_async", LLMRole.PROMPT, LLMRole.MIX)
        self._endpoint.home_loop("transfer_cache_async")
        cache = self._endpoint.live(src_cache, "src_cache")
        owners = self._endpoint.owners
        return start_transfer(self._rt(), self._endpoint.require_links(), cache, layer_synchronizer,
                              transfer_configs, src_block_indices, dst_block_indices, dst_block_memory_size,
                              cache_to_blocks=cache_to_blocks, hold=None if owners is None else owners.hold)

    def watch_pushes(self, cache: KvCache, rows: Sequence[int], layers: range | None = None, *,
                     tensors_per_layer: int = 2) -> PushWatch:
        """Watch peer pushes land in ``rows`` (blocks or batch rows) of ``cache``.

        Create the watch before asking the peer to push; ``await watch`` or
        ``await watch.layer(i)`` then tells when the bytes are in place.

        :param layers: the layers to watch (default: all).
        :raises LLMException: ``LLM_PARAM_INVALID`` for bad rows or layers, or a cache no peer can push
            into (``create_cpu_cache``, kept from peers); ``LLM_FAILED`` when called off the event
            loop this LLMDataDist was initialised on (the watch's futures live there).
        """
        self._mode()
        rt = self._rt()
        self._endpoint.home_loop("a push watch")  # the endpoint's loop completes the watch's futures
        cache = self._endpoint.live(cache, "cache")
        if cache.cache_id == -1:
            raise param_invalid("cache", "a CPU cache (create_cpu_cache) is never registered here: no peer "
                                "can push into it")
        if not rt.settings.remote_cache_accessible or rt.registry.hidden(cache):
            raise param_invalid("cache", "it is kept from peers (remote_accessible=False, or this endpoint's "
                                "llm.EnableRemoteCacheAccessible is '0'): no peer can push into it")
        per_layer = check_int("tensors_per_layer", tensors_per_layer, lo=1, hi=255)
        num_tensors = cache.cache_desc.num_tensors
        if num_tensors % per_layer:
            raise param_invalid("tensors_per_layer", f"does not divide num_tensors {num_tensors}")
        num_layers = num_tensors // per_layer
        watched = check_indices("rows", rows, cache.layout.rows, what="row", allow_empty=False)
        if layers is None:
            layers = range(num_layers)
        if not isinstance(layers, range) or layers.step != 1 or not 0 <= layers.start < layers.stop <= num_layers:
            raise param_invalid("layers", f"must be a non-empty step-1 range within {num_layers} layers")
        return rt.arrivals.add(PushWatch(rt.arrivals, cache, watched, layers, per_layer))


def _no_unknown(unknown: dict[str, Any]) -> None:
    if unknown:
        raise param_type_error(sorted(unknown)[0], "unexpected keyword argument")


def _alias(given: Any, alias: str, name: str, value: Any, default: Any) -> Any:
    """``value``, or ``given``: the same argument under its KvCacheManager (v1) name ``alias``."""
    if given is not None:
        if value is not default:
            raise param_type_error(alias, f"give {name} or {alias}, not both")
        value = given
    if value is None and default is None:
        raise param_type_error(name, "missing required argument")
    return value


def _cache_offset(name: str, value: Any) -> int | None:
    """A ``pull_cache`` byte offset: None when not given, else an int >= 0 (``TypeError`` /
    ``ValueError`` otherwise, as LLM-DataDist's ``check_positive_or_set_default``)."""
    if value is None:
        return None
    number = check_int(name, value)
    if not 0 <= number < 2**63:
        raise param_value_error(name, f"must be an int64 >= 0, got {shown(number)}")
    return number


def _check_remote_accessible(value: Any) -> bool:
    """Whether a registration keeps its cache from peers (``remote_accessible=False``)."""
    return value is not None and not check_bool("remote_accessible", value)


#: The owner's names for what a pull of blocks or a push names, in the v1 calls' words (``_checks.named_as``).
#: A contiguous row pulled into blocks (a CacheKey or CacheKeyByIdAndIndex) moves as many bytes per row as the
#: blocks hold: the owner's "size" (pull_cache's argument) is pull_blocks' ``dst_blocks``.
_PULL_BLOCKS_NAMES = {"cache_key": "src_cache_key", "size": "dst_blocks"}
_PUSH_NAMES = {"dst_cache_key": "dst_cache_index_or_key"}
#: The other way: v1 push_cache / push_blocks' key as LLM-DataDist's v2 calls and the compat facade spell it.
PUSH_KEY_AS_DST_CACHE_KEY = {"dst_cache_index_or_key": "dst_cache_key"}


def _check_pull_key(arg: str, key: Any, kinds: tuple[type, ...]) -> Any:
    check_instance(arg, key, kinds)
    if isinstance(key, CacheKey) and (key.req_id != UINT64_MAX) == (key.prefix_id != UINT64_MAX):
        raise param_invalid(arg, "exactly one of req_id and prefix_id must be set")
    return key


def _check_batch_index(arg: str, value: Any, rows: int) -> int:
    """A batch row: a uint32 (a ``ValueError`` too outside it, as LLM-DataDist's ``check_uint32``) below ``rows``."""
    return check_index(arg, check_uint(arg, value, 32), rows, what="batch index")


def _check_unique(arg: str, blocks: Sequence[int]) -> None:
    if len(set(blocks)) != len(blocks):
        raise param_invalid(arg, "a block is named twice")


def _check_same_rows(arg: str, a: KvCache, b: KvCache) -> None:
    da, db = a.cache_desc, b.cache_desc
    if da.num_tensors != db.num_tensors:
        raise param_invalid(arg, f"num_tensors differ ({da.num_tensors} vs {db.num_tensors})")
    if da.data_type != db.data_type:
        raise param_invalid(arg, f"data types differ ({da.data_type.name} vs {db.data_type.name})")
    if da.shape[1:] != db.shape[1:]:
        raise param_invalid(arg, f"row shapes differ ({da.shape[1:]} vs {db.shape[1:]})")


def _allocate_device(rt: Runtime, desc: CacheDesc, nbytes: int) -> tuple[list[torch.Tensor], Any]:
    try:
        return rt.devices.allocate_shared(desc)  # type: ignore[union-attr]
    except torch.OutOfMemoryError as exc:
        raise LLMException(f"allocating {nbytes} bytes on {rt.device} failed: {exc}",
                           status_code=LLMStatusCode.LLM_OUT_OF_MEMORY) from exc


async def _device_copy_cut_on_release(rt: Runtime, dst: KvCache, dst_rows: Sequence[int], src: KvCache,
                                      src_rows: Sequence[int], offset: int, nbytes: int, timeout_ms: int,
                                      what: str) -> None:
    """``copy_rows`` (device copies, or the staged swap's), stopped when a registered cache of the two is released:
    the device copies queued cannot be recalled, so the release waits until the copy stream has done them
    (``wait_cut_copies``), cancels and waits the staged swap's host copies running, and cancels the copy's task
    so that it queues nothing more; the copy then fails ``LLM_KV_CACHE_NOT_EXIST``. A copy that was queued whole
    and that the stream has done by then moved every byte before the release returned: it stays a success. The
    caller's own cancel (a timeout scope, ``task.cancel()``) stays a cancel."""
    host_jobs: set[int] = set()
    queued: list[bool] = []
    task = asyncio.ensure_future(copy_rows(rt, dst, dst_rows, src, src_rows, offset, nbytes, timeout_ms, what,
                                           host_jobs=host_jobs, queued=queued))
    cut: list[bool] = []
    me = asyncio.current_task()
    cancelling = me.cancelling() if me is not None else 0

    def stop() -> None:
        if task.done():
            return
        stop_host_copies(rt.copier, list(host_jobs), what)
        wait_cut_copies(rt, what)
        backend = rt.devices
        if queued and backend is not None and backend.wait_copies(0):
            return  # queued whole and done: every byte moved before the release returns
        cut.append(True)
        task.cancel()

    forget = rt.registry.serving((dst, src), stop)
    try:
        await task
    except (asyncio.CancelledError, LLMException):
        if cut and task.done() and (me is None or me.cancelling() <= cancelling):
            raise LLMException(f"{what}: a cache was released during the copy",
                               status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST) from None
        raise
    finally:
        if forget is not None:
            forget()
