"""CacheTask: the handle of a layer-wise transfer, with one future per layer.

The driver (``layerwise.py``) reports into a :class:`TaskProgress`; the
:class:`CacheTask` the caller holds reads it and runs the driver.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Generator
from typing import Any

from aio_datadist._checks import check_int, check_uint, param_invalid
from aio_datadist._forks import forks
from aio_datadist.endpoint import home_loop
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.views import Views, fail_quietly

__all__ = ["CacheTask", "TaskProgress"]


class TaskProgress:
    """What a layer-wise driver reports: one result per config, one future per layer."""

    def __init__(self, layers: list[int], num_configs: int) -> None:
        loop = asyncio.get_running_loop()
        self.layers = {layer: loop.create_future() for layer in layers}
        self.results: list[LLMStatusCode | None] = [None] * num_configs
        self.error: LLMException | None = None

    def result(self, index: int) -> LLMStatusCode | None:
        """Config ``index``'s result so far (None: none yet)."""
        return self.results[index]

    def set_result(self, index: int, code: LLMStatusCode, error: LLMException | None = None) -> None:
        """Record config ``index``'s outcome; a failure is kept over a later success."""
        if self.results[index] in (None, LLMStatusCode.LLM_SUCCESS):
            self.results[index] = code
            if error is not None and self.error is None:
                self.error = error

    def layer_done(self, layer: int, exc: BaseException | None) -> None:
        """Complete layer ``layer``'s future (with ``exc`` if it failed); later calls do nothing."""
        fut = self.layers[layer]
        if fut.done():
            return
        if exc is None:
            fut.set_result(None)
        else:
            fail_quietly(fut, exc)

    def first_failure(self) -> LLMStatusCode:
        for code in self.results:
            if code is not None and code != LLMStatusCode.LLM_SUCCESS:
                return code
        return LLMStatusCode.LLM_FAILED


class CacheTask:
    """A running ``transfer_cache_async``.

    * ``await task`` returns the per-config status list, or raises
      :class:`LLMException` with the first failure's code; cancelling the
      awaiting coroutine cancels the transfer.
    * ``await task.layer(i)`` completes once layer ``i`` is confirmed in place
      at every destination; layer futures complete in layer order.
    * ``await task.synchronize(ms)`` / ``await task.get_results(ms)`` wait
      without cancelling anything; on time-out the transfer keeps going.
    * ``task.cancel()`` stops the layers not yet sent and tells the peers.

    Wait on it from the loop it was made on (the endpoint's): from another
    loop, waiting for a task still running (or for a pending layer's
    future) raises ``LLM_FAILED``; a task that ended, and a layer that did,
    answer from any loop.
    """

    def __init__(self, progress: TaskProgress, driver: Coroutine[Any, Any, None],
                 on_end: Callable[[], None] | None = None) -> None:
        """Run ``driver``, which reports into ``progress`` (``layerwise.start_transfer`` makes both); ``on_end``
        is called once it ended, however."""
        #: What ``synchronize`` and ``get_results`` report for a transfer still running at their time-out, and
        #: for a config whose transfer timed out: ``LLM_WAIT_PROCESS_TIMEOUT`` for ``KvCacheManager`` (v1),
        #: ``LLM_TIMEOUT`` for ``CacheManager`` (v2), as LLM-DataDist's own task does.
        self.timeout_code = LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT
        self._progress = progress
        self._task = asyncio.get_running_loop().create_task(driver)
        self._task.add_done_callback(self._finished)
        if on_end is not None:
            self._task.add_done_callback(lambda _task: on_end())
        self._made_by = forks()  # a forked child has no thread running this task's loop
        self._views = Views()  # what layer() handed out

    def _require_own(self) -> None:
        """``LLM_FAILED`` in a process forked after the task was made: its transfer is the parent's."""
        if forks() != self._made_by:
            raise LLMException("this CacheTask belongs to the parent process (it was made before this process "
                               "was forked); its transfer runs there", status_code=LLMStatusCode.LLM_FAILED)

    def _finished(self, task: asyncio.Task) -> None:
        if task.cancelled():
            exc: BaseException = asyncio.CancelledError()
        else:
            exc = task.exception() or LLMException("the transfer stopped before this layer",
                                                   status_code=self._progress.first_failure())
        for fut in self._progress.layers.values():
            if fut.done():
                continue
            if isinstance(exc, asyncio.CancelledError):
                fut.cancel()
            else:
                fail_quietly(fut, exc)

    # -- public ------------------------------------------------------------

    def layer(self, index: int) -> asyncio.Future:
        """Future of layer ``index`` (a source layer index of the transfer).

        Awaiting it, or cancelling it, never cancels the transfer. Polling it
        (``task.layer(i).done()``) keeps nothing: a pending layer's future is
        held only while something waits on it, as ``PushWatch.layer``'s.
        """
        self._require_own()
        index = check_int("index", index)
        layers = self._progress.layers
        if index not in layers:
            raise param_invalid("index", f"layer {index} is not part of this transfer " + (
                f"(layers {min(layers)}..{max(layers)})" if layers else "(it moves no layer: no configs)"))
        return self._views.view(index, layers[index])

    def done(self) -> bool:
        """Whether the transfer has ended (successfully or not)."""
        return self._task.done()

    def cancel(self) -> None:
        """Stop layers not yet sent and abort those in flight; idempotent."""
        self._require_own()
        self._task.cancel()

    def cancel_threadsafe(self) -> None:
        """:meth:`cancel` from any thread (a signal handler's included): handed to the task's own loop, with no
        lock taken; nothing to do once that loop is closed (the task ended with it)."""
        self._require_own()
        loop = self._task.get_loop()
        if loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # closed in the instant since
            loop.call_soon_threadsafe(self._task.cancel)

    def __await__(self) -> Generator[Any, None, list[LLMStatusCode]]:
        return self._wait().__await__()

    def _on_its_loop(self) -> None:
        """Refuse (``LLM_FAILED``) a wait from another loop than the task's unless the task is over: that loop
        would not be woken when the task ends (a wait with a time-out would always run it out)."""
        if not self._task.done():
            home_loop("waiting for a CacheTask", self._task.get_loop())

    async def _wait(self) -> list[LLMStatusCode]:
        self._require_own()
        self._on_its_loop()
        await self._task
        # The codes synchronize and get_results give (a v1 time-out read as LLM_WAIT_PROCESS_TIMEOUT), so that
        # ``await task`` raises what they say; the argument is the failure's as it was raised.
        raw, error = self._progress.results, self._progress.error
        results = self._codes()
        first = next((i for i, c in enumerate(raw) if c not in (None, LLMStatusCode.LLM_SUCCESS)), None)
        if first is not None:
            failure = results[first]
            assert failure is not None  # (raw[first] is not None, and _codes maps codes to codes)
            detail = f": {error.args[0]}" if error is not None and error.args else ""
            argument = error.argument if error is not None and error.status_code == raw[first] else None
            raise LLMException(f"transfer_cache_async failed, results {[str(c) for c in results]}{detail}",
                               status_code=failure, argument=argument) from error
        return [LLMStatusCode.LLM_SUCCESS if c is None else c for c in results]

    async def _settle(self, timeout_in_millis: int | None) -> bool:
        self._require_own()
        timeout = None
        if timeout_in_millis is not None:
            timeout = check_uint("timeout_in_millis", timeout_in_millis, 32) / 1000
        if self._task.done():
            return True
        self._on_its_loop()
        done, _ = await asyncio.wait([self._task], timeout=timeout)
        return bool(done)

    async def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """Wait for the end of the transfer; its first failure or ``LLM_SUCCESS``.

        :returns: :attr:`timeout_code` (``LLM_WAIT_PROCESS_TIMEOUT`` in v1,
            ``LLM_TIMEOUT`` in v2) if it is still running after
            ``timeout_in_millis`` (a uint32; None waits for ever); the
            transfer goes on.
        """
        if not await self._settle(timeout_in_millis):
            return self.timeout_code
        if self._task.cancelled():
            return LLMStatusCode.LLM_FAILED
        failure = next((c for c in self._codes() if c not in (None, LLMStatusCode.LLM_SUCCESS)), None)
        if failure is None and self._task.exception() is not None:  # ended by a bug: not a success
            return LLMStatusCode.LLM_FAILED
        return LLMStatusCode.LLM_SUCCESS if failure is None else failure

    async def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """Per-config results: a code, or None for a config never started.

        Waits up to ``timeout_in_millis`` for the end (None: for ever). A
        transfer still running then gets :attr:`timeout_code` for every
        config, as LLM-DataDist's task answers (``await task.layer(i)`` tells
        which layers are in place); the transfer goes on.
        """
        if not await self._settle(timeout_in_millis):
            return [self.timeout_code] * len(self._progress.results)
        return self._codes()

    def _codes(self) -> list[LLMStatusCode | None]:
        """The per-config results, a transfer's time-out read as :attr:`timeout_code` (reference 2.4: a v1
        ``transfer_cache_async`` time-out yields ``LLM_WAIT_PROCESS_TIMEOUT``)."""
        timeout = self.timeout_code
        return [timeout if c is LLMStatusCode.LLM_TIMEOUT else c for c in self._progress.results]
