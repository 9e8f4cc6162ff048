"""Freeing big host memory off the thread that lets it go.

Freeing populated shared memory costs about 0.2 ms per MiB (200 ms for
1 GiB on the project's VM), paid by whoever lets go of the file last, its
mapping or its fd; tearing down a peer's region whose pages were read costs
too (55 ms for 1 GiB). That is often the event loop's thread: a caller, or a
collection there, drops the last tensor of a freed cache; a link closes and
drops a peer's region. :class:`Unmapper` runs such frees of 8 MiB or more on
a thread of its own and smaller ones at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable

__all__ = ["Unmapper"]

log = logging.getLogger(__name__)


class Unmapper:
    """One thread per process that runs the frees handed to :meth:`free` in order; see the module docstring."""

    MIN_BYTES = 8 << 20

    def __init__(self) -> None:
        # put() may run inside a finalizer, that is inside any allocation: SimpleQueue's is reentrant
        self._queue: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def start(self) -> None:
        """Have the thread running in this process; without one (it could not start) frees run in place. Called
        where memory is mapped, never from a finalizer: those may run inside any allocation, a collection's."""
        if self._pid == os.getpid():
            return
        with self._lock:
            if self._pid != os.getpid():
                thread = threading.Thread(target=self._run, args=(self._queue,), name="aio-datadist-unmap",
                                          daemon=True)
                try:
                    thread.start()
                except RuntimeError as exc:  # no thread to be had (RLIMIT_NPROC, memory): free in place
                    log.warning("no thread to unmap big host memory (%s): it is unmapped where it goes", exc)
                    self._thread, self._pid = None, os.getpid()  # not tried again in this process
                    return
                self._thread, self._pid = thread, os.getpid()

    def free(self, size: int, free: Callable[[], object]) -> None:
        """Run ``free`` (it lets go of ``size`` bytes) here if small or if this process has no thread, else there."""
        if size < self.MIN_BYTES or self._pid != os.getpid() or self._thread is None or not self._thread.is_alive():
            free()
        else:
            self._queue.put(free)

    def after_fork_in_child(self) -> None:
        """A forked child: the parent's thread is not here, and its lock may have been held by another thread. What
        was queued still holds mappings and fds the child inherited, of objects gone here too: free them now."""
        self._lock = threading.Lock()
        self._thread, self._pid = None, 0
        inherited, self._queue = self._queue, queue.SimpleQueue()
        while True:
            try:
                free = inherited.get_nowait()
            except queue.Empty:
                break
            with contextlib.suppress(Exception):
                free()

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether everything handed over so far is freed within ``timeout_s`` (at once without a thread: then
        everything was freed in place)."""
        if self._pid != os.getpid() or self._thread is None or not self._thread.is_alive():
            return True
        done = threading.Event()
        self._queue.put(done.set)
        return done.wait(timeout_s)

    @staticmethod
    def _run(work: queue.SimpleQueue[Callable[[], object]]) -> None:
        while True:
            free = work.get()
            try:
                free()  # munmap through ctypes and os.close let the GIL go
            except Exception:
                log.exception("freeing host memory failed")
