"""Small socket jobs the event loop drives itself, with no thread between the socket and the loop.

A :class:`LoopIo` runs one :class:`~aio_datadist._core.LoopJob` (a send, a
receive or a gated receive) on a non-blocking socket: it moves what the
socket takes at once, and again each time the loop sees the socket ready,
each step in the core without the GIL. A small transfer then costs no
hand-off to the engine thread and no completion record back: on two
loopback processes that is the difference between two runnable threads per
transfer and four. Large jobs stay on the ``SocketEngine``, whose thread
keeps the loop free while megabytes move (``link_channels.LOOP_IO_MAX``).

Nothing but the loop steps a job, so a job that is over (done, failed,
cancelled, timed out, or stopped because its socket goes) touches no memory
any more: the loop no longer watches the socket by the time :meth:`stop`
returns or the future is done.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from aio_datadist._completion import status_for_errno
from aio_datadist._core import LoopJob
from aio_datadist.status import LLMException, LLMStatusCode

__all__ = ["LoopIo"]


class LoopIo:
    """One loop-driven job; :attr:`future` gets the bytes moved (see the module docstring)."""

    __slots__ = ("_fd", "_job", "_loop", "_what", "_keepalive", "_timeout_ms", "_timer", "_settled", "_watching",
                 "future")

    @property
    def sending(self) -> bool:
        return self._job.sending

    def __init__(self, fd: int, job: LoopJob, *, what: str, keepalive: Any, timeout_ms: int | None,
                 settled: asyncio.Future | None) -> None:
        loop = asyncio.get_running_loop()
        self._fd = fd
        self._job = job
        self._loop = loop
        self._what = what
        self._keepalive = keepalive
        self._timeout_ms = timeout_ms
        self._settled = settled
        self._watching = False
        self.future: asyncio.Future = loop.create_future()
        self._timer = None
        self.future.add_done_callback(self._finished)
        # Most small jobs end in this first step (a send the socket takes at once): the timer, counted
        # from now, is set only for a job that has to wait.
        start = loop.time()
        self._advance()
        if timeout_ms is not None and self._watching:
            self._timer = loop.call_at(start + timeout_ms / 1000, self._expire)

    def _advance(self) -> None:
        if self.future.done():
            return
        rc = self._job.step()
        if rc == 0:
            if not self._watching:
                if self._job.sending:
                    self._loop.add_writer(self._fd, self._advance)
                else:
                    self._loop.add_reader(self._fd, self._advance)
                self._watching = True
            return
        self._end()
        if rc == 1:
            self.future.set_result(self._job.moved)
        else:
            self.future.set_exception(LLMException(f"{self._what} failed: {os.strerror(-rc)}",
                                                   status_code=status_for_errno(-rc)))

    def _expire(self) -> None:
        self.stop(LLMException(f"{self._what} timed out after {self._timeout_ms} ms",
                               status_code=LLMStatusCode.LLM_TIMEOUT))

    def stop(self, exc: BaseException) -> None:
        """End the job now with ``exc`` (nothing of it runs once this returns); a no-op once it is over."""
        self._end()
        if not self.future.done():
            self.future.set_exception(exc)

    def _end(self) -> None:
        """Stop watching the socket and release what the job kept alive (also on a cancel, see below)."""
        if self._watching:
            if self._job.sending:
                self._loop.remove_writer(self._fd)
            else:
                self._loop.remove_reader(self._fd)
                self._job.release()
            self._watching = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._settled is not None and not self._settled.done():
            self._settled.set_result(None)
        self._keepalive = None

    def _finished(self, _: asyncio.Future) -> None:
        # A future cancelled by its awaiter: no step runs after it is done (``_advance`` checks first).
        self._end()
