"""CacheTask: the handle of a layer-wise transfer, with one future per layer."""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

from aio_datadist.status import LLMException, LLMStatusCode, check_int, param_invalid

__all__ = ["CacheTask"]


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
    """

    def __init__(self, layers: list[int], num_configs: int) -> None:
        loop = asyncio.get_running_loop()
        self._layers = {layer: loop.create_future() for layer in layers}
        self._results: list[LLMStatusCode | None] = [None] * num_configs
        self._error: LLMException | None = None
        self._task: asyncio.Task | None = None

    def _start(self, coro: Any) -> None:
        self._task = asyncio.get_running_loop().create_task(coro)
        self._task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        if task.cancelled():
            exc: BaseException = asyncio.CancelledError()
        else:
            exc = task.exception() or LLMException("the transfer stopped before this layer",
                                                   status_code=self._first_failure())
        for fut in self._layers.values():
            if fut.done():
                continue
            if isinstance(exc, asyncio.CancelledError):
                fut.cancel()
            else:
                _fail_quietly(fut, exc)

    def _first_failure(self) -> LLMStatusCode:
        for code in self._results:
            if code is not None and code != LLMStatusCode.LLM_SUCCESS:
                return code
        return LLMStatusCode.LLM_FAILED

    # -- the driver reports through these ----------------------------------

    def _set_result(self, index: int, code: LLMStatusCode, error: LLMException | None = None) -> None:
        if self._results[index] in (None, LLMStatusCode.LLM_SUCCESS):
            self._results[index] = code
            if error is not None and self._error is None:
                self._error = error

    def _layer_done(self, layer: int, exc: BaseException | None) -> None:
        fut = self._layers[layer]
        if fut.done():
            return
        if exc is None:
            fut.set_result(None)
        else:
            _fail_quietly(fut, exc)

    # -- public ------------------------------------------------------------

    def layer(self, index: int) -> asyncio.Future:
        """Future of layer ``index`` (a source layer index of the transfer).

        Awaiting it never cancels the transfer.
        """
        index = check_int("index", index)
        if index not in self._layers:
            raise param_invalid("index", f"layer {index} is not part of this transfer "
                                f"(layers {min(self._layers)}..{max(self._layers)})")
        return _quiet(asyncio.shield(self._layers[index]))

    def done(self) -> bool:
        """Whether the transfer has ended (successfully or not)."""
        return self._task is not None and self._task.done()

    def cancel(self) -> None:
        """Stop layers not yet sent and abort those in flight; idempotent."""
        if self._task is not None:
            self._task.cancel()

    def __await__(self) -> Generator[Any, None, list[LLMStatusCode]]:
        return self._wait().__await__()

    async def _wait(self) -> list[LLMStatusCode]:
        assert self._task is not None
        await self._task
        failure = next((c for c in self._results if c not in (None, LLMStatusCode.LLM_SUCCESS)), None)
        if failure is not None:
            detail = f": {self._error.args[0]}" if self._error is not None and self._error.args else ""
            raise LLMException(f"transfer_cache_async failed, results {[str(c) for c in self._results]}{detail}",
                               status_code=failure) from self._error
        return [LLMStatusCode.LLM_SUCCESS if c is None else c for c in self._results]

    async def _settle(self, timeout_in_millis: int | None) -> bool:
        assert self._task is not None
        timeout = None
        if timeout_in_millis is not None:
            timeout = check_int("timeout_in_millis", timeout_in_millis, lo=0, hi=2**31 - 1) / 1000
        done, _ = await asyncio.wait([self._task], timeout=timeout)
        return bool(done)

    async def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """Wait for the end of the transfer; its first failure or ``LLM_SUCCESS``.

        :returns: ``LLM_TIMEOUT`` if it is still running after
            ``timeout_in_millis`` (None waits for ever); the transfer goes on.
        """
        if not await self._settle(timeout_in_millis):
            return LLMStatusCode.LLM_TIMEOUT
        if self._task is not None and self._task.cancelled():
            return LLMStatusCode.LLM_FAILED
        return next((c for c in self._results if c not in (None, LLMStatusCode.LLM_SUCCESS)),
                    LLMStatusCode.LLM_SUCCESS)

    async def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """Per-config results: a code, or None for a config never started.

        Waits up to ``timeout_in_millis`` for the end (None: for ever) and then
        returns what is known; the transfer goes on if it has not ended.
        """
        await self._settle(timeout_in_millis)
        return list(self._results)


def _quiet(fut: asyncio.Future) -> asyncio.Future:
    """``fut``, whose error is reported by ``await task`` already if nobody awaits it."""
    fut.add_done_callback(_retrieved)
    return fut


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _fail_quietly(fut: asyncio.Future, exc: BaseException) -> None:
    # Nobody has to await every layer future: mark the error as retrieved.
    fut.set_exception(exc)
    fut.exception()
