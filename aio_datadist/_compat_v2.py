"""The blocking ``CacheManager`` of ``aio_datadist.compat`` (LLM-DataDist's CacheManager mode, v2).

Same names, signatures and defaults as llm_datadist's ``CacheManager``; each
call runs on compat's event-loop thread (injected by ``compat`` as
``runner``, which sits beside this module) and blocks until it is done.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aio_datadist.cache_manager import Cache
from aio_datadist.cache_manager import CacheManager as _AsyncCacheManager
from aio_datadist.types import BlocksCacheKey, CacheDesc, CacheKey, LayerSynchronizer, MemInfo

__all__ = ["CacheManager"]


class CacheManager:
    """Blocking view of :class:`aio_datadist.CacheManager`, from ``LLMDataDist.cache_manager``."""

    def __init__(self, manager: _AsyncCacheManager, runner: Any, wrap_task: Callable[[Any], Any]) -> None:
        self._m = manager
        self._runner = runner
        self._wrap_task = wrap_task

    def register_cache(self, cache_desc: CacheDesc, addrs: list[Any], cache_keys: Sequence[CacheKey] = (),
                       remote_accessible: bool | None = None) -> Cache:
        return self._runner.call(self._m.register_cache, cache_desc, addrs, cache_keys, remote_accessible,
                                 undo=self._release())

    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: list[Any],
                              blocks_cache_key: BlocksCacheKey | None = None,
                              remote_accessible: bool | None = None) -> Cache:
        return self._runner.call(self._m.register_blocks_cache, cache_desc, addrs, blocks_cache_key,
                                 remote_accessible, undo=self._release())

    def unregister_cache(self, cache_id: int) -> None:
        self._runner.call(self._m.unregister_cache, cache_id)

    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey] = ()) -> Cache:
        return self._runner.call(self._m.allocate_cache, cache_desc, cache_keys, undo=self._release(cache_keys))

    def allocate_blocks_cache(self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None) -> Cache:
        return self._runner.call(self._m.allocate_blocks_cache, cache_desc, blocks_cache_key, undo=self._release())

    def _release(self, cache_keys: Sequence[CacheKey] = ()) -> Callable[[Cache], None]:
        """What releases a cache made by a call its caller interrupted: an allocated cache's keys would keep it."""
        def release(cache: Cache) -> None:
            self._m.unregister_cache(cache.cache_id)  # any kind of cache, allocated or registered
            for key in cache_keys:
                self._m.remove_cache_key(key)

        return release

    def deallocate_cache(self, cache: Cache) -> None:
        self._runner.call(self._m.deallocate_cache, cache)

    def deallocate_blocks_cache(self, cache: Cache) -> None:
        self._runner.call(self._m.deallocate_blocks_cache, cache)

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        self._runner.call(self._m.remove_cache_key, cache_key)

    def remap_registered_memory(self, mem_infos: MemInfo | list[MemInfo]) -> None:
        self._runner.call(self._m.remap_registered_memory, mem_infos)

    def copy_cache(self, dst: Cache, src: Cache, dst_batch_index: int = 0, src_batch_index: int = 0,
                   offset: int = 0, size: int = -1, req_id: int | None = None) -> None:
        self._runner.run(self._m.copy_cache(dst, src, dst_batch_index, src_batch_index, offset, size, req_id))

    def copy_blocks(self, cache: Cache, copy_block_info: Mapping[int, Sequence[int]]) -> None:
        self._runner.run(self._m.copy_blocks(cache, copy_block_info))

    def swap_blocks(self, src_cache: Cache, dst_cache: Cache, src_to_dst: Mapping[int, int]) -> None:
        self._runner.run(self._m.swap_blocks(src_cache, dst_cache, src_to_dst))

    def pull_cache(self, cache_key: Any, cache: Cache, batch_index: int = 0, size: int = -1, *,
                   src_layer_range: range | None = None, dst_layer_range: range | None = None,
                   tensor_num_per_layer: int = 2, timeout: int | None = None, **unknown: Any) -> None:
        """Blocking :meth:`aio_datadist.CacheManager.pull_cache` (same arguments)."""
        self._runner.run(self._m.pull_cache(cache_key, cache, batch_index, size, src_layer_range=src_layer_range,
                                            dst_layer_range=dst_layer_range,
                                            tensor_num_per_layer=tensor_num_per_layer, timeout=timeout, **unknown))

    def pull_blocks(self, src_cache_key: Any, dst_cache: Cache, src_blocks: Sequence[int] | None = (),
                    dst_blocks: Sequence[int] = (), *, src_layer_range: range | None = None,
                    dst_layer_range: range | None = None, tensor_num_per_layer: int = 2, timeout: int | None = None,
                    **unknown: Any) -> None:
        """Blocking :meth:`aio_datadist.CacheManager.pull_blocks` (same arguments)."""
        self._runner.run(self._m.pull_blocks(src_cache_key, dst_cache, src_blocks, dst_blocks,
                                             src_layer_range=src_layer_range, dst_layer_range=dst_layer_range,
                                             tensor_num_per_layer=tensor_num_per_layer, timeout=timeout, **unknown))

    def push_cache(self, dst_cache_key: Any, src_cache: Cache, src_batch_index: int = 0,
                   src_layer_range: range | None = None, dst_layer_range: range | None = None, size: int = -1,
                   tensor_num_per_layer: int = 2) -> None:
        self._runner.run(self._m.push_cache(dst_cache_key, src_cache, src_batch_index, src_layer_range,
                                            dst_layer_range, size, tensor_num_per_layer))

    def push_blocks(self, dst_cache_key: Any, src_cache: Cache, src_blocks: Sequence[int] = (),
                    dst_blocks: Sequence[int] = (), src_layer_range: range | None = None,
                    dst_layer_range: range | None = None, tensor_num_per_layer: int = 2) -> None:
        self._runner.run(self._m.push_blocks(dst_cache_key, src_cache, src_blocks, dst_blocks, src_layer_range,
                                             dst_layer_range, tensor_num_per_layer))

    def transfer_cache_async(self, src_cache: Cache, layer_synchronizer: LayerSynchronizer,
                             transfer_configs: Sequence[Any], src_block_indices: Sequence[int] | None = None,
                             dst_block_indices: Sequence[int] | None = None,
                             dst_block_memory_size: int | None = None) -> Any:
        """Start the layer-wise push; returns compat's blocking ``CacheTask``."""
        task = self._runner.call(self._m.transfer_cache_async, src_cache, layer_synchronizer, transfer_configs,
                                 src_block_indices, dst_block_indices, dst_block_memory_size,
                                 undo=lambda started: started.cancel())
        return self._wrap_task(task)
