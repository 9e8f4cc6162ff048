"""A blocking facade with llm_datadist's names, signatures and return shapes.

Code written for ``llm_datadist`` runs by changing its import::

    from aio_datadist.compat import LLMDataDist, LLMConfig, LLMRole, ...

Every call runs on one private event-loop thread per process and blocks the
caller until it is done; ``link_clusters`` returns the status tuple,
``CacheTask.synchronize(timeout_in_millis)`` returns a code, and the
``kv_cache_manager`` methods block. Do not call the facade from inside a
running event loop (use the async API there).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from aio_datadist import datadist as _async_datadist
from aio_datadist import leases as _leases
from aio_datadist._checks import named_by_caller
from aio_datadist._compat_v2 import CacheManager
from aio_datadist.cache import KvCache
from aio_datadist.cache_manager import Cache
from aio_datadist.config import LLMConfig, LlmConfig
from aio_datadist.layers import range_pair
from aio_datadist.manager import PUSH_KEY_AS_DST_CACHE_KEY
from aio_datadist.runtime import QUIESCE_S
from aio_datadist.status import LLMException, LLMStatusCode, Status, code_2_status
from aio_datadist.task import CacheTask as _AsyncCacheTask
from aio_datadist.tensors import Tensor, TensorDesc
from aio_datadist.types import (
    ALL_LAYERS,
    BlocksCacheKey,
    CacheDesc,
    CacheIndex,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    KvCacheExtParam,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMRole,
    MemInfo,
    Memtype,
    Placement,
    RegisterMemStatus,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

if TYPE_CHECKING:
    from aio_datadist.runtime import Runtime
    from aio_datadist.stats import EndpointStats
    from aio_datadist.types import RegisterMemStatus as _RegisterMemStatus

__all__ = [
    "BlocksCacheKey", "Cache", "CacheDesc", "CacheIndex", "CacheKey", "CacheKeyByIdAndIndex", "CacheLease",
    "CacheManager", "CacheTask", "DataType", "KvCache", "KvCacheExtParam", "KvCacheManager", "LLMClusterInfo",
    "LLMConfig", "LLMDataDist", "LLMException", "LLMRole", "LLMStatusCode", "LayerSynchronizer", "LlmConfig",
    "MemInfo", "Memtype", "Placement", "RegisterMemStatus", "Status", "Tensor", "TensorDesc", "TransferConfig",
    "TransferWithCacheKeyConfig", "code_2_status", "lease_of",
]

_T = TypeVar("_T")
_R = TypeVar("_R")
log = logging.getLogger(__name__)
# As importing llm_datadist does: CANN reads it (torch_npu's unified-memory allocation); a value set stays.
os.environ.setdefault("AUTO_USE_UC_MEMORY", "0")
#: How long a blocking call interrupted in the caller's thread (KeyboardInterrupt) waits for the call it
#: cancelled to end on the facade's loop before the interrupt goes on: every cancelled call ends within
#: its own bounds (an aborted transfer's acknowledgement, a cut copy's settling), far below this.
INTERRUPT_SETTLE_S = 15.0
#: How long the exit waits for the facade's loop to stop (a callback of the caller's may hold it); a loop still
#: running then is left to its daemon thread, unclosed. The exit also waits this long for the loop to take the
#: finalize of the endpoints still live, and skips them (with a warning) when it does not.
STOP_JOIN_S = 5.0
#: How long the exit waits for those finalizes to end: a finalize waits up to ``runtime.QUIESCE_S`` for a
#: device still busy with the endpoint's work, then closes links within seconds.
EXIT_FINALIZE_S = QUIESCE_S + 15.0
#: How long the exit gives the finalizes it gave up on to end once cancelled, before it stops the loop.
EXIT_CANCEL_S = 1.0
#: How long stopping the loop waits for the blocking calls still running on it to end (at exit, those of
#: daemon threads that the finalize failed: milliseconds), so each caller's future takes its result before the
#: loop stops; a call still running then fails as the loop's thread ends, as before.
STOP_CALLS_S = 0.5
#: How long the exit then waits for a call sent after that wait (a thread switch held it): an ``init`` that ends
#: after the exit's last finalizes finalizes its endpoint itself, in milliseconds.
LATE_CALLS_S = 2.0


class _LoopThread:
    """The process's private event loop, started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._end = _LoopEnd()
        self._refusing: int | None = None  # the process exits: no call of a thread but this one starts
        #: Calls that the refusal let through and that are not on the loop yet (``run``), by thread: the stop waits
        #: for other threads' to be sent before it waits for the calls on the loop, so an ``init`` let through as
        #: the exit began is one of those (and its endpoint one the exit finalizes). (Only the main thread gets a
        #: KeyboardInterrupt, which may land between a count and its uncount; the exit's stop runs there.)
        self._sending: dict[int, int] = {}
        #: Whether this thread is inside a call (``run``): a call made from a signal handler that interrupted one
        #: would wait on the locks and the event the interrupted call holds, for good.
        self._inside = threading.local()

    def _locked(self, step: Callable[[], _T]) -> _T:
        """``step()`` under ``_lock``, this thread marked inside a call meanwhile (``run``), so that a signal
        handler's call made while the lock is held is refused, not left waiting for it. The mark is set first thing
        in the ``try`` whose ``finally`` restores it, and ``with self._lock`` takes the lock in C: an interrupt at
        any point leaves neither. (A context manager of Python's would leave both when an interrupt lands as its
        ``__enter__`` returns.)"""
        inside = self._inside
        was = getattr(inside, "call", False)
        try:
            inside.call = True
            with self._lock:
                return step()
        finally:
            inside.call = was

    def refuse_calls(self) -> None:
        """From now on a call of any thread but this one (the exit's: its later atexit hooks may still call,
        a ``finalize`` of an endpoint the exit finalized returns) raises ``LLM_FAILED`` before it is submitted:
        daemon threads still calling when the process exits."""
        me = threading.get_ident()

        def refuse() -> None:
            self._refusing = me

        self._locked(refuse)

    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop, started if need be (under ``_lock``)."""
        return self._started()[0]

    def _sent(self) -> None:
        me = threading.get_ident()

        def uncount() -> None:
            left = self._sending.get(me, 0) - 1
            if left > 0:
                self._sending[me] = left
            else:
                self._sending.pop(me, None)

        self._locked(uncount)

    def _others_sending(self) -> bool:
        me = threading.get_ident()
        return any(ident != me for ident in list(self._sending))

    def _started(self, *, sending: bool = False) -> tuple[asyncio.AbstractEventLoop, _LoopEnd]:
        me = threading.get_ident()
        return self._locked(lambda: self._start_locked(me, sending))

    def _start_locked(self, me: int, sending: bool) -> tuple[asyncio.AbstractEventLoop, _LoopEnd]:
        """The loop and its end, the loop started if need be (``_lock`` held); ``sending``: a call to be sent is
        counted for this thread (``me``)."""
        if self._refusing is not None and self._refusing != me:
            raise LLMException("the blocking facade is shutting down (the process exits); the call cannot run",
                               status_code=LLMStatusCode.LLM_FAILED)
        if self._loop is None:
            # asyncio's own loop, whatever the process's policy: a forked child of a process whose facade
            # ran on uvloop crashes as it exits (libuv joins thread-pool threads that are the parent's).
            try:
                loop = asyncio.SelectorEventLoop()
            except OSError as exc:  # no fd for its selector or self-pipe
                raise LLMException(f"cannot start the blocking facade's event loop: {exc}",
                                   status_code=LLMStatusCode.LLM_FAILED) from exc
            ready = threading.Event()
            stopping = self._stopping = threading.Event()
            end = self._end = _LoopEnd()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                why = "its thread failed"
                warned = False
                try:
                    while not loop.is_closed():
                        try:
                            loop.run_forever()
                        except BaseException as exc:  # the loop must outlive what one task raised
                            # A KeyboardInterrupt or SystemExit raised in a task (a user callback) leaves it
                            # through run_forever; the task ended with it, and every other call still needs
                            # this loop: without it each later call, and the exit's finalize, would wait
                            # forever.
                            log.error("aio_datadist.compat: %r escaped a task of the blocking facade's loop; "
                                      "the loop goes on", exc)
                            continue
                        if stopping.is_set():
                            why = "the facade's loop was stopped (the process exits)"
                            return
                        # Code on the loop called loop.stop() (an async synchronizer treating it as its own):
                        # the loop is the facade's, and every call waits for it to go on.
                        if not warned:
                            log.error("aio_datadist.compat: code on the blocking facade's loop stopped it "
                                      "(loop.stop()); the loop goes on")
                            warned = True
                    why = "its loop was closed"
                finally:
                    end.ended(why)

            thread = self._thread = threading.Thread(target=run, name="aio_datadist-compat", daemon=True)
            # The loop is the facade's before its thread starts: an interrupt as the start or the wait for it
            # returns leaves this one loop for the next call (a call may be sent before run_forever began), not a
            # second loop started beside it and this one running for good.
            self._loop = loop
            try:
                thread.start()
            except BaseException as exc:
                if thread.ident is None:  # it never started: no loop at all
                    self._loop = self._thread = None
                    loop.close()
                if isinstance(exc, RuntimeError) and thread.ident is None and self._refusing == me:
                    # Python 3.12 starts no thread in an atexit hook (3.11 and 3.13 do): a later hook of the
                    # exit's own thread runs its call on a loop of its own, here (``_run``)
                    raise _NoThreadAtExit(str(exc)) from exc
                if isinstance(exc, RuntimeError) and thread.ident is None:  # no thread left (pthread_create)
                    raise LLMException(f"cannot start the blocking facade's event-loop thread: {exc}",
                                       status_code=LLMStatusCode.LLM_FAILED) from exc
                raise
            ready.wait()
        if sending:  # (counted once the loop runs: a failed start counts nothing)
            self._sending[me] = self._sending.get(me, 0) + 1
        return self._loop, self._end

    def run(self, coro: Coroutine[Any, Any, _T], undo: Callable[[_T], object] | None = None) -> _T:
        """Run ``coro`` on the loop and wait for its result.

        :param undo: releases what the call returned (a cache it made, a task it started) when its caller
            was interrupted (KeyboardInterrupt) and never got it.
        :raises LLMException: ``LLM_FAILED`` when the loop's thread has ended, the call with it, or when this
            thread is inside another call already (a signal handler that interrupted it), at once.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            coro.close()
            raise RuntimeError("aio_datadist.compat blocks; inside an event loop use the async API")
        inside = self._inside
        if getattr(inside, "call", False):
            coro.close()
            raise LLMException("aio_datadist.compat: a blocking call made while the same thread is inside another "
                               "(from a signal handler, or a garbage-collection finalizer, that interrupted it: it "
                               "would wait for that call for good); let the handler set a flag and make the call "
                               "after", status_code=LLMStatusCode.LLM_FAILED)
        try:
            inside.call = True  # (set before any lock is taken, cleared once the last is let go)
            return self._run(coro, undo)
        finally:
            inside.call = False

    def _run(self, coro: Coroutine[Any, Any, _T], undo: Callable[[_T], object] | None) -> _T:
        try:
            loop, end = self._started(sending=True)
        except _NoThreadAtExit:  # the exit's own thread, on 3.12: the call runs here, as it ran on a new loop thread
            return _run_here(_Call(coro, undo).run())
        except BaseException:  # refused; an interrupt
            coro.close()
            raise
        sending = True

        def sent() -> None:
            nonlocal sending
            if sending:
                sending = False
                self._sent()

        try:
            call = _Call(coro, undo)
            settled = threading.Event()  # the call's result is in, or the loop's thread has ended
        except BaseException:
            sent()
            raise
        try:
            if end.watch(settled):
                try:
                    future = asyncio.run_coroutine_threadsafe(call.run(), loop)
                except RuntimeError:  # closed in the instant since (the exit): as ended
                    if not loop.is_closed():
                        raise
                    end.ended(end.why or "its loop was closed")
                    settled.set()
                    future = None
                finally:
                    sent()
                if future is not None:
                    future.add_done_callback(lambda _: settled.set())
                settled.wait()
                if future is not None and future.done():
                    return future.result()
        except BaseException:
            # Interrupted while waiting (a KeyboardInterrupt in this thread), or the call's own error (then
            # this finds it ended): the call is cancelled and has ended, what it made released, before this
            # raises, so none of its work goes on (no byte lands) behind the caller.
            call.abandon(loop, end)
            raise
        finally:
            sent()  # (not sent: the loop had ended, or an interrupt came first)
            end.unwatch(settled)
        call.close()
        raise LLMException(f"the blocking facade's event-loop thread has ended ({end.why}); the call cannot run",
                           status_code=LLMStatusCode.LLM_FAILED)

    def call(self, fn: Callable[..., _T], *args: Any, undo: Callable[[_T], object] | None = None,
             **kwargs: Any) -> _T:
        """``fn(*args, **kwargs)`` on the loop; ``undo`` as in :meth:`run`."""
        async def invoke() -> _T:
            return fn(*args, **kwargs)

        return self.run(invoke(), undo)

    def forget(self) -> None:
        """In a child process after ``fork``: the parent's loop has no thread here (and its lock may have been
        held by another of the parent's threads); the child's first call starts a loop of its own."""
        self._lock = threading.Lock()
        self._loop = self._thread = None
        self._stopping, self._end = threading.Event(), _LoopEnd()
        self._refusing = None
        self._inside = threading.local()
        self._sending = {}  # (the parent's threads' sends are not this process's)

    def stop(self, last: Callable[[], Coroutine[Any, Any, None]] | None = None) -> None:
        """Stop the loop and its thread. ``last``: run on the loop once the calls on it ended (not when they
        did not within ``STOP_CALLS_S``: the loop is held), before it stops (the exit's last finalizes)."""
        def take() -> tuple[asyncio.AbstractEventLoop | None, threading.Thread | None, threading.Event]:
            taken = self._loop, self._thread, self._stopping
            self._loop = self._thread = None
            return taken

        loop, thread, stopping = self._locked(take)
        if loop is not None and thread is not None:
            if thread.is_alive():
                # The calls still on the loop end first (a finalize failed them), so their callers' futures
                # take their results: a call ended in the loop's last turn left its error unread ("Task
                # exception was never retrieved") and one not started yet was destroyed pending.
                ended = False
                seen: set[asyncio.Task] = set()
                sending_until = time.monotonic() + STOP_CALLS_S
                while self._others_sending() and time.monotonic() < sending_until:
                    time.sleep(0.001)  # a call let through (before the exit refused calls) is not sent yet
                with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
                    seen = asyncio.run_coroutine_threadsafe(_end_calls(STOP_CALLS_S), loop).result(STOP_CALLS_S + 1.0)
                    ended = True
                finished = False
                if ended and last is not None:
                    with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
                        asyncio.run_coroutine_threadsafe(last(), loop).result(EXIT_FINALIZE_S + EXIT_CANCEL_S + 1.0)
                        finished = True
                if finished:  # (not on a loop the last finalizes found held: nothing more runs there)
                    # A call let through that a thread switch held past the waits above is sent meanwhile, and an
                    # init may still run past the first wait: an init ending after the last finalizes finalizes
                    # its endpoint itself, which the loop must still run (stopped under it, its endpoint stayed
                    # initialised and listening).
                    sending_until = time.monotonic() + STOP_CALLS_S
                    while self._others_sending() and time.monotonic() < sending_until:
                        time.sleep(0.001)
                    with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
                        asyncio.run_coroutine_threadsafe(_end_calls(LATE_CALLS_S, seen), loop).result(
                            LATE_CALLS_S + 1.0)
            stopping.set()  # before the stop, which its thread takes for a callback's loop.stop() otherwise
            loop.call_soon_threadsafe(loop.stop)
            thread.join(STOP_JOIN_S)
            if thread.is_alive():  # closing a running loop raises: at exit, a traceback for nothing
                log.warning("aio_datadist.compat: the facade's loop did not stop within %.1f s (a callback "
                            "still runs on it); left running", STOP_JOIN_S)
                return
            loop.close()


async def _end_calls(limit: float, skip: set[asyncio.Task] | frozenset[asyncio.Task] = frozenset()
                     ) -> set[asyncio.Task]:
    """Wait ``limit`` at most for the blocking calls running on this loop (but those in ``skip`` that are no
    ``init``) to end, and let the callbacks their ends scheduled (their callers' futures) run; the calls waited
    for."""
    calls = {task for task in asyncio.all_tasks()
             if getattr(task.get_coro(), "__qualname__", "") == "_Call._run" and (task not in skip or task in _INITS)}
    if calls:
        await asyncio.wait(calls, timeout=limit)
    await asyncio.sleep(0)
    return calls


class _Call(Generic[_T]):
    """One blocking call: its coroutine on the facade's loop, and what its caller's interrupt does to it."""

    def __init__(self, coro: Coroutine[Any, Any, _T], undo: Callable[[_T], object] | None) -> None:
        self._coro = coro
        self._undo = undo
        self._lock = threading.Lock()  # the caller's abandon() against the loop's start and end of run()
        self._abandoned = False
        self._task: asyncio.Task[Any] | None = None
        self._returned: list[_T] = []  # the result once run() returned it, which the caller may never get
        self._ended = threading.Event()
        self._waiter: Coroutine[Any, Any, _T] | None = None

    def run(self) -> Coroutine[Any, Any, _T]:
        self._waiter = self._run()
        return self._waiter

    def close(self) -> None:
        """The loop's thread has ended: a call it never started never will (one it started stays with it)."""
        if self._task is None:
            if self._waiter is not None:
                self._waiter.close()
            self._coro.close()

    async def _run(self) -> _T:
        try:
            with self._lock:
                if self._abandoned:  # interrupted before the loop got to it: it never starts
                    self._coro.close()
                    raise asyncio.CancelledError
                self._task = asyncio.current_task()
            result = await self._coro
            with self._lock:
                if not self._abandoned:
                    self._returned.append(result)
                    return result
            # A plain call (call()) runs whole in one step, whatever interrupted its caller meanwhile. What undoes
            # it may await (an unlink): the caller's cancel, which may come meanwhile, does not cut it short.
            undoing = asyncio.ensure_future(_undo(self._undo, result))
            while not undoing.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(undoing)
            raise asyncio.CancelledError
        finally:
            self._ended.set()

    def abandon(self, loop: asyncio.AbstractEventLoop, end: _LoopEnd) -> None:
        """In the caller's thread: cancel the call and wait for its end; release what it returned. Ctrl-C pressed
        again meanwhile does not cut the wait short (the call would run on behind its caller): it is raised once
        the call ended (``INTERRUPT_SETTLE_S`` at most, however often it is pressed)."""
        deadline = time.monotonic() + INTERRUPT_SETTLE_S
        again: list[BaseException] = []

        def patiently(step: Callable[[], _R]) -> _R:
            while True:
                try:
                    return step()
                except KeyboardInterrupt as exc:
                    again.append(exc)

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        def mark() -> tuple[asyncio.Task[Any] | None, list[_T]]:
            with self._lock:
                self._abandoned = True
                return self._task, self._returned

        task, returned = patiently(mark)
        if task is None or end.why is not None:
            self._raise_again(again)
            return  # not started, and it never will; or its loop runs no more
        if not returned:
            # A coroutine stops at its next await; a plain call (call()) has run its one step whole by the time
            # the cancel runs, and run() released its result. (A call not started yet never starts: the cancel
            # alone would come after its first step, the whole of a plain call.)
            patiently(lambda: loop.call_soon_threadsafe(task.cancel))  # (twice does no harm)
            patiently(lambda: self._ended.wait(left()))
        if returned:
            undone = [False]

            async def undo_once() -> None:  # (submitted twice when an interrupt cut its submission: run once)
                if not undone[0]:
                    undone[0] = True
                    await _undo(self._undo, returned[0])

            released = patiently(lambda: asyncio.run_coroutine_threadsafe(undo_once(), loop))
            with contextlib.suppress(TimeoutError):
                patiently(lambda: released.result(left()))
        self._raise_again(again)

    @staticmethod
    def _raise_again(again: list[BaseException]) -> None:
        if again:
            raise again[0]


class _NoThreadAtExit(RuntimeError):
    """The facade's loop thread cannot start: the exit's own thread calls from an atexit hook, on Python 3.12."""


def _run_here(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` on a loop of its own in this thread (the exit's: no other thread's call is taken any more)."""
    loop = asyncio.SelectorEventLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


class _LoopEnd:
    """Whether a loop's thread has ended, and why: the calls waiting on the loop are woken when it does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: set[threading.Event] = set()
        self.why: str | None = None

    def watch(self, settled: threading.Event) -> bool:
        """Set ``settled`` when the thread ends; False if it has ended already."""
        with self._lock:
            if self.why is None:
                self._waiting.add(settled)
            return self.why is None

    def unwatch(self, settled: threading.Event) -> None:
        with self._lock:
            self._waiting.discard(settled)

    def ended(self, why: str) -> None:
        with self._lock:
            self.why, waiting = why, list(self._waiting)
        for settled in waiting:
            settled.set()


async def _undo(undo: Callable[[_T], object] | None, made: _T) -> None:
    """Release what an interrupted call made (:meth:`_LoopThread.run`); a failure is logged, the interrupt goes on."""
    if undo is None:
        return
    try:
        undone = undo(made)
        if inspect.isawaitable(undone):  # (an unlink)
            await undone
    except Exception as exc:
        log.warning("aio_datadist.compat: releasing %r, made by a call its caller interrupted, failed: %s",
                    made, exc)


_RUNNER = _LoopThread()
_LIVE: set[LLMDataDist] = set()


def _after_fork_in_child() -> None:
    # The parent's endpoints are the parent's: the child neither finalizes them at exit (shutting down
    # sockets it shares with the parent) nor waits for a loop that no thread runs here.
    global _EXIT_TOOK_LAST
    _LIVE.clear()
    _EXIT_TOOK_LAST = False
    _RUNNER.forget()


os.register_at_fork(after_in_child=_after_fork_in_child)


#: The endpoints the exit's finalize took (their ``finalize`` from a later atexit hook returns at once).
_EXIT_FINALIZED: set[LLMDataDist] = set()


#: The facade's ``init`` calls running on its loop (their tasks; touched on the loop only).
_INITS: set[asyncio.Task] = set()

#: Set on the facade's loop by the exit's last finalizes (``_last_finalizes``): an ``init`` that ends after them
#: finalizes its endpoint at once and fails.
_EXIT_TOOK_LAST = False


@atexit.register
def _finalize_all() -> None:
    _RUNNER.refuse_calls()  # daemon threads still calling: refused from now on, not left running at the stop
    loop = _RUNNER._loop
    held = loop is not None and not _finalize_at_exit(loop)
    # The calls running as the exit began end as the loop stops (STOP_CALLS_S at most; none starts any more): an
    # init among them made an endpoint after the list above was taken, which the last finalizes take, on the
    # loop; one ending after them finalizes it itself (``LLMDataDist._init``). Before, it stayed initialised and
    # listening after the exit's hook.
    _RUNNER.stop(last=None if held else _last_finalizes)


async def _last_finalizes() -> None:
    global _EXIT_TOOK_LAST
    _EXIT_TOOK_LAST = True
    await _finalize_taken(_exit_takes())


async def _finalize_taken(live: list[LLMDataDist]) -> None:
    """Finalize ``live`` on the facade's loop, ``EXIT_FINALIZE_S`` at most; finalizes still running then are
    cancelled (ended, not destroyed pending with the loop), ``EXIT_CANCEL_S`` more at most."""
    if not live:
        return
    ends = [asyncio.ensure_future(dd._dd.finalize()) for dd in live]
    _, pending = await asyncio.wait(ends, timeout=EXIT_FINALIZE_S)
    if pending:
        log.warning("aio_datadist.compat: %d endpoint(s) not finalized within %.0f s at exit", len(pending),
                    EXIT_FINALIZE_S)
        for end in pending:
            end.cancel()
        await asyncio.wait(pending, timeout=EXIT_CANCEL_S)


def _exit_takes() -> list[LLMDataDist]:
    """The endpoints the facade keeps (``_LIVE``, emptied), now the exit's (``_EXIT_FINALIZED``)."""
    live = list(_LIVE)
    _EXIT_FINALIZED.update(live)
    _LIVE.difference_update(live)
    return live


def _finalize_at_exit(loop: asyncio.AbstractEventLoop) -> bool:
    """Finalize, on the facade's ``loop``, the endpoints the facade keeps (``_exit_takes``). False when the loop is
    held and nothing could run on it."""
    live = _exit_takes()
    if not live:
        return True
    # A callback of the caller's may hold the loop (a blocking wait in an async synchronizer): the exit
    # must not wait for it without bound, as a blocking call here would.
    try:
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(STOP_JOIN_S)
    except concurrent.futures.TimeoutError:
        log.warning("aio_datadist.compat: the facade's loop is held (a callback still runs on it); %d "
                    "endpoint(s) not finalized at exit", len(live))
        return False
    with contextlib.suppress(concurrent.futures.TimeoutError):  # (bounded on the loop: a callback that holds it now)
        asyncio.run_coroutine_threadsafe(_finalize_taken(live), loop).result(EXIT_FINALIZE_S + EXIT_CANCEL_S + 1.0)
    return True


#: v1 LLM-DataDist's codes for what the async API reports with v2's in both modes (reference 2.4, 2.11, 3.3): it
#: has no ``LLM_TIMEOUT`` and no ``LLM_OUT_OF_MEMORY`` (its pool's is ``LLM_DEVICE_OUT_OF_MEMORY``).
_V1_CODES = {LLMStatusCode.LLM_TIMEOUT: LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT,
             LLMStatusCode.LLM_OUT_OF_MEMORY: LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY}


def _v1_raised(exc: LLMException) -> LLMException:
    """``exc`` with v1's code (:data:`_V1_CODES`), or ``exc`` itself."""
    code = _V1_CODES.get(exc.status_code)
    return exc if code is None else LLMException(*exc.args, status_code=code, argument=exc.argument)


def _v1(run: Callable[[], _T]) -> _T:
    """``run()`` for a KvCacheManager (v1) call of the facade, raising with v1's code (:data:`_V1_CODES`)."""
    try:
        return run()
    except LLMException as exc:
        if (v1 := _v1_raised(exc)) is exc:
            raise
        raise v1 from exc


def _v1_run(coro: Coroutine[Any, Any, _T]) -> _T:
    """``_RUNNER.run(coro)`` with v1's codes: a time-out raises ``LLM_WAIT_PROCESS_TIMEOUT``."""
    return _v1(lambda: _RUNNER.run(coro))


def _v1_call(fn: Callable[..., _T], *args: Any, undo: Callable[[_T], object] | None = None) -> _T:
    """``_RUNNER.call(fn, *args, undo=undo)`` with v1's codes: an allocation or registration past the memory cap
    raises ``LLM_DEVICE_OUT_OF_MEMORY``."""
    return _v1(lambda: _RUNNER.call(fn, *args, undo=undo))


def _v1_codes(dd: Any, result: tuple[LLMStatusCode, list[LLMStatusCode]]) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
    """``link_clusters`` / ``unlink_clusters``'s codes as v1 gives them, on an endpoint in KvCacheManager mode."""
    if not _async_datadist.in_kv_cache_manager_mode(dd):
        return result
    overall, each = result
    return _V1_CODES.get(overall, overall), [_V1_CODES.get(code, code) for code in each]


class CacheLease:
    """Blocking view of :class:`aio_datadist.leases.CacheLease`: ``renew``, ``cancel`` and ``release`` run on
    the facade's loop, where the lease's timer lives (``deadline`` is in that loop's time)."""

    def __init__(self, lease: _leases.CacheLease) -> None:
        self._lease = lease

    @property
    def expired(self) -> bool:
        return self._lease.expired

    @property
    def active(self) -> bool:
        return self._lease.active

    @property
    def deadline(self) -> float | None:
        return self._lease.deadline

    def renew(self, lease_ms: int) -> None:
        _RUNNER.call(self._lease.renew, lease_ms)

    def cancel(self) -> None:
        _RUNNER.call(self._lease.cancel)

    def release(self) -> None:
        _RUNNER.call(self._lease.release)


def lease_of(cache: KvCache) -> CacheLease | None:
    """The lease ``allocate_cache(..., lease_ms=...)`` put on ``cache``, for this thread; None if none."""
    lease = _leases.lease_of(cache)
    return None if lease is None else CacheLease(lease)


class CacheTask:
    """Blocking view of :class:`aio_datadist.CacheTask`."""

    def __init__(self, task: _AsyncCacheTask) -> None:
        self._task = task

    def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """Wait for all layers; the first failure, ``LLM_SUCCESS``, or the time-out code (v1
        ``LLM_WAIT_PROCESS_TIMEOUT``, v2 ``LLM_TIMEOUT``); a v1 task's codes are v1's (:data:`_V1_CODES`)."""
        return self._own(_RUNNER.run(self._task.synchronize(timeout_in_millis)))

    def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """Per-config results (None for a config never started; the time-out code for each while it runs)."""
        return [None if code is None else self._own(code)
                for code in _RUNNER.run(self._task.get_results(timeout_in_millis))]

    def _own(self, code: LLMStatusCode) -> LLMStatusCode:
        """``code`` as this task's mode gives it: a v1 task (its time-out code v1's) has v1's codes."""
        if self._task.timeout_code is LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT:
            return _V1_CODES.get(code, code)
        return code

    def cancel(self) -> None:
        """Cancel the transfer; returns at once. Takes no lock of the facade's, so a signal handler may call it
        (a graceful shutdown) while its thread is inside another facade call."""
        self._task.cancel_threadsafe()  # (in a forked child the task is the parent's: LLM_FAILED there)


class KvCacheManager:
    """Blocking view of :class:`aio_datadist.KvCacheManager` (same methods)."""

    def __init__(self, manager: Any) -> None:
        self._m = manager

    def is_initialized(self) -> bool:
        return self._m.is_initialized()

    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey] = (), *,
                       lease_ms: int | None = None) -> KvCache:
        """As the async ``allocate_cache``; with ``lease_ms``, its lease runs on the facade's loop and
        :func:`lease_of` gives it to this thread."""
        if lease_ms is None:
            return _v1_call(self._m.allocate_cache, cache_desc, cache_keys, undo=self._release(cache_keys))
        return _v1_call(functools.partial(self._m.allocate_cache, cache_desc, cache_keys, lease_ms=lease_ms),
                        undo=self._release(cache_keys))

    def allocate_blocks_cache(self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None) -> KvCache:
        return _v1_call(self._m.allocate_blocks_cache, cache_desc, blocks_cache_key, undo=self._release())

    def register_cache(self, cache_desc: CacheDesc, addrs: Sequence[Any],
                       cache_keys: Sequence[CacheKey] = (), remote_accessible: bool | None = None) -> KvCache:
        return _v1_call(self._m.register_cache, cache_desc, addrs, cache_keys, remote_accessible,
                        undo=self._release())

    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: Sequence[Any],
                              blocks_cache_key: BlocksCacheKey | None = None,
                              remote_accessible: bool | None = None) -> KvCache:
        return _v1_call(self._m.register_blocks_cache, cache_desc, addrs, blocks_cache_key, remote_accessible,
                        undo=self._release())

    def _release(self, cache_keys: Sequence[CacheKey] = ()) -> Callable[[KvCache], None]:
        """What releases a cache made by a call its caller interrupted: an allocated cache's keys would keep it."""
        def release(cache: KvCache) -> None:
            lease = _leases.lease_of(cache)
            if lease is not None:
                lease.cancel()
            self._m.deallocate_cache(cache)
            for key in cache_keys:
                self._m.remove_cache_key(key)

        return release

    def deallocate_cache(self, cache: KvCache) -> None:
        _RUNNER.call(self._m.deallocate_cache, cache)

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        _RUNNER.call(self._m.remove_cache_key, cache_key)

    def get_cache_tensors(self, cache: KvCache, tensor_index: int = 0) -> list[Any]:
        return _RUNNER.call(self._m.get_cache_tensors, cache, tensor_index)

    def pull_cache(self, cache_key: Any, kv_cache: KvCache, batch_index: int = 0, size: int = -1, *,
                   src_layer_range: range | None = None, dst_layer_range: range | None = None,
                   tensor_num_per_layer: int = 2, src_cache_offset: int | None = None,
                   dst_cache_offset: int | None = None, timeout: int | None = None, **unknown: Any) -> None:
        """Blocking :meth:`aio_datadist.KvCacheManager.pull_cache` (same arguments)."""
        _v1_run(self._m.pull_cache(cache_key, kv_cache, batch_index, size, src_layer_range=src_layer_range,
                                       dst_layer_range=dst_layer_range, tensor_num_per_layer=tensor_num_per_layer,
                                       src_cache_offset=src_cache_offset, dst_cache_offset=dst_cache_offset,
                                       timeout=timeout, **unknown))

    def pull_blocks(self, src_cache_key: Any = None, dst_cache: KvCache | None = None, src_blocks: Sequence[int] = (),
                    dst_blocks: Sequence[int] = (), *, src_layer_range: range | None = None,
                    dst_layer_range: range | None = None, tensor_num_per_layer: int = 2, timeout: int | None = None,
                    prompt_cache_key: Any = None, decoder_kv_cache: KvCache | None = None,
                    prompt_blocks: Sequence[int] | None = None, decoder_blocks: Sequence[int] | None = None,
                    **unknown: Any) -> None:
        """Blocking :meth:`aio_datadist.KvCacheManager.pull_blocks`; also takes the KvCacheManager (v1)
        names ``prompt_cache_key``, ``decoder_kv_cache``, ``prompt_blocks`` and ``decoder_blocks``."""
        _v1_run(self._m.pull_blocks(src_cache_key, dst_cache, src_blocks, dst_blocks,
                                        src_layer_range=src_layer_range, dst_layer_range=dst_layer_range,
                                        tensor_num_per_layer=tensor_num_per_layer, timeout=timeout,
                                        prompt_cache_key=prompt_cache_key, decoder_kv_cache=decoder_kv_cache,
                                        prompt_blocks=prompt_blocks, decoder_blocks=decoder_blocks, **unknown))

    def push_blocks(self, dst_cache_key: Any, src_cache: KvCache, src_blocks: Sequence[int] = (),
                    dst_blocks: Sequence[int] = (), src_layer_range: range | None = None,
                    dst_layer_range: range | None = None, tensor_num_per_layer: int = 2) -> None:
        """v2 spelling: python ranges and ``tensor_num_per_layer`` instead of ``ext_param``."""
        ext = _ext_param(src_layer_range, dst_layer_range, tensor_num_per_layer)
        with named_by_caller(PUSH_KEY_AS_DST_CACHE_KEY):  # llm_datadist's spelling, not the async v1 call's
            _v1_run(self._m.push_blocks(dst_cache_key, src_cache, src_blocks, dst_blocks, ext))

    def push_cache(self, dst_cache_key: Any, src_cache: KvCache, src_batch_index: int = 0,
                   src_layer_range: range | None = None, dst_layer_range: range | None = None,
                   size: int = -1, tensor_num_per_layer: int = 2) -> None:
        ext = _ext_param(src_layer_range, dst_layer_range, tensor_num_per_layer)
        with named_by_caller(PUSH_KEY_AS_DST_CACHE_KEY):  # llm_datadist's spelling, not the async v1 call's
            _v1_run(self._m.push_cache(dst_cache_key, src_cache, src_batch_index, ext, size))

    def copy_cache(self, dst: KvCache, src: KvCache, dst_batch_index: int = 0, src_batch_index: int = 0,
                   offset: int = 0, size: int = -1, req_id: int | None = None) -> None:
        _v1_run(self._m.copy_cache(dst, src, dst_batch_index, src_batch_index, offset, size, req_id))

    def copy_blocks(self, cache: KvCache, copy_block_info: Mapping[int, Sequence[int]]) -> None:
        _v1_run(self._m.copy_blocks(cache, copy_block_info))

    def swap_blocks(self, src: KvCache, dst: KvCache, src_to_dst: Mapping[int, int]) -> None:
        _v1_run(self._m.swap_blocks(src, dst, src_to_dst))

    def transfer_cache_async(self, src_cache: KvCache, layer_synchronizer: LayerSynchronizer,
                             transfer_configs: Sequence[Any], src_block_indices: Sequence[int] | None = None,
                             dst_block_indices: Sequence[int] | None = None,
                             dst_block_memory_size: int | None = None) -> CacheTask:
        task = _RUNNER.call(self._m.transfer_cache_async, src_cache, layer_synchronizer, transfer_configs,
                            src_block_indices, dst_block_indices, dst_block_memory_size,
                            undo=lambda started: started.cancel())
        return CacheTask(task)


def _ext_param(src: range | None, dst: range | None, per_layer: int) -> KvCacheExtParam:
    def pair(arg: str, r: range | None) -> tuple[int, int]:
        return ALL_LAYERS if r is None else range_pair(arg, r)

    return KvCacheExtParam(pair("src_layer_range", src), pair("dst_layer_range", dst), per_layer)


class LLMDataDist:
    """Blocking :class:`aio_datadist.LLMDataDist` with llm_datadist's signatures."""

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        self._dd = _async_datadist.LLMDataDist(role, cluster_id)
        self._manager = KvCacheManager(self._dd.kv_cache_manager)
        self._cache_manager: CacheManager | None = None

    @property
    def cluster_id(self) -> int:
        return self._dd.cluster_id

    @property
    def role(self) -> LLMRole:
        return self._dd.role

    @property
    def listen_address(self) -> tuple[str, int] | None:
        return self._dd.listen_address

    @property
    def kv_cache_manager(self) -> KvCacheManager:
        """The blocking KvCacheManager (v1); refused once ``init`` selected CacheManager mode."""
        self._dd.kv_cache_manager  # noqa: B018 -- the async accessor refuses in the wrong mode
        return self._manager

    @property
    def cache_manager(self) -> CacheManager:
        """The blocking CacheManager (v2); refused once ``init`` selected KvCacheManager mode."""
        if self._cache_manager is None:
            self._cache_manager = CacheManager(self._dd.cache_manager, _RUNNER, CacheTask)
        self._dd.cache_manager  # noqa: B018 -- the async accessor refuses in the wrong mode
        return self._cache_manager

    def init(self, options: Mapping[str, str]) -> None:
        # A caller interrupted (Ctrl-C) as the init ends never learns it started the endpoint's life: that life
        # is finalized before the interrupt reaches it, as what any interrupted call made is released.
        _RUNNER.run(self._init(options), undo=self._undo_init)

    async def _init(self, options: Mapping[str, str]) -> Runtime | None:
        task = asyncio.current_task()
        assert task is not None
        _INITS.add(task)  # the exit's late wait waits for it, however long the first one waited
        try:
            return await self._init_on_loop(options)
        finally:
            _INITS.discard(task)

    async def _undo_init(self, started: Runtime | None) -> None:
        # Not a life another init returned on since (that caller holds it), nor one that ended (a later life
        # is another call's).
        await self._dd._close_alone(started)
        if self._dd._runtime is None:
            _LIVE.discard(self)

    async def _init_on_loop(self, options: Mapping[str, str]) -> Runtime | None:
        """The runtime of the life this call started, or None."""
        started = await self._dd._open(options)
        if _EXIT_TOOK_LAST:  # ended after the exit's last finalizes (it ran past STOP_CALLS_S): nothing else would
            await self._dd.finalize()
            raise LLMException("the blocking facade is shutting down (the process exits); the endpoint was "
                               "finalized", status_code=LLMStatusCode.LLM_FAILED)
        # Kept on the loop as init ends: the exit's finalize finds it also when this call ended as the exit
        # began, its thread never to run again (a daemon thread).
        _LIVE.add(self)
        return started

    def finalize(self) -> None:
        # Dropped from the exit's finalize once this one ran: a call refused before it ran (from inside a running
        # loop) or stopped part-way (Ctrl-C) leaves it there (finalize is idempotent).
        if self in _EXIT_FINALIZED:
            return  # the exit finalized it (a cleanup hook that runs after the facade's): no loop runs any more
        _RUNNER.run(self._finalize())

    async def _finalize(self) -> None:
        await self._dd.finalize()
        # On the loop, with the finalize: another thread's init of this endpoint that ends on the loop after it
        # is kept (a discard from this thread, once the call returned, could come after that init's add).
        if self._dd._runtime is None:
            _LIVE.discard(self)

    def link_clusters(self, clusters: Sequence[LLMClusterInfo],
                      timeout: int = 3000) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        return _v1_codes(self._dd, _RUNNER.run(self._dd.link_clusters(clusters, timeout)))

    def unlink_clusters(self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000,
                        force: bool = False) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        return _v1_codes(self._dd, _RUNNER.run(self._dd.unlink_clusters(clusters, timeout, force)))

    def check_link_status(self, remote_cluster_id: int) -> None:
        _v1_run(self._dd.check_link_status(remote_cluster_id))  # KvCacheManager mode only

    def stats(self) -> EndpointStats:
        """:meth:`aio_datadist.LLMDataDist.stats`, taken on the facade's loop."""
        return _RUNNER.call(self._dd.stats)

    def link(self, comm_name: str, cluster_rank_info: Mapping[int, int], rank_table: str) -> int:
        """Start a bilateral link; returns its comm id at once (poll :meth:`query_register_mem_status`)."""
        # A dialling comm is made in one step: interrupted there, it is unlinked (it would dial on, unknown).
        return _RUNNER.run(self._dd.link(comm_name, cluster_rank_info, rank_table), undo=self._dd.unlink)

    def query_register_mem_status(self, comm_id: int) -> _RegisterMemStatus:
        """``RegisterMemStatus.PREPARING`` until the comm's links are up, then ``OK``; ``FAILED``."""
        return _RUNNER.call(self._dd.query_register_mem_status, comm_id)

    def unlink(self, comm_id: int) -> None:
        """Close the comm's links; the peers' comms turn ``FAILED``."""
        _RUNNER.run(self._dd.unlink(comm_id))

    def switch_role(self, role: LLMRole, switch_options: Mapping[str, str] | None = None) -> None:
        _RUNNER.run(self._dd.switch_role(role, switch_options))
