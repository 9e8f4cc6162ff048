"""Layer synchronizers shipped with the library.

:class:`EventLayerSynchronizer` lets prefill code mark each layer finished
with :meth:`~EventLayerSynchronizer.record` (from any thread); the layer-wise
transfer waits for that mark through the core's completion fd, so no thread
blocks on it (on CUDA the notifier's event watcher polls briefly, see
docs/devices.md). On the CPU a record is immediate (the layer's
compute has returned when ``record`` is called). With a device backend,
``record(i, stream=s)`` enqueues the mark on stream ``s`` through the core's
StreamNotifier: layer ``i`` starts once ``s`` has finished the work enqueued
on it so far, and no thread synchronizes with the device.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import TYPE_CHECKING, Any

from aio_datadist._checks import check_index, check_int, param_invalid
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.types import LayerSynchronizer
from aio_datadist.views import mark_retrieved

if TYPE_CHECKING:
    from aio_datadist.datadist import LLMDataDist

__all__ = ["EventLayerSynchronizer"]

_DEFAULT = object()


class EventLayerSynchronizer(LayerSynchronizer):
    """One completion per layer, recorded by the prefill code.

    :param datadist: the initialised endpoint whose core carries the records.
    :param num_layers: how many layers will be recorded.
    :param timeout_ms: how long :meth:`synchronize_layer` waits for a layer
        when the transfer passes no timeout (LLM-DataDist passes None):
        default the endpoint's ``sync_kv_timeout``; None waits until the layer
        is recorded or the synchronizer closed.

    Create it on the event loop the endpoint was initialised on (elsewhere,
    or with no running loop: ``LLM_FAILED``), one per transfer (a layer is
    recorded once); close it (or use ``with``) to release layers that were
    never recorded: a transfer waiting for one of them then stops as if the
    synchronizer had returned False.
    """

    def __init__(self, datadist: LLMDataDist, num_layers: int, *, timeout_ms: Any = _DEFAULT) -> None:
        home_loop = getattr(getattr(datadist, "_endpoint", None), "home_loop", None)
        runtime = getattr(datadist, "_require_runtime", None)
        if home_loop is None or runtime is None:  # (datadist is above this module: no import to check it by)
            raise param_invalid("datadist", f"expected an aio_datadist.LLMDataDist (the async endpoint), got "
                                f"{type(datadist).__module__}.{type(datadist).__qualname__}")
        # its layers' futures live on the running loop, which must be the one of the transfers that await them
        home_loop("an EventLayerSynchronizer")
        rt = runtime()
        num_layers = check_int("num_layers", num_layers, lo=1, hi=1 << 16)
        if timeout_ms is _DEFAULT:
            timeout_ms = rt.default_timeout_ms()
        elif timeout_ms is not None:
            timeout_ms = check_int("timeout_ms", timeout_ms, lo=1, hi=2**31 - 1)
        self._timeout_ms: int | None = timeout_ms
        self._completions = rt.completions
        self._queue = rt.queue
        self._devices = rt.devices
        self._layers = rt.completions.expect(num_layers, "layer event")
        for _, layer in self._layers:
            # A layer nobody waits for (its transfer cancelled, or no transfer at all) fails as the endpoint
            # finalizes: read here, not logged by asyncio as an error never retrieved (found by a hunt).
            layer.add_done_callback(mark_retrieved)
        self._recorded: set[int] = set()  # layers whose record is posted or armed: close() leaves them be
        self._lock = threading.Lock()  # record() (any thread) against close(): a record that returned is kept
        self._closed = False
        # Dropped without close() (its transfer over: the transfer holds it while it runs), its layers never
        # recorded are released as close() would: else each stayed in the endpoint's completions until finalize.
        self._release = weakref.finalize(self, _release_unrecorded, self._completions, self._layers, self._recorded)
        self._release.atexit = False  # (at exit the endpoint goes, and its completions with it)

    @property
    def num_layers(self) -> int:
        """How many layers it synchronizes (``0 .. num_layers - 1``)."""
        return len(self._layers)

    def record(self, layer_index: int, stream: Any = None) -> None:
        """Mark layer ``layer_index`` computed. Safe from any thread.

        :param stream: a stream of the endpoint's device backend (a
            ``torch.cuda.Stream``, an NPU stream, or a host backend stream)
            whose work enqueued so far must finish before the layer is
            transferred; None: the layer is ready now.
        :raises LLMException: ``LLM_FEATURE_NOT_ENABLED`` for a stream on an
            endpoint without a device backend; ``LLM_ENGINE_FINALIZED`` once
            the endpoint was finalized; ``LLM_PARAM_INVALID`` for a
            stream of another kind, one being captured into a CUDA graph, or
            a layer recorded twice on a stream.
        """
        index = check_index("layer_index", layer_index, len(self._layers), what="layer")
        if stream is not None and self._devices is None:
            raise LLMException("argument 'stream': this endpoint has no device backend (aio.DeviceType cpu); "
                               "record on the CPU (stream=None)", status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        with self._lock:  # counted as recorded before it is posted: a close() from now on leaves it be
            if self._closed:
                raise param_invalid("layer_index", "the synchronizer is closed")
            fresh = index not in self._recorded
            self._recorded.add(index)
        try:
            self._post(index, stream)
        except BaseException:
            if fresh:
                with self._lock:
                    self._recorded.discard(index)
            raise

    def _post(self, index: int, stream: Any) -> None:
        """Post layer ``index``'s record now (``stream`` None), or arm it on ``stream``."""
        token = self._layers[index][0]
        if stream is None:
            try:
                self._queue.post(token, 0, 0)
            except ValueError:  # the queue is closed: its endpoint was finalized
                raise LLMException("record: the endpoint of this synchronizer was finalized",
                                   status_code=LLMStatusCode.LLM_ENGINE_FINALIZED) from None
            return
        assert self._devices is not None
        if self._devices.closed:
            raise LLMException("record: the endpoint of this synchronizer was finalized",
                               status_code=LLMStatusCode.LLM_ENGINE_FINALIZED)
        try:
            self._devices.notify_on(token, stream)
        except ValueError as exc:  # the token is armed already, or the endpoint was finalized meanwhile
            if self._devices.closed:
                raise LLMException("record: the endpoint of this synchronizer was finalized",
                                   status_code=LLMStatusCode.LLM_ENGINE_FINALIZED) from None
            raise param_invalid("layer_index", f"layer {index} is already recorded on a stream") from exc

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None = None) -> bool:
        """Wait until ``layer_index`` was recorded.

        :returns: False after ``timeout_in_millis`` (None: the constructor's
            ``timeout_ms``; 0: at once), or once the synchronizer is closed
            without that layer recorded.
        :raises LLMException: ``LLM_PARAM_INVALID`` naming ``layer_index`` or
            ``timeout_in_millis`` (an int in ``[0, 2**31 - 1]``).
        """
        index = check_index("layer_index", layer_index, len(self._layers), what="layer")
        future = self._layers[index][1]
        wait_ms = self._timeout_ms if timeout_in_millis is None else check_int(
            "timeout_in_millis", timeout_in_millis, lo=0, hi=2**31 - 1)  # 0: whether it is recorded now
        if not future.done():
            # asyncio.wait neither raises for the future closing cancelled nor cancels it on time-out
            await asyncio.wait([future], timeout=None if wait_ms is None else wait_ms / 1000)
        return future.done() and not future.cancelled() and future.exception() is None

    def close(self) -> None:
        """Release every layer not recorded yet (a layer recorded already stays so). Idempotent. A synchronizer
        dropped without it is closed when it is collected."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            kept = set(self._recorded)
        self._release.detach()
        _release_unrecorded(self._completions, self._layers, kept)

    def __enter__(self) -> EventLayerSynchronizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _release_unrecorded(completions: Any, layers: list[tuple[int, asyncio.Future]], recorded: set[int]) -> None:
    """Stop waiting for the layers of ``layers`` not in ``recorded`` (their futures cancelled)."""
    for index, (token, _) in enumerate(layers):
        if index not in recorded:
            completions.forget(token)
