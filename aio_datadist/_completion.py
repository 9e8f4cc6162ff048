"""The one place where native completions meet the event loop.

A :class:`Completions` owns the asyncio side of a core
:class:`~aio_datadist._core.CompletionQueue`: it installs one reader per
running loop on the queue's eventfd, hands out tokens, and turns each
``(token, status, aux)`` record into the result of the future that was waiting
for it. Timeouts fail that future with ``LLM_TIMEOUT``; a cancelled or timed-out
future cancels its native work. A token stays registered (with whatever it
keeps alive) until the core says the native work is over, so memory is never
released while a copy or a socket job may still touch it.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import itertools
import logging
import os
import threading
import traceback
from collections.abc import Callable
from typing import Any

from aio_datadist._core import CompletionQueue
from aio_datadist._settle import settle
from aio_datadist.status import LLMException, LLMStatusCode

log = logging.getLogger(__name__)

__all__ = ["FAILED_DRAIN_S", "Completions", "status_for_errno"]

#: How long a submission that failed after some of its work was queued (a device submit: its ``drained``) waits,
#: without blocking the loop, for that work to end before its failure reaches the caller.
FAILED_DRAIN_S = 1.0
_DRAIN_POLL_FIRST_S = 0.0005
_DRAIN_POLL_MAX_S = 0.02

_LINK_ERRNOS = frozenset(
    {errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED, errno.ENOTCONN, errno.ETIMEDOUT,
     errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EBADF}
)


def status_for_errno(err: int) -> LLMStatusCode:
    """Map an OS error number from the core to the status code users see."""
    if err in _LINK_ERRNOS:
        return LLMStatusCode.LLM_LINK_FAILED
    if err == errno.ENOMEM:
        return LLMStatusCode.LLM_OUT_OF_MEMORY
    return LLMStatusCode.LLM_FAILED


class _Waiter:
    __slots__ = ("future", "cancel", "keepalive", "what", "timer", "timeout_ms", "settled")

    def __init__(self, future: asyncio.Future, cancel: Callable[[int], Any], keepalive: Any,
                 what: str, timeout_ms: int | None, settled: asyncio.Future | None = None) -> None:
        self.future = future
        self.cancel = cancel
        self.keepalive = keepalive
        self.what = what
        self.timeout_ms = timeout_ms
        self.timer: asyncio.TimerHandle | None = None
        self.settled = settled


class Completions:
    """Futures for native work completed through one :class:`CompletionQueue`."""

    def __init__(self, queue: CompletionQueue) -> None:
        self._queue = queue
        self._fd = queue.fileno()
        self._pending: dict[int, _Waiter] = {}
        self._loops: dict[asyncio.AbstractEventLoop, threading.Thread] = {}
        self._tokens = itertools.count(1)
        self._closed = False

    @property
    def queue(self) -> CompletionQueue:
        return self._queue

    def pending_count(self) -> int:
        """Tokens whose native work has not reported back yet."""
        return len(self._pending)

    def start(self, submit: Callable[[int], Any], cancel: Callable[[int], Any], *,
              timeout_ms: int | None, what: str, keepalive: Any = None,
              settled: asyncio.Future | None = None) -> asyncio.Future:
        """Submit native work and return the future of its completion.

        ``submit(token)`` queues the work; ``cancel(token)`` must be an
        idempotent native cancel. The future's result is the record's ``aux``
        (bytes moved). ``settled``, when given, gets a result once the core
        reported the work over, even after the returned future was cancelled
        or timed out. Must be called from a running loop.

        If ``submit`` raises, no record will come and the token is forgotten
        with its keepalive (``settled`` is set). A submit that may have
        started native work before failing keeps what that work touches
        itself: device submits hand it to their backend, which holds it until
        the stream drained (``DeviceBackend.enqueue_and_notify``). Such a
        failure carries ``drained`` (a callable saying whether that work is
        over): the returned future then fails with it, and ``settled`` is set,
        once ``drained()`` says so (polled, at most :data:`FAILED_DRAIN_S`),
        so that no byte of it lands after the caller's call returned.
        """
        if self._closed:
            raise LLMException(f"{what}: the transfer engine is closed",
                               status_code=LLMStatusCode.LLM_FAILED)
        loop = asyncio.get_running_loop()
        self._ensure_reader(loop)
        token = next(self._tokens)
        future = loop.create_future()
        waiter = _Waiter(future, cancel, keepalive, what, timeout_ms, settled)
        self._pending[token] = waiter
        try:
            submit(token)
        except BaseException as exc:
            del self._pending[token]
            drained = getattr(exc, "drained", None) if isinstance(exc, Exception) else None
            if drained is None or drained():
                if settled is not None:
                    _settle(settled)
                raise
            _fail_when_drained(loop, future, exc, drained, settled, what)
            return future
        if timeout_ms is not None:
            waiter.timer = loop.call_later(timeout_ms / 1000.0, self._on_timeout, token)
        future.add_done_callback(functools.partial(self._on_done, token, waiter))
        return future

    async def run(self, submit: Callable[[int], Any], cancel: Callable[[int], Any], *, timeout_ms: int | None,
                  what: str, keepalive: Any = None, settle_s: float | None = None) -> Any:
        """:meth:`start` the work and wait for it. If the caller gives up (the timeout, a cancel), the work is
        cancelled and this returns only once the core reported it over, so nothing of it runs afterwards:
        within ``settle_s`` (None: however long that takes, for work that always ends, as a device stream's)."""
        settled = asyncio.get_running_loop().create_future()
        moved = self.start(submit, cancel, timeout_ms=timeout_ms, what=what, keepalive=keepalive, settled=settled)
        try:
            return await moved
        except BaseException:
            moved.cancel()
            await settle(settled, settle_s)
            raise

    def expect(self, count: int, what: str) -> list[tuple[int, asyncio.Future]]:
        """Tokens whose records are posted by someone else (``queue.post`` or a
        device callback), each with its future. Release unused ones with
        :meth:`forget`.
        """
        if self._closed:
            raise LLMException(f"{what}: the transfer engine is closed", status_code=LLMStatusCode.LLM_FAILED)
        loop = asyncio.get_running_loop()
        self._ensure_reader(loop)
        out = []
        for _ in range(count):
            token = next(self._tokens)
            future = loop.create_future()
            self._pending[token] = _Waiter(future, _no_cancel, None, what, None)
            out.append((token, future))
        return out

    def forget(self, token: int) -> None:
        """Stop waiting for ``token``; its future is cancelled if still pending. Safe from any thread: another
        thread hands the cancel to the future's loop, which a cancel from here would not wake."""
        waiter = self._pending.pop(token, None)
        if waiter is None or waiter.future.done():
            return
        future = waiter.future
        loop = future.get_loop()
        if _running_loop() is loop:
            future.cancel()
            return
        try:
            loop.call_soon_threadsafe(future.cancel)
        except RuntimeError:  # the loop is closed: nothing waits on it any more
            pass

    def _ensure_reader(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop in self._loops:
            return
        for old in [lp for lp in self._loops if lp.is_closed()]:
            del self._loops[old]
        loop.add_reader(self._fd, self._on_readable)
        self._loops[loop] = threading.current_thread()

    def _on_timeout(self, token: int) -> None:
        waiter = self._pending.get(token)
        if waiter is None or waiter.future.done():
            return
        waiter.future.set_exception(LLMException(
            f"{waiter.what} timed out after {waiter.timeout_ms} ms",
            status_code=LLMStatusCode.LLM_TIMEOUT))

    def _on_done(self, token: int, waiter: _Waiter, future: asyncio.Future) -> None:
        # The timer goes however the future ended: a record that resolved it took the waiter out of
        # ``_pending`` first (``dispatch``), and a timer left armed would live out the job's whole timeout.
        if waiter.timer is not None:
            waiter.timer.cancel()
            waiter.timer = None
        if self._pending.get(token) is waiter and (future.cancelled() or future.exception() is not None):
            waiter.cancel(token)

    def _on_readable(self) -> None:
        if self._closed:
            return
        self.dispatch(self._queue.drain())

    def dispatch(self, records: list[tuple[int, int, int]]) -> None:
        """Resolve the futures of drained records (those not done already)."""
        for token, status, aux in records:
            waiter = self._pending.pop(token, None)
            if waiter is not None and waiter.settled is not None:
                _settle(waiter.settled)
            if waiter is None or waiter.future.done():
                continue
            loop = waiter.future.get_loop()
            if loop.is_closed():
                continue
            if _running_loop() is loop:
                _resolve(waiter, status, aux)
            else:
                loop.call_soon_threadsafe(_resolve, waiter, status, aux)

    def keepalives(self) -> list[Any]:
        """What the native work still pending keeps alive (memory it may still touch)."""
        return [waiter.keepalive for waiter in self._pending.values()]

    def close(self) -> None:
        """Fail every pending future and remove the loop readers. Idempotent.

        Call after the engines that post to the queue are closed, so that no
        native work is left that could still touch the kept-alive memory.
        """
        if self._closed:
            return
        try:
            self.dispatch(self._queue.drain())
        except ValueError:
            pass
        self._closed = True
        pending, self._pending = self._pending, {}
        for waiter in pending.values():
            if waiter.timer is not None:
                waiter.timer.cancel()
            if waiter.settled is not None:
                _settle(waiter.settled)
            fut = waiter.future
            if not fut.done() and not fut.get_loop().is_closed():
                exc = LLMException(f"{waiter.what}: the transfer engine was closed",
                                   status_code=LLMStatusCode.LLM_FAILED)
                if _running_loop() is fut.get_loop():
                    fut.set_exception(exc)
                else:
                    fut.get_loop().call_soon_threadsafe(_fail_if_pending, fut, exc)
        current = _running_loop()
        for loop in list(self._loops):
            if loop.is_closed():
                continue
            if loop is current or not loop.is_running():
                loop.remove_reader(self._fd)
            else:
                loop.call_soon_threadsafe(loop.remove_reader, self._fd)
        self._loops.clear()


def _no_cancel(token: int) -> None:
    return None


def _fail_when_drained(loop: asyncio.AbstractEventLoop, future: asyncio.Future, exc: BaseException,
                       drained: Callable[[], bool], settled: asyncio.Future | None, what: str) -> None:
    """Fail ``future`` with ``exc`` (and set ``settled``) once ``drained()``, polled from the loop with a growing
    pause; past :data:`FAILED_DRAIN_S` anyway, logged: the device is stuck."""
    deadline = loop.time() + FAILED_DRAIN_S

    def poll(pause: float) -> None:
        done = drained()
        if not done and loop.time() < deadline:
            loop.call_later(pause, poll, min(2 * pause, _DRAIN_POLL_MAX_S))
            return
        if not done:
            log.error("%s: work queued before its submission failed did not end within %.1f s (the device is "
                      "stuck): it may still write after the call returned", what, FAILED_DRAIN_S)
        # Its frames (the submit's, this start's, which holds the future) would make a cycle with the future
        # that keeps what the submit touched until a collection: their locals go, the lines stay.
        traceback.clear_frames(exc.__traceback__)
        if exc.__cause__ is not None:
            traceback.clear_frames(exc.__cause__.__traceback__)
        if not future.done():
            future.set_exception(exc)
        if settled is not None:
            _set_done(settled)

    loop.call_later(_DRAIN_POLL_FIRST_S, poll, _DRAIN_POLL_FIRST_S)


def _settle(future: asyncio.Future) -> None:
    loop = future.get_loop()
    if loop.is_closed():
        return
    if _running_loop() is loop:
        _set_done(future)
    else:
        loop.call_soon_threadsafe(_set_done, future)


def _set_done(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _fail_if_pending(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def _resolve(waiter: _Waiter, status: int, aux: int) -> None:
    future = waiter.future
    if future.done():
        return
    if status == 0:
        future.set_result(aux)
        return
    err = -status
    if err == errno.ECANCELED:
        future.set_exception(LLMException(f"{waiter.what} was cancelled by the engine",
                                          status_code=LLMStatusCode.LLM_FAILED))
        return
    future.set_exception(LLMException(f"{waiter.what} failed: {os.strerror(err)}",
                                      status_code=status_for_errno(err)))
