"""Layer-wise push (``transfer_cache_async``): plan every config, then stream layers.

For each layer in order the driver waits for the layer synchronizer, then
starts that layer's push to every destination without waiting for earlier
layers' confirmations (the data channels of a link bound how many are in
flight). A layer counts as done once every destination confirmed it; layer
futures complete in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aio_datadist._checks import check_indices, check_instance, check_uint, param_invalid, param_type_error
from aio_datadist._settle import settle
from aio_datadist.cache import KvCache
from aio_datadist.layers import range_pair
from aio_datadist.plans import Plan, addrs_target, build_plan, target_fields
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.task import CacheTask, TaskProgress
from aio_datadist.transfers import run_push
from aio_datadist.types import (
    BlocksCacheKey,
    LayerSynchronizer,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from aio_datadist.wire import ReqFlag

if TYPE_CHECKING:
    from aio_datadist.links import Link
    from aio_datadist.runtime import Runtime

__all__ = ["start_transfer"]

TENSORS_PER_LAYER = 2
PUSHES_END_S = 10.0


@dataclass
class _Config:
    index: int
    link: Link
    src_layers: range
    plans: dict[int, list[Plan]]  # per layer, pushed one after the other (two for a row split into blocks)
    names: dict[str, str]  # the owner's names for what the config says, in the call's words (``_checks.named_as``)


@dataclass(frozen=True)
class _Chunks:
    """A contiguous source row split into destination blocks of ``size`` bytes (cache to blocks, v2):
    ``blocks[j]`` gets bytes ``[j * size, (j + 1) * size)`` of the row, the last one what is left."""

    blocks: tuple[int, ...]
    size: int
    full: int  # how many of the blocks get ``size`` bytes; the one after them, if any, the rest
    rest: int


def _layer_range(arg: str, value: Any, num_layers: int) -> range:
    if value is None:
        return range(num_layers)
    range_pair(arg, value)
    if value.stop > num_layers:
        raise param_invalid(arg, f"{value!r} exceeds the {num_layers} layers of the cache")
    return value


@dataclass(frozen=True)
class _Piece:
    """One request of a layer to one destination, the same for every layer: the local rows and bytes per
    row (from ``local_offset``), the destination's rows and bytes per row (by raw address: after the
    layer's two addresses, ``remote_offset`` being the block stride)."""

    local_rows: list[int]
    local_nbytes: int
    remote_rows: list[int]
    remote_nbytes: int
    flags: int
    local_offset: int = 0
    remote_offset: int = 0


def _chunk_pieces(row: int, chunks: _Chunks, whole: int, remote_offset: int) -> list[_Piece]:
    """A contiguous row into blocks: the blocks that take ``chunks.size`` bytes (flags ``whole``), then the
    one that takes the rest of the row, if any (its own request: its bytes per row differ)."""
    full, size = chunks.full, chunks.size
    pieces = [_Piece([row], full * size, list(chunks.blocks[:full]), size, whole, 0, remote_offset)]
    if chunks.rest:
        pieces.append(_Piece([row], chunks.rest, list(chunks.blocks[full:]), chunks.rest, ReqFlag.BLOCKS,
                             full * size, remote_offset))
    return pieces


def _plan_config(links: Any, index: int, cfg: Any, src: KvCache, src_blocks: tuple[int, ...] | None,
                 dst_blocks: tuple[int, ...] | None, dst_block_bytes: int | None,
                 chunks: _Chunks | None) -> _Config:
    arg = f"transfer_configs[{index}]"
    check_instance(arg, cfg, (TransferConfig, TransferWithCacheKeyConfig))
    num_layers = src.cache_desc.num_tensors // TENSORS_PER_LAYER
    lay = src.layout
    blocks = src.is_blocks_cache
    src_layers = _layer_range(f"{arg}.src_layer_range", cfg.src_layer_range, num_layers)
    if blocks and cfg.src_batch_index != 0:
        raise param_invalid(f"{arg}.src_batch_index", "must be 0 for a blocks cache")
    if blocks:
        assert src_blocks is not None and dst_blocks is not None  # start_transfer sets both for a blocks source
        src_rows, dst_rows = list(src_blocks), list(dst_blocks)
    else:
        src_rows, dst_rows = [_row(f"{arg}.src_batch_index", cfg.src_batch_index, lay.rows)], []
    plans: dict[int, list[Plan]] = {}
    if isinstance(cfg, TransferWithCacheKeyConfig):
        key = cfg.cache_key
        if chunks is not None and not isinstance(key, BlocksCacheKey):
            raise param_invalid(f"{arg}.cache_key", "a cache pushed into blocks needs a BlocksCacheKey")
        if chunks is None and blocks != isinstance(key, BlocksCacheKey):
            raise param_invalid(f"{arg}.cache_key", "a blocks cache needs a BlocksCacheKey and a contiguous "
                                "cache a CacheKeyByIdAndIndex (blocks to cache is not supported)")
        dst_layers = cfg.dst_layer_range if cfg.dst_layer_range is not None else src_layers
        if len(dst_layers) != len(src_layers):
            raise param_invalid(f"{arg}.dst_layer_range", f"covers {len(dst_layers)} layers, "
                                f"src_layer_range {len(src_layers)}")
        link = links.get(key.cluster_id)
        target = target_fields(key)
        # by key, the destination's rows must be the bytes sent (EXACT), as LLM-DataDist checks
        if chunks is not None:
            pieces = _chunk_pieces(src_rows[0], chunks, ReqFlag.BLOCKS | ReqFlag.EXACT, 0)
        else:
            pieces = [_Piece(src_rows, lay.row_bytes, dst_rows, lay.row_bytes,
                             (ReqFlag.BLOCKS if blocks else ReqFlag.CONTIG) | ReqFlag.EXACT)]
        for src_layer, dst_layer in zip(src_layers, dst_layers, strict=True):
            plans[src_layer] = [build_plan(src, (src_layer, src_layer), (dst_layer, dst_layer), TENSORS_PER_LAYER,
                                           p.local_rows, p.local_nbytes, p.remote_rows, p.remote_nbytes, p.flags,
                                           target, "src", local_offset=p.local_offset) for p in pieces]
    else:
        addrs = cfg.dst_addrs
        if len(addrs) != TENSORS_PER_LAYER * len(src_layers):
            raise param_invalid(f"{arg}.dst_addrs", f"needs {TENSORS_PER_LAYER} addresses per layer "
                                f"({TENSORS_PER_LAYER * len(src_layers)}), got {len(addrs)}")
        link = links.get(cfg.dst_cluster_id)
        target = addrs_target(cfg.dst_cluster_id)
        if chunks is not None:
            pieces = _chunk_pieces(src_rows[0], chunks, ReqFlag.BLOCKS, chunks.size)
        else:
            stride = dst_block_bytes if dst_block_bytes is not None else lay.row_bytes
            pieces = [_Piece(src_rows, lay.row_bytes, dst_rows, lay.row_bytes, ReqFlag.BLOCKS if blocks else 0,
                             remote_offset=stride if blocks else 0)]
        for i, src_layer in enumerate(src_layers):
            pair = list(addrs[TENSORS_PER_LAYER * i:TENSORS_PER_LAYER * (i + 1)])
            plans[src_layer] = [build_plan(src, (src_layer, src_layer), (-1, -1), TENSORS_PER_LAYER, p.local_rows,
                                           p.local_nbytes, pair + p.remote_rows, p.remote_nbytes, p.flags, target,
                                           "src", remote_offset=p.remote_offset, local_offset=p.local_offset)
                                for p in pieces]
    names = {"dst_cache_key": f"{arg}.cache_key", "dst_layer_range": f"{arg}.dst_layer_range",
             "dst_addrs": f"{arg}.dst_addrs", "dst_blocks": "dst_block_indices"}
    return _Config(index, link, src_layers, plans, names)


def _row(arg: str, value: Any, rows: int) -> int:
    return check_indices(arg, [value], rows, what="batch index")[0]


def start_transfer(rt: Runtime, links: Any, src: KvCache, synchronizer: Any, configs: Sequence[Any],
                   src_block_indices: Any, dst_block_indices: Any, dst_block_memory_size: Any, *,
                   cache_to_blocks: bool = False, hold: Callable[[], Callable[[], None]] | None = None) -> CacheTask:
    """Validate everything, then start the driver; returns its :class:`CacheTask`.

    ``hold``: called once the transfer starts; what it returns is called once it ended (the endpoint's
    ``Owners.hold``: a transfer the caller need not wait for keeps its endpoint).

    ``cache_to_blocks``: whether a contiguous source may go into destination blocks (``dst_block_indices``
    with ``dst_block_memory_size``), as LLM-DataDist's CacheManager allows and its KvCacheManager refuses.
    """
    if isinstance(synchronizer, type):  # its synchronize_layer would be an unbound function, failing each layer
        raise param_type_error("layer_synchronizer", f"expected a LayerSynchronizer instance, got the class "
                               f"{synchronizer.__name__} itself")
    if not isinstance(synchronizer, LayerSynchronizer) and not callable(
            getattr(synchronizer, "synchronize_layer", None)):
        raise param_type_error("layer_synchronizer", f"expected a LayerSynchronizer, got {type(synchronizer).__name__}")
    if not isinstance(configs, (list, tuple)):
        raise param_type_error("transfer_configs", f"expected a list of TransferConfig or TransferWithCacheKeyConfig, "
                               f"got {type(configs).__name__}")
    if src.cache_desc.num_tensors % TENSORS_PER_LAYER:
        raise param_invalid("src_cache", f"num_tensors {src.cache_desc.num_tensors} is not K,V pairs of layers")
    # Checked before any test of its value: an array has no truth value, and False or 0.0 are not "unset".
    block_size = None if dst_block_memory_size is None else check_uint("dst_block_memory_size", dst_block_memory_size)
    src_blocks: tuple[int, ...] | None = None
    dst_blocks: tuple[int, ...] | None = None
    dst_block_bytes = None
    chunks = None
    if cache_to_blocks and not src.is_blocks_cache and _no_blocks(src_block_indices) and not _no_blocks(
            dst_block_indices):
        chunks = _row_chunks(src, dst_block_indices, block_size)
    elif src.is_blocks_cache and _no_blocks(src_block_indices) and _no_blocks(dst_block_indices):
        # As LLM-DataDist: a blocks source without block indices goes as a contiguous cache whose rows
        # are its blocks, row 0 to row 0 (block 0 of every tensor of the layer; the C++ layer-wise job
        # copies one row when no block lists are given).
        if block_size:
            raise param_invalid("dst_block_memory_size", "needs block indices")
        src_blocks = dst_blocks = (0,)
    elif src.is_blocks_cache:
        src_blocks = check_indices("src_block_indices", src_block_indices if src_block_indices is not None else (),
                                   src.layout.rows, what="block index", allow_empty=False)
        dst_blocks = check_indices("dst_block_indices", dst_block_indices if dst_block_indices is not None else (),
                                   2**63, what="block index", allow_empty=False)
        if len(src_blocks) != len(dst_blocks):
            raise param_invalid("dst_block_indices", f"has {len(dst_blocks)} blocks, "
                                f"src_block_indices {len(src_blocks)}")
        if len(set(dst_blocks)) != len(dst_blocks):
            raise param_invalid("dst_block_indices", "a block is named twice")
        if block_size is not None:
            if block_size >= 2**62:
                raise param_invalid("dst_block_memory_size", f"{block_size} bytes is more than any block")
            if block_size < src.layout.row_bytes:
                raise param_invalid("dst_block_memory_size", f"{block_size} is smaller than a source "
                                    f"block ({src.layout.row_bytes} bytes)")
        dst_block_bytes = block_size
    elif src_block_indices is not None and not (cache_to_blocks and _no_blocks(src_block_indices)):
        raise param_invalid("src_block_indices", "block indices need a blocks cache")
    elif dst_block_indices is not None and not (cache_to_blocks and _no_blocks(dst_block_indices)):
        raise param_invalid("dst_block_indices", "a contiguous cache goes into blocks only through the "
                            "CacheManager (LLM-DataDist's KvCacheManager refuses it too)")
    elif block_size:
        raise param_invalid("dst_block_memory_size", "is for blocks destinations; the source is a contiguous cache")
    planned = [_plan_config(links, i, cfg, src, src_blocks, dst_blocks, dst_block_bytes, chunks)
               for i, cfg in enumerate(configs)]
    layers = sorted({layer for cfg in planned for layer in cfg.src_layers})
    # A synchronizer that says how many layers it can be asked for (``num_layers``, an int: EventLayerSynchronizer)
    # and is short of the transfer's is a bad argument now, not a failure found at its first missing layer once
    # the layers before it went.
    # Not part of LayerSynchronizer (LLM-DataDist never reads it): one that cannot be read sets no bound, as
    # there (a property of the caller's that raised made the call raise it, found by a hunt).
    try:
        bound = getattr(synchronizer, "num_layers", None)
    except Exception:  # whatever the caller's property raises
        bound = None
    if type(bound) is int and layers and layers[-1] >= bound:
        raise param_invalid("layer_synchronizer", f"a synchronizer of {bound} layers cannot synchronize layer "
                            f"{layers[-1]} of this transfer")
    progress = TaskProgress(layers, len(planned))
    return CacheTask(progress, _drive(rt, progress, src, synchronizer, planned, layers),
                     on_end=None if hold is None else hold())


def _row_chunks(src: KvCache, dst_block_indices: Any, size: int | None) -> _Chunks:
    """Check a contiguous source's destination blocks; LLM-DataDist's rules, bounded to one source row."""
    blocks = check_indices("dst_block_indices", dst_block_indices, 2**63, what="block index", allow_empty=False)
    if len(set(blocks)) != len(blocks):
        raise param_invalid("dst_block_indices", "a block is named twice")
    if size is None:
        raise param_invalid("dst_block_memory_size", "must be set to push a contiguous cache into blocks")
    row_bytes = src.layout.row_bytes
    if not 0 < size <= row_bytes:
        raise param_invalid("dst_block_memory_size", f"{size} must be > 0 and at most a source row "
                            f"({row_bytes} bytes) to split the row into blocks")
    pieces = -(-row_bytes // size)
    if len(blocks) > pieces:
        raise param_invalid("dst_block_indices", f"{len(blocks)} blocks of {size} bytes; a source row of "
                            f"{row_bytes} bytes fills at most {pieces}")
    full = min(len(blocks), row_bytes // size)
    return _Chunks(blocks, size, full, row_bytes - full * size if len(blocks) > full else 0)


def _no_blocks(indices: Any) -> bool:
    """Whether block indices are absent (None or empty), which LLM-DataDist treats alike."""
    if indices is None:
        return True
    try:
        return len(indices) == 0
    except TypeError:  # no length (a number, a 0-d array): not absent, and its own check names it
        return False


class _SyncThread:
    """The thread a task's plain (blocking) synchronizer waits in, made at its first layer: one per task, as
    LLM-DataDist gives each task its own. The loop's default executor is shared: with as many tasks waiting
    for their prefill as it has threads (6 on two cores), a task whose layers were ready was not even asked.
    A daemon thread, unlike an executor's: a synchronizer still waiting for a layer never computed does not
    hold up the interpreter's exit (an executor's threads are joined before the atexit hooks that would end
    the transfer run)."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue | None = None

    async def call(self, method: Callable[[int, None], Any], layer: int) -> Any:
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        if self._calls is None:
            self._calls = queue.SimpleQueue()
            threading.Thread(target=_serve_synchronizer, args=(self._calls,), daemon=True,
                             name="aio_datadist-synchronizer").start()
        self._calls.put((method, layer, loop, answer))
        return await answer

    def close(self) -> None:
        """Let the thread go once the synchronizer it may still wait in returns (never waited for here)."""
        if self._calls is not None:
            self._calls.put(None)


def _serve_synchronizer(calls: queue.SimpleQueue) -> None:
    while (call := calls.get()) is not None:
        method, layer, loop, answer = call
        try:
            outcome: tuple[bool, Any] = (True, method(layer, None))
        except StopIteration as exc:  # no future takes it (asyncio's rule): as a coroutine's would, it becomes
            wrapped = RuntimeError(f"synchronize_layer raised StopIteration at layer {layer}")  # a RuntimeError
            wrapped.__cause__ = exc
            outcome = (False, wrapped)
        except BaseException as exc:  # the task's to see, as an exception out of an executor would be
            outcome = (False, exc)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
            loop.call_soon_threadsafe(_answer, answer, outcome)


def _answer(answer: asyncio.Future, outcome: tuple[bool, Any]) -> None:
    if answer.done():  # the task was cancelled meanwhile
        return
    ok, value = outcome
    if ok:
        answer.set_result(value)
    else:
        answer.set_exception(value)


async def _synchronize(synchronizer: Any, layer: int, thread: _SyncThread) -> bool:
    # LLM-DataDist passes None for timeout_in_millis ("not supported yet"); a synchronizer bounds its own wait.
    method = synchronizer.synchronize_layer
    if inspect.iscoroutinefunction(method):
        result = await method(layer, None)
    else:
        result = await thread.call(method, layer)
        if inspect.isawaitable(result):
            result = await result
    return bool(result)


async def _drive(rt: Runtime, progress: TaskProgress, src: KvCache, synchronizer: Any,
                 configs: list[_Config], layers: list[int]) -> None:
    timeout_ms = rt.default_timeout_ms()
    failed: set[int] = set()
    pushes: list[asyncio.Future] = []
    previous: asyncio.Future | None = None
    stop: LLMException | None = None
    stop_layer = -1
    layer = -1
    driver = asyncio.current_task()
    syncing = abandoned = False
    started: set[int] = set()  # configs a push of which began

    def nothing_left() -> bool:
        return not any(cfg.index not in failed and cfg.src_layers.stop > layer for cfg in configs)

    running: dict[int, dict[asyncio.Future, int]] = {}  # per config, its layer pushes not yet over, and their layer
    cut: dict[asyncio.Future, int | None] = {}  # pushes cancelled because their destination failed: at which layer

    def on_failure(index: int, at: int | None) -> None:
        # A failed destination takes no more layers: its pushes of later layers still queued or running stop
        # (each returns once nothing of it can land), not one after the other at their own time-outs. Those of
        # earlier layers go on to their confirmation: their bytes may be in place already (the layers before a
        # refused one stay in place); the task ends only once they did.
        me = asyncio.current_task()  # the push that failed, when one did: it ends by itself
        for other, other_layer in running.get(index, {}).items():
            if other is not me and not other.done() and other not in cut and (at is None or other_layer > at):
                cut[other] = at
                other.cancel()
        # Every destination of the layers to come failed: stop waiting for the synchronizer
        # (the way asyncio.timeout interrupts an await: cancel, then uncancel).
        nonlocal abandoned
        if syncing and not abandoned and nothing_left():
            abandoned = True
            driver.cancel()  # type: ignore[union-attr]

    # Per config, its layer pushes not yet confirmed; a config with none left has every layer in place, and a
    # link lost afterwards (the destination took what it needed and unlinked) does not make it a failure while
    # a slower destination holds up the layer's confirmation.
    unconfirmed = {cfg.index: len(cfg.plans) for cfg in configs}
    delivered: set[int] = set()

    def lose(index: int, exc: LLMException) -> None:
        failed.add(index)
        progress.set_result(index, exc.status_code, exc)
        on_failure(index, None)

    # A destination whose link ended while pushes to it were in flight: decided when they end (a push in
    # flight ends by itself with the link, its answer failed by the link's end, and says how; one whose DONE
    # came in the pass the link ended is a success, which cutting it here would make a failure). If they all
    # succeed and layers remain for it, it fails then.
    lost_links: dict[int, LLMException] = {}

    def confirmed(index: int, push: asyncio.Future) -> None:
        if not push.cancelled() and push.exception() is None and push.result() is None:
            unconfirmed[index] -= 1
            if not unconfirmed[index]:
                delivered.add(index)
        if index in lost_links and not running.get(index):
            exc = lost_links.pop(index)
            if index not in delivered and index not in failed and progress.result(index) is None:
                lose(index, exc)

    def on_link_lost(link: Link, exc: LLMException) -> None:
        for cfg in configs:
            if (cfg.link is link and cfg.index not in failed and cfg.index not in delivered
                    and progress.result(cfg.index) is None):
                if running.get(cfg.index):
                    lost_links[cfg.index] = exc
                else:
                    lose(cfg.index, exc)

    watches = _watch_links(configs, on_link_lost)
    sync_thread = _SyncThread()
    try:
        for layer in layers:
            if nothing_left():
                break
            syncing = True
            try:
                ok = await _synchronize(synchronizer, layer, sync_thread)
            except asyncio.CancelledError as exc:
                if abandoned and driver.uncancel() == 0:  # type: ignore[union-attr]
                    break
                if abandoned or driver.cancelling():  # type: ignore[union-attr]
                    raise
                # Nobody cancelled the task: the synchronizer raised a CancelledError of its own.
                stop = LLMException(f"layer_synchronizer raised at layer {layer}: {exc!r}",
                                    status_code=LLMStatusCode.LLM_FAILED)
                stop.__cause__ = exc
            except BaseException as exc:  # KeyboardInterrupt, SystemExit too: out of a task they would stop the loop
                if driver.cancelling():  # type: ignore[union-attr]
                    # The synchronizer turned the cancellation it was interrupted by into an error of its own.
                    if abandoned and driver.uncancel() == 0:  # type: ignore[union-attr]
                        break
                    raise asyncio.CancelledError(
                        f"cancelled while layer_synchronizer waited for layer {layer}") from exc
                stop = LLMException(f"layer_synchronizer raised at layer {layer}: {exc!r}",
                                    status_code=LLMStatusCode.LLM_FAILED)
                stop.__cause__ = exc
            else:
                if driver.cancelling():  # type: ignore[union-attr]
                    # The synchronizer swallowed the cancellation it was interrupted by.
                    if abandoned and driver.uncancel() == 0:  # type: ignore[union-attr]
                        break
                    raise asyncio.CancelledError(f"cancelled while layer_synchronizer waited for layer {layer}")
                if not ok:
                    stop = LLMException(f"layer_synchronizer returned False at layer {layer}",
                                        status_code=LLMStatusCode.LLM_PARAM_INVALID)
            finally:
                syncing = False
            if stop is not None:
                stop_layer = layer
                break
            layer_pushes = []
            lost = None
            for cfg in configs:
                if layer not in cfg.plans:
                    continue
                if cfg.index in failed:
                    lost = LLMException(f"destination {cfg.index} failed before layer {layer}",
                                        status_code=progress.result(cfg.index) or LLMStatusCode.LLM_FAILED)
                    continue
                started.add(cfg.index)
                push = asyncio.ensure_future(_push(rt, progress, src, cfg, layer, failed, on_failure, timeout_ms,
                                                   queue_ms=timeout_ms * len(layers), cut=cut))
                mine = running.setdefault(cfg.index, {})
                mine[push] = layer
                push.add_done_callback(functools.partial(_forget, mine))
                push.add_done_callback(functools.partial(confirmed, cfg.index))
                pushes.append(push)
                layer_pushes.append((cfg.index, push))
            finishing = [cfg.index for cfg in configs if cfg.src_layers.stop - 1 == layer]
            previous = asyncio.ensure_future(_confirm(progress, layer, layer_pushes, previous, lost, finishing, failed))
            pushes.append(previous)
        if pushes:
            # A push cut before its first step (its destination failed) ends cancelled: not an error here. A
            # push's failure is its result (recorded in ``progress``, raised by the task's await); only what a
            # push or a confirmation raised is a bug to pass on.
            await asyncio.gather(*pushes, return_exceptions=True)
            for ended in pushes:
                raised = None if ended.cancelled() else ended.exception()
                if raised is not None:
                    raise raised
    except BaseException:  # cancelled, or a bug a push or confirmation raised
        for index in started - failed:  # cut part-way: not "never started" (None)
            if progress.result(index) is None:
                progress.set_result(index, LLMStatusCode.LLM_FAILED)
        raise
    finally:
        sync_thread.close()
        for watch in watches:
            watch.cancel()
        for going in pushes:
            going.cancel()
        if pushes:
            # Every push returns only once nothing of it can land (run_push's give-up is bounded);
            # the task must not end before, even when it is cancelled again meanwhile.
            await _all_over(pushes)
    for cfg in configs:
        if cfg.index in failed:
            continue
        if stop is not None and cfg.src_layers.stop - 1 >= stop_layer:
            if cfg.src_layers.start <= stop_layer:  # configs not started yet stay None
                progress.set_result(cfg.index, stop.status_code)
        else:
            progress.set_result(cfg.index, LLMStatusCode.LLM_SUCCESS)
    if stop is not None:
        if not failed:
            raise stop
        # A destination failed first: ``await task`` says that failure, with every result; the layers the
        # synchronizer stopped say the stop.
        for layer in layers[layers.index(stop_layer):]:
            progress.layer_done(layer, stop)


def _forget(running: dict[asyncio.Future, int], push: asyncio.Future) -> None:
    running.pop(push, None)


async def _all_over(pushes: list[asyncio.Future]) -> None:
    """Wait for every push to end, through cancellations (re-raised once all ended); each push's
    give-up is bounded, ``PUSHES_END_S`` only guards against a bug there."""
    await settle(asyncio.gather(*pushes, return_exceptions=True), PUSHES_END_S)


async def _push(rt: Runtime, progress: TaskProgress, src: KvCache, cfg: _Config, layer: int, failed: set[int],
                on_failure: Callable[[int, int | None], None], timeout_ms: int, *, queue_ms: int,
                cut: dict[asyncio.Future, int | None]) -> LLMException | None:
    """Push one layer to one destination. Its time-out counts from when it has a data channel: the
    layers released at once queue for the link's channels behind the earlier ones (``queue_ms`` bounds
    that wait: the whole transfer's share)."""
    what = f"transfer_cache_async layer {layer}"

    def cut_for() -> LLMStatusCode | None:
        # Cut because the destination failed: the caller cancelled nothing, the push failed as the destination did.
        if asyncio.current_task() not in cut:
            return None
        return progress.result(cfg.index) or LLMStatusCode.LLM_FAILED

    try:
        for plan in cfg.plans[layer]:
            if not src.alive:  # released (deallocated, unregistered) after the call: its memory is not ours
                raise LLMException(f"{what}: the source cache {src.cache_id} was released during the transfer",
                                   status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
            await run_push(rt, cfg.link, plan, timeout_ms, what, queue_ms=queue_ms, cut=cut_for, names=cfg.names)
        return None
    except LLMException as exc:
        failed.add(cfg.index)
        progress.set_result(cfg.index, exc.status_code, exc)
        on_failure(cfg.index, layer)
        return exc
    except asyncio.CancelledError:
        me = asyncio.current_task()
        if me not in cut:
            raise
        at = cut.pop(me)
        me.uncancel()
        return LLMException(f"{what}: cut, destination {cfg.index} failed" + ("" if at is None else f" at layer {at}"),
                            status_code=progress.result(cfg.index) or LLMStatusCode.LLM_FAILED)


def _watch_links(configs: list[_Config], on_lost: Callable[[Link, LLMException], None]
                 ) -> list[asyncio.Future]:
    """Learn of a destination's link failing while no push to it is in flight (``Link.watch``: a future
    only the link's end completes, which no reply of the peer's can reach)."""
    watches = []
    for link in {id(cfg.link): cfg.link for cfg in configs}.values():
        watch = link.watch()

        def done(f: asyncio.Future, link: Link = link) -> None:
            exc = None if f.cancelled() else f.exception()
            if isinstance(exc, LLMException):
                on_lost(link, exc)

        watch.add_done_callback(done)
        watches.append(watch)
    return watches


async def _confirm(progress: TaskProgress, layer: int, layer_pushes: Sequence[tuple[int, asyncio.Future]],
                   previous: asyncio.Future | None, lost: LLMException | None,
                   finishing: list[int], failed: set[int]) -> None:
    outcomes = await asyncio.gather(*(push for _, push in layer_pushes), return_exceptions=True)
    if previous is not None:
        await asyncio.shield(previous)
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(outcome, (asyncio.CancelledError, LLMException)):
            raise outcome
    # A push cut before its first step ends cancelled: its destination failed meanwhile (another layer's push
    # to it), and the layer fails with that destination's code, as a layer not started for it does (``lost``).
    error = next((e if isinstance(e, LLMException) else LLMException(
        f"destination {index} failed before layer {layer} was sent",
        status_code=progress.result(index) or LLMStatusCode.LLM_FAILED)
                  for (index, _), e in zip(layer_pushes, outcomes, strict=True) if e is not None), lost)
    for index in finishing:  # every layer of these configs is confirmed in place
        if index not in failed:
            progress.set_result(index, LLMStatusCode.LLM_SUCCESS)
    progress.layer_done(layer, error)
