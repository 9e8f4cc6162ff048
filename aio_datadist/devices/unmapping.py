"""Freeing big host memory off the thread that lets it go.

Freeing populated shared memory costs about 0.2 ms per MiB (200 ms for
1 GiB on the project's VM), paid by whoever lets go of the file last, its
mapping or its fd; tearing down a peer's region whose pages were read costs
too (55 ms for 1 GiB). That is often the event loop's thread: a caller, or a
collection there, drops the last tensor of a freed cache; a link closes and
drops a peer's region. :class:`Unmapper` runs such frees of 8 MiB or more on
a thread of its own and smaller ones at once.

A fork waits for the free the thread is running (:meth:`Unmapper.before_fork`): so in a forked child every free
handed over is either done (the child never had that mapping) or still queued (the child runs it), never taken
off the queue and not yet run, which left the child a mapping nothing would unmap (seen on Python 3.13).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Unmapper"]

log = logging.getLogger(__name__)

# (free, then): ``free`` None marks a waiter of :meth:`Unmapper.wait_idle` (its ``then`` wakes it), which a forked
# child skips: the waiter is not there, and its lock may have been held by a thread that is not there either.
_Free = tuple[Callable[[], object] | None, Callable[[], object] | None]


class Unmapper:
    """One thread per process that runs the frees handed to :meth:`free` in order; see the module docstring."""

    MIN_BYTES = 8 << 20

    def __init__(self) -> None:
        # free() may run inside a finalizer, that is inside any allocation: a deque's append and SimpleQueue's
        # put are reentrant (no lock of Python's)
        self._frees: collections.deque[_Free] = collections.deque()
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()  # one per free queued
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._lock = threading.Lock()
        # Held while a free runs (taken off the queue and run: one step for a fork, ``before_fork``). Reentrant: a
        # finalizer that a collection runs on the unmapping thread, inside a free, may fork.
        self._running: Any = threading.RLock()  # (typeshed has no _recursion_count: CPython's RLock does)
        self._forking = threading.local()  # per forking thread: its holds of ``_running`` before its fork's hook

    def start(self) -> None:
        """Have the thread running in this process; without one (it could not start) frees run in place. Called
        where memory is mapped, never from a finalizer: those may run inside any allocation, a collection's."""
        if self._pid == os.getpid():
            return
        with self._lock:
            if self._pid != os.getpid():
                thread = threading.Thread(target=self._run, name="aio-datadist-unmap", daemon=True)
                try:
                    thread.start()
                except RuntimeError as exc:  # no thread to be had (RLIMIT_NPROC, memory): free in place
                    log.warning("no thread to unmap big host memory (%s): it is unmapped where it goes", exc)
                    self._thread, self._pid = None, os.getpid()  # not tried again in this process
                    return
                self._thread, self._pid = thread, os.getpid()

    def free(self, size: int, free: Callable[[], object], then: Callable[[], object] | None = None) -> None:
        """Run ``free`` (it lets go of ``size`` bytes), then ``then``, here if small or if this process has no
        thread, else there. ``free`` must take no lock another thread may hold across a fork (a fork waits for
        it: an unmap, a close); ``then`` (bookkeeping) runs after it, outside that wait."""
        if size < self.MIN_BYTES or self._pid != os.getpid() or self._thread is None or not self._thread.is_alive():
            free()
            if then is not None:
                then()
        else:
            self._frees.append((free, then))
            self._wake.put(None)

    def before_fork(self) -> None:
        """``os.register_at_fork(before=...)``: wait for the free running now, and hold the next one back. An
        interrupt in the wait does not stop it (CPython forks anyway after a ``before`` hook raised: it only
        reports it) unless interrupts keep coming (a ``RecursionError``, a ``MemoryError``, a hundred in a row):
        the fork then goes on without waiting, as it did before there was a wait. Whether the lock was taken is
        read from the lock (an interrupt may land just after the acquire), per forking thread. Not covered: an
        interrupt that lands at the very start or end of a hook (CPython's own at-fork hooks, logging's, are as
        exposed there)."""
        held = self._holds()  # this thread's holds already (a finalizer forking in a free)
        self._forking.held = held
        for _ in range(100):
            try:
                self._running.acquire()
                return
            except BaseException as exc:  # (a KeyboardInterrupt here is lost, as CPython would lose it)
                if self._holds() > held or isinstance(exc, (RecursionError, MemoryError)):
                    return  # taken before the interrupt came; or no use trying again

    def _holds(self) -> int:
        """How many times this thread holds ``_running`` (0 if another thread has it; CPython's RLock tells)."""
        count: int = self._running._recursion_count()
        return count

    def after_fork_in_parent(self) -> None:
        """Give back what this thread's ``before_fork`` took, no more, through interrupts too."""
        held = getattr(self._forking, "held", None)
        if held is None:
            return
        for _ in range(100):
            try:
                while self._holds() > held:
                    self._running.release()
                break
            except BaseException:  # an interrupt between two steps: the lock tells what is left to give back
                continue
        self._forking.held = None

    def after_fork_in_child(self) -> None:
        """A forked child: the parent's thread is not here, and its lock may have been held by another thread. What
        was queued still holds mappings and fds the child inherited, of objects gone here too: free them now."""
        self._lock = threading.Lock()
        self._running, self._forking = threading.RLock(), threading.local()  # (the parent's was held for the fork)
        self._thread, self._pid = None, 0
        inherited, self._frees, self._wake = self._frees, collections.deque(), queue.SimpleQueue()
        for free, then in inherited:
            if free is None:  # a parent's thread waiting for the queue: not here
                continue
            with contextlib.suppress(Exception):
                free()
            if then is not None:
                with contextlib.suppress(Exception):
                    then()

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether everything handed over so far is freed within ``timeout_s`` (at once without a thread: then
        everything was freed in place)."""
        if self._pid != os.getpid() or self._thread is None or not self._thread.is_alive():
            return True
        done = threading.Event()
        self._frees.append((None, done.set))
        self._wake.put(None)
        return done.wait(timeout_s)

    def _run(self) -> None:
        while True:
            self._wake.get()
            with self._running:  # taken off the queue and run: one step for a fork
                if not self._frees:
                    continue
                free, then = self._frees.popleft()
                try:
                    if free is not None:
                        free()  # munmap through ctypes and os.close let the GIL go
                except BaseException:  # (the thread lives on: what is queued behind still needs it)
                    log.exception("freeing host memory failed")
                    then = None
            if then is not None:
                try:
                    then()
                except BaseException:
                    log.exception("freeing host memory failed")

